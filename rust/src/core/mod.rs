//! PyO3-free logic: msgpack reader, wire schema, call-id registry, buffer tracking, errors.
