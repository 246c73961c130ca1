//! (placeholder: filled in by the router work)

use pyo3::prelude::*;

/// Registers this file's binding types on the extension module.
pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
