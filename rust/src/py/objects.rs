//! The Python objects a decoded message is made of.
//!
//! `EngineCoreOutputs` and `EngineCoreOutput` mirror `corewire.protocol`'s structs of the
//! same names, field for field (same names, same order in `__struct_fields__`). They are
//! frozen and carry no `__traverse__`, so they are not tracked by the cyclic GC, and
//! their fields are plain struct members: reading `out.request_id` is as cheap as a
//! `__slots__` attribute. `new_token_ids` alone is built on first access (then kept), so
//! decoding allocates no GC-tracked object per output that the caller does not read.
//!
//! Because they are untracked, a reference cycle made *through* them (appending a
//! message to its own `outputs` list) is never collected; nothing in corewire does that.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};

use super::ffi::HeldBuffer;

/// Token ids stored inline up to this many (a decode step emits 1; speculative decoding
/// a few), so an output needs no allocation besides the object itself.
const INLINE_TOKENS: usize = 6;

/// The raw token ids of one output, until (and after) they become a list.
pub enum TokenIds {
    Inline { len: u8, ids: [u32; INLINE_TOKENS] },
    Heap(Box<[i128]>),
}

impl TokenIds {
    /// Stores `ids` (any msgpack integers).
    #[inline]
    pub fn new(ids: &[i128]) -> Self {
        if ids.len() <= INLINE_TOKENS {
            let mut inline = [0u32; INLINE_TOKENS];
            let mut fits = true;
            for (slot, &id) in inline.iter_mut().zip(ids) {
                match u32::try_from(id) {
                    Ok(v) => *slot = v,
                    Err(_) => {
                        fits = false;
                        break;
                    }
                }
            }
            if fits {
                return TokenIds::Inline {
                    len: ids.len() as u8,
                    ids: inline,
                };
            }
        }
        TokenIds::Heap(ids.into())
    }

    /// A new list of Python ints.
    pub fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        match self {
            TokenIds::Inline { len, ids } => {
                list_of(py, ids[..*len as usize].iter().map(|&v| v as i128))
            }
            TokenIds::Heap(ids) => list_of(py, ids.iter().copied()),
        }
    }
}

/// A Python int for any msgpack integer.
#[inline]
pub fn int_object(py: Python<'_>, v: i128) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: plain constructors returning a new reference or NULL with an exception.
    unsafe {
        let ptr = match i64::try_from(v) {
            Ok(small) => ffi::PyLong_FromLongLong(small),
            Err(_) => ffi::PyLong_FromUnsignedLongLong(v as u64),
        };
        Bound::from_owned_ptr_or_err(py, ptr)
    }
}

fn list_of<'py>(
    py: Python<'py>,
    items: impl ExactSizeIterator<Item = i128>,
) -> PyResult<Bound<'py, PyList>> {
    // SAFETY: PyList_New gives a list of NULLs that is filled completely before use;
    // PyList_SetItem steals each new reference.
    unsafe {
        let list = Bound::from_owned_ptr_or_err(py, ffi::PyList_New(items.len() as isize))?;
        for (i, v) in items.enumerate() {
            let item = int_object(py, v)?;
            ffi::PyList_SetItem(list.as_ptr(), i as isize, item.into_ptr());
        }
        Ok(list.cast_into_unchecked())
    }
}

/// One request's new output (`corewire.protocol.EngineCoreOutput`'s fields).
#[pyclass(
    module = "corewire._native",
    name = "EngineCoreOutput",
    frozen,
    freelist = 4096
)]
pub struct EngineCoreOutput {
    /// The request id (the same str object every time this id is decoded).
    #[pyo3(get)]
    pub request_id: Py<PyAny>,
    pub tokens: TokenIds,
    pub token_list: PyOnceLock<Py<PyList>>,
    /// `LogprobsLists` of numpy arrays, or None.
    #[pyo3(get)]
    pub new_logprobs: Py<PyAny>,
    /// `LogprobsTensors` of torch tensors, or None.
    #[pyo3(get)]
    pub new_prompt_logprobs_tensors: Py<PyAny>,
    /// A torch tensor, or None.
    #[pyo3(get)]
    pub pooling_output: Py<PyAny>,
    /// A `FinishReason` member, or None.
    #[pyo3(get)]
    pub finish_reason: Py<PyAny>,
    /// int, str or None.
    #[pyo3(get)]
    pub stop_reason: Py<PyAny>,
    /// A list of `EngineCoreEvent`, or None.
    #[pyo3(get)]
    pub events: Py<PyAny>,
    /// A dict, or None.
    #[pyo3(get)]
    pub kv_transfer_params: Py<PyAny>,
    /// A dict of str, or None.
    #[pyo3(get)]
    pub trace_headers: Py<PyAny>,
    /// A dict, or None.
    #[pyo3(get)]
    pub prefill_stats: Py<PyAny>,
    /// A numpy array, or None.
    #[pyo3(get)]
    pub routed_experts: Py<PyAny>,
    /// An int.
    #[pyo3(get)]
    pub num_nans_in_logits: Py<PyAny>,
}

const OUTPUT_FIELDS: [&str; 13] = [
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "pooling_output",
    "finish_reason",
    "stop_reason",
    "events",
    "kv_transfer_params",
    "trace_headers",
    "prefill_stats",
    "routed_experts",
    "num_nans_in_logits",
];

const OUTPUTS_FIELDS: [&str; 8] = [
    "engine_index",
    "outputs",
    "scheduler_stats",
    "timestamp",
    "utility_output",
    "finished_requests",
    "wave_complete",
    "start_wave",
];

#[pymethods]
impl EngineCoreOutput {
    /// The new token ids, a list of int (built on first access, then the same list).
    #[getter]
    fn new_token_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        if let Some(list) = self.token_list.get(py) {
            return Ok(list.clone_ref(py));
        }
        let list = self
            .token_list
            .get_or_try_init(py, || self.tokens.to_list(py).map(Bound::unbind))?;
        Ok(list.clone_ref(py))
    }

    /// Whether this is the request's last output (`finish_reason is not None`).
    #[getter]
    fn finished(&self, py: Python<'_>) -> bool {
        !self.finish_reason.is_none(py)
    }

    /// Field names in wire order, as on `corewire.protocol.EngineCoreOutput`.
    #[classattr]
    fn __struct_fields__(py: Python<'_>) -> PyResult<Py<PyTuple>> {
        Ok(PyTuple::new(py, OUTPUT_FIELDS)?.unbind())
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        fields_repr(slf.as_any(), "EngineCoreOutput", &OUTPUT_FIELDS)
    }
}

/// One message from an engine (`corewire.protocol.EngineCoreOutputs`'s fields).
#[pyclass(
    module = "corewire._native",
    name = "EngineCoreOutputs",
    frozen,
    freelist = 64
)]
pub struct EngineCoreOutputs {
    /// Index of the engine that sent the message.
    #[pyo3(get)]
    pub engine_index: Py<PyAny>,
    /// A list of `EngineCoreOutput`.
    #[pyo3(get)]
    pub outputs: Py<PyAny>,
    /// A dict, or None.
    #[pyo3(get)]
    pub scheduler_stats: Py<PyAny>,
    /// The engine's monotonic clock, in seconds.
    #[pyo3(get)]
    pub timestamp: Py<PyAny>,
    /// A `corewire.protocol.UtilityOutput`, or None.
    #[pyo3(get)]
    pub utility_output: Py<PyAny>,
    /// A set of request ids, or None.
    #[pyo3(get)]
    pub finished_requests: Py<PyAny>,
    /// An int, or None.
    #[pyo3(get)]
    pub wave_complete: Py<PyAny>,
    /// An int, or None.
    #[pyo3(get)]
    pub start_wave: Py<PyAny>,
}

#[pymethods]
impl EngineCoreOutputs {
    /// Field names in wire order, as on `corewire.protocol.EngineCoreOutputs`.
    #[classattr]
    fn __struct_fields__(py: Python<'_>) -> PyResult<Py<PyTuple>> {
        Ok(PyTuple::new(py, OUTPUTS_FIELDS)?.unbind())
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        fields_repr(slf.as_any(), "EngineCoreOutputs", &OUTPUTS_FIELDS)
    }
}

#[cold]
fn fields_repr(obj: &Bound<'_, PyAny>, name: &str, fields: &[&str]) -> PyResult<String> {
    let mut parts = Vec::with_capacity(fields.len());
    for field in fields {
        let value = obj.getattr(*field)?;
        parts.push(format!("{field}={}", value.repr()?));
    }
    Ok(format!("{name}({})", parts.join(", ")))
}

/// Keeps a received frame's buffer export alive for the arrays that view it: the `base`
/// of every decoded ndarray over a non-`bytes` frame. The frame is released when the
/// last such array is gone.
#[pyclass(module = "corewire._native", name = "FrameBuffer", frozen)]
pub struct FrameBuffer {
    pub held: HeldBuffer,
}

#[pymethods]
impl FrameBuffer {
    /// Number of bytes in the frame.
    fn __len__(&self) -> usize {
        self.held.len()
    }

    /// The object whose memory this is (a `zmq.Frame`, `memoryview` ...).
    #[getter]
    fn obj(&self, py: Python<'_>) -> Py<PyAny> {
        self.held.exporter(py)
    }
}
