//! (placeholder: filled in by the router work)
