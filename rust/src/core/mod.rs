//! PyO3-free logic: msgpack reader, wire schema, call-id registry, buffer tracking, errors,
//! and (feature `text`) the text side of output processing.

pub mod registry;
pub mod router;
pub mod tracker;

pub mod error;
pub mod histogram;
pub mod intern;
pub mod msgpack;
pub mod schema;
pub mod sse;
pub mod tree;
pub mod wire;

#[cfg(feature = "text")]
pub mod text;

#[cfg(test)]
mod depth_tests;
#[cfg(test)]
mod schema_tests;
