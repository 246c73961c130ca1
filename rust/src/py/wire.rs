//! `corewire._native.wire_fields`: the decoder's wire tables, read-only, so that Python
//! can check them against `corewire.protocol`'s structs.

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::core::wire::{self, CURRENT};

/// The field names of the ``corewire.protocol`` struct ``name`` in the wire order the
/// decoder reads (the map keys of ``EngineCoreEvent``).
///
/// Raises ``KeyError`` for a struct the decoder has no table for; ``wire_structs()``
/// names those it has.
#[pyfunction]
pub fn wire_fields<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyTuple>> {
    match wire::wire_fields(CURRENT, name) {
        Some(names) => PyTuple::new(py, names),
        None => Err(PyKeyError::new_err(name.to_owned())),
    }
}

/// The names of the structs ``wire_fields`` knows.
#[pyfunction]
pub fn wire_structs(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, wire::STRUCTS)
}

/// The vLLM version whose wire the decoder speaks.
#[pyfunction]
pub fn wire_version() -> &'static str {
    CURRENT.version
}
