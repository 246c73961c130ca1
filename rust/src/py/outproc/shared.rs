//! What every request of one processor shares, and the object helpers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::core::text::candidates;
use crate::core::text::decoder::TextDecoder;

/// A candidate's string and whether it ends in U+FFFD.
type Candidate = (Py<PyString>, bool);

/// What every request of one processor shares: the tokenizer and vLLM's classes.
pub(super) struct Shared {
    pub(super) tokenizer: TextDecoder,
    pub(super) added: Arc<HashMap<u32, String>>,
    /// Candidate strings by id, filled on first use through `single_string` (vLLM's
    /// own function, so that they are exactly vLLM's), with whether each ends in U+FFFD.
    pub(super) cache: Mutex<Vec<Option<Candidate>>>,
    pub(super) single_string: Py<PyAny>,
    /// Python's decode of a run of ids, when the crate's decode may differ from it.
    pub(super) python_decode: Option<Py<PyAny>>,
    pub(super) warn: Py<PyAny>,
    /// `object.__new__`'s C function and an empty tuple to call it with: instances made
    /// without a Python call, their attributes set in `__init__`'s order.
    pub(super) object_new: ffi::newfunc,
    pub(super) empty: Py<PyTuple>,
    pub(super) request_output: Py<PyAny>,
    pub(super) completion_output: Py<PyAny>,
    pub(super) logprob: Py<PyAny>,
    pub(super) flat_logprobs: Py<PyAny>,
}

impl Shared {
    /// A candidate's own string and whether it ends in U+FFFD.
    pub(super) fn single<'py>(
        &self,
        py: Python<'py>,
        id: i64,
    ) -> PyResult<(Bound<'py, PyString>, bool)> {
        let slot = usize::try_from(id).ok();
        if let Some(i) = slot {
            let cache = self.cache.lock().expect("candidate cache");
            if let Some(Some((s, bad))) = cache.get(i) {
                return Ok((s.bind(py).clone(), *bad));
            }
        }
        // Not under the lock: the call runs Python.
        let s = self
            .single_string
            .bind(py)
            .call1((id,))?
            .cast_into::<PyString>()?;
        let bad = candidates::incomplete(s.to_str()?);
        if let Some(i) = slot {
            let mut cache = self.cache.lock().expect("candidate cache");
            if let Some(entry) = cache.get_mut(i) {
                *entry = Some((s.clone().unbind(), bad));
            }
        }
        Ok((s, bad))
    }

    pub(super) fn decode(&self, py: Python<'_>, ids: &[u32]) -> PyResult<String> {
        match &self.python_decode {
            Some(f) => f.bind(py).call1((ids.to_vec(),))?.extract(),
            None => self
                .tokenizer
                .decode(ids, false)
                .map_err(|e| PyRuntimeError::new_err(e.0)),
        }
    }

    /// `cls` made without its `__init__`, its instance dict filled in `items`' order (the
    /// order its `__init__` assigns them, which the Python side checked at start-up).
    pub(super) fn instance<'py>(
        &self,
        py: Python<'py>,
        cls: &Py<PyAny>,
        items: &[(&Py<PyString>, Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `cls` is a class whose `__new__` is `object.__new__` (checked when the
        // processor was made); the call takes no arguments.
        let obj = unsafe {
            Bound::from_owned_ptr_or_err(
                py,
                (self.object_new)(
                    cls.as_ptr().cast(),
                    self.empty.as_ptr(),
                    std::ptr::null_mut(),
                ),
            )?
        };
        for (k, v) in items {
            obj.setattr(k.bind(py), v)?;
        }
        Ok(obj)
    }
}

/// Leaves `obj` out of the cyclic collector's scans.
///
/// A request keeps every position's logprobs until it finishes (vLLM's processor does
/// too), so a long stream piles up thousands of `Logprob` objects and dicts; tracked, they
/// make each full collection scan them all, again and again. A `Logprob` holds a float, an
/// int and a string, and can be part of no cycle.
pub(super) fn untrack(obj: &Bound<'_, PyAny>) {
    // SAFETY: a live GC object; untracking an untracked object is a no-op.
    unsafe {
        if ffi::PyObject_GC_IsTracked(obj.as_ptr()) != 0 {
            ffi::PyObject_GC_UnTrack(obj.as_ptr().cast());
        }
    }
}
