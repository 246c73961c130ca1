//! (placeholder: filled in by the tracker work)
