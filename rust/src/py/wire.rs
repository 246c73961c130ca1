//! `corewire._native.wire_fields`: the decoder's wire tables, read-only, so that Python
//! can check them against `corewire.protocol`'s structs.

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::core::wire::{self, Layout, Protocol};

/// The layout of `protocol` (when None, 0.25.1's: the wire `corewire.protocol` declares).
fn layout_of(protocol: Option<&str>) -> PyResult<&'static Layout> {
    match protocol {
        None => Ok(Protocol::DEFAULT.layout()),
        Some(name) => Protocol::from_name(name)
            .map(Protocol::layout)
            .ok_or_else(|| PyValueError::new_err(format!("unsupported protocol {name:?}"))),
    }
}

/// The field names of struct ``name`` in the wire order the decoder reads for
/// ``protocol`` (default: 0.25.1, whose wire ``corewire.protocol`` declares; the map
/// keys of ``EngineCoreEvent``).
///
/// Raises ``KeyError`` for a struct the decoder has no table for in that version;
/// ``wire_structs(protocol)`` names those it has.
#[pyfunction]
#[pyo3(signature = (name, protocol = None))]
pub fn wire_fields<'py>(
    py: Python<'py>,
    name: &str,
    protocol: Option<&str>,
) -> PyResult<Bound<'py, PyTuple>> {
    match wire::wire_fields(layout_of(protocol)?, name) {
        Some(names) => PyTuple::new(py, names),
        None => Err(PyKeyError::new_err(name.to_owned())),
    }
}

/// The names of the structs ``wire_fields`` knows for ``protocol``.
#[pyfunction]
#[pyo3(signature = (protocol = None))]
pub fn wire_structs<'py>(py: Python<'py>, protocol: Option<&str>) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, wire::structs(layout_of(protocol)?))
}

/// The vLLM version whose wire ``corewire.protocol``'s structs declare (the decoder's
/// first compiled walk; a decoder's own default is ``corewire.releases.DEFAULT``).
#[pyfunction]
pub fn wire_version() -> &'static str {
    Protocol::DEFAULT.name()
}

/// Every vLLM version the decoder has a compiled walk for, oldest first.
#[pyfunction]
pub fn wire_versions(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, Protocol::ALL.map(Protocol::name))
}
