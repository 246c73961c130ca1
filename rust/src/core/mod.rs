//! PyO3-free logic: msgpack reader, wire schema, call-id registry, buffer tracking, errors.

pub mod registry;
pub mod router;
pub mod tracker;
