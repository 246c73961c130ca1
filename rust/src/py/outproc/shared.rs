//! What every request of one processor shares, and the object helpers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::core::text::candidates;
use crate::core::text::decoder::TextDecoder;
use crate::core::wire::OutputField;

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
    /// The installed vLLM's `RequestOutput` and `CompletionOutput` attributes, in the
    /// order their `__init__` assigns them (read off its own objects).
    pub(super) request_output_layout: Layout,
    pub(super) completion_layout: Layout,
    /// `EngineCoreOutput` fields that send an output to vLLM's loop when set.
    pub(super) slow_fields: Vec<Py<PyString>>,
    /// The same fields as slots of the decoder's outputs, read in place where an output
    /// is one of those (None if a name is not one of its fields: then by attribute).
    pub(super) slow_slots: Option<Vec<OutputField>>,
    /// vLLM 0.33.0's rule for a `DELTA` output without new ids: no sample logprobs
    /// (`logprobs[:0]`), where 0.25.1 slices `[-0:]`, the whole list.
    pub(super) empty_delta_slice: bool,
}

/// The attributes of RequestOutput the native path knows how to fill, by index.
pub(super) const REQUEST_OUTPUT_FIELDS: [&str; 15] = [
    "request_id",
    "prompt",
    "prompt_token_ids",
    "prompt_logprobs",
    "prompt_token_id_logprobs",
    "outputs",
    "finished",
    "metrics",
    "lora_request",
    "encoder_prompt",
    "encoder_prompt_token_ids",
    "num_cached_tokens",
    "num_cache_creation_tokens",
    "kv_transfer_params",
    "ec_transfer_params",
];

/// The attributes of CompletionOutput the native path knows how to fill, by index.
pub(super) const COMPLETION_FIELDS: [&str; 12] = [
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "routed_experts",
    "finish_reason",
    "stop_reason",
    "lora_request",
    "sampling_mask",
    "spec_decode_metrics",
    "weight_versions",
];

/// One class's attributes in the installed vLLM's order: each name (interned) with its
/// index in the known list (`REQUEST_OUTPUT_FIELDS` or `COMPLETION_FIELDS`).
pub(super) struct Layout {
    names: Vec<Py<PyString>>,
    known: Vec<usize>,
}

impl Layout {
    /// The layout of `names` over `known`; an error names a field the native path does
    /// not know (a vLLM release that added one must not get objects without it).
    pub(super) fn new(
        py: Python<'_>,
        class: &str,
        names: &[String],
        known: &[&str],
    ) -> PyResult<Self> {
        let mut layout = Layout {
            names: Vec::with_capacity(names.len()),
            known: Vec::with_capacity(names.len()),
        };
        for name in names {
            let Some(index) = known.iter().position(|k| k == name) else {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "{class} has a field the native path does not know: {name}"
                )));
            };
            layout.names.push(PyString::intern(py, name).unbind());
            layout.known.push(index);
        }
        Ok(layout)
    }

    /// Whether the class has the known field at `index`.
    pub(super) fn has(&self, index: usize) -> bool {
        self.known.contains(&index)
    }
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

    /// `cls` made without its `__init__`, its instance dict filled in `layout`'s order
    /// from `values` (indexed as the layout's known list; a missing value is None).
    pub(super) fn instance_in<'py>(
        &self,
        py: Python<'py>,
        cls: &Py<PyAny>,
        layout: &Layout,
        values: &mut [Option<Bound<'py, PyAny>>],
    ) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.bare(py, cls)?;
        for (name, &index) in layout.names.iter().zip(&layout.known) {
            let value = values[index]
                .take()
                .unwrap_or_else(|| py.None().into_bound(py));
            obj.setattr(name.bind(py), value)?;
        }
        Ok(obj)
    }

    /// `cls` made without its `__init__`, its instance dict filled in `items`' order (the
    /// order its `__init__` assigns them, which the Python side checked at start-up).
    pub(super) fn instance<'py>(
        &self,
        py: Python<'py>,
        cls: &Py<PyAny>,
        items: &[(&Py<PyString>, Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.bare(py, cls)?;
        for (k, v) in items {
            obj.setattr(k.bind(py), v)?;
        }
        Ok(obj)
    }

    /// A new `cls` with an empty instance dict.
    fn bare<'py>(&self, py: Python<'py>, cls: &Py<PyAny>) -> PyResult<Bound<'py, PyAny>> {
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
