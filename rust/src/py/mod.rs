//! Thin binding types of `corewire._native`, one file per Python type.

use pyo3::prelude::*;

mod registry;
mod router;
mod tracker;

mod builder;
mod consts;
mod decoder;
mod ffi;
mod frames;
mod objects;
mod torch;

pyo3::create_exception!(
    corewire,
    ProtocolError,
    pyo3::exceptions::PyValueError,
    "A frame that does not follow the engine-core wire protocol."
);

/// Registers every binding type on the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ProtocolError", m.py().get_type::<ProtocolError>())?;
    registry::register(m)?;
    tracker::register(m)?;
    router::register(m)?;
    decoder::register(m)?;
    Ok(())
}
