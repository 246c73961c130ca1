//! Thin binding types of `corewire._native`, one file per Python type.
//!
//! Modules depend on each other in one direction only:
//! `decoder -> builder -> objects / frames / consts / torch -> ffi / list / refcnt`, and
//! `outproc -> objects` (it reads decoded outputs in place); `registry`,
//! `tracker`, `router`, `histogram` and `wire` stand alone over the core. [`register`] is the one
//! place that puts names on the extension module.

use pyo3::prelude::*;

mod registry;
mod router;
mod tracker;

mod arrays;
mod builder;
mod consts;
mod decoder;
mod ffi;
mod frames;
mod histogram;
mod list;
mod objects;
mod outproc;
mod refcnt;
mod torch;
mod wire;

/// Registers every binding type and function on the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ProtocolError", py.get_type::<decoder::ProtocolError>())?;
    m.add_class::<registry::CallRegistry>()?;
    m.add_class::<tracker::SendTracker>()?;
    m.add_class::<router::Router>()?;
    m.add_class::<decoder::NativeDecoder>()?;
    let [message, output] = objects::types(py)?;
    m.add("EngineCoreOutputs", message.bind(py))?;
    m.add("EngineCoreOutput", output.bind(py))?;
    m.add_class::<frames::FrameBuffer>()?;
    m.add_class::<outproc::OutputCore>()?;
    m.add_class::<outproc::RequestText>()?;
    m.add("TOKENIZERS_VERSION", outproc::TOKENIZERS_VERSION)?;
    m.add_function(wrap_pyfunction!(histogram::fold_observations, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_fields, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_structs, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_version, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_versions, m)?)?;
    Ok(())
}
