//! Python objects the decoder uses, looked up once per process.

use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::ffi::NumpyApi;

/// Classes, enum members and C API tables from `corewire.protocol` and numpy.
pub struct Consts {
    /// `FinishReason` members by value (0 stop .. 4 repetition).
    pub finish_reasons: [Py<PyAny>; 5],
    /// `EngineCoreEventType` members by value - 1 (queued, scheduled, preempted).
    pub event_types: [Py<PyAny>; 3],
    pub event_cls: Py<PyAny>,
    pub logprobs_lists: Py<PyAny>,
    pub logprobs_tensors: Py<PyAny>,
    /// From `corewire.wire.layouts`: vLLM 0.33.0's 5-element `LogprobsTensors`, its
    /// `SamplingMaskLists`, and `request_error_from_map` (a `RequestError` from its map).
    pub logprobs_tensors_0_33_0: Py<PyAny>,
    pub sampling_mask_lists: Py<PyAny>,
    pub request_error: Py<PyAny>,
    pub utility_result: Py<PyAny>,
    pub utility_output: Py<PyAny>,
    /// `tuple.__new__`, to make named tuples without running their Python `__new__`.
    pub tuple_new: Py<PyAny>,
    pub numpy: NumpyApi,
    np_dtype: Py<PyAny>,
}

static CONSTS: PyOnceLock<Consts> = PyOnceLock::new();

impl Consts {
    /// The process-wide constants (imported on first use).
    pub fn get(py: Python<'_>) -> PyResult<&'static Consts> {
        CONSTS.get_or_try_init(py, || Self::load(py))
    }

    fn load(py: Python<'_>) -> PyResult<Consts> {
        let protocol = py.import("corewire.protocol")?;
        let layouts = py.import("corewire.wire.layouts")?;
        let v0_33_0 = layouts.getattr("V0_33_0_TYPES")?;
        let finish = protocol.getattr("FinishReason")?;
        let event_type = protocol.getattr("EngineCoreEventType")?;
        let member = |cls: &Bound<'_, PyAny>, v: u8| cls.call1((v,)).map(Bound::unbind);
        Ok(Consts {
            finish_reasons: [
                member(&finish, 0)?,
                member(&finish, 1)?,
                member(&finish, 2)?,
                member(&finish, 3)?,
                member(&finish, 4)?,
            ],
            event_types: [
                member(&event_type, 1)?,
                member(&event_type, 2)?,
                member(&event_type, 3)?,
            ],
            event_cls: protocol.getattr("EngineCoreEvent")?.unbind(),
            logprobs_lists: protocol.getattr("LogprobsLists")?.unbind(),
            logprobs_tensors: protocol.getattr("LogprobsTensors")?.unbind(),
            logprobs_tensors_0_33_0: v0_33_0.get_item("LogprobsTensors")?.unbind(),
            sampling_mask_lists: layouts.getattr("SamplingMaskLists")?.unbind(),
            request_error: layouts.getattr("request_error_from_map")?.unbind(),
            utility_result: protocol.getattr("UtilityResult")?.unbind(),
            utility_output: protocol.getattr("UtilityOutput")?.unbind(),
            tuple_new: py
                .get_type::<pyo3::types::PyTuple>()
                .getattr("__new__")?
                .unbind(),
            numpy: NumpyApi::load(py)?,
            np_dtype: py.import("numpy")?.getattr("dtype")?.unbind(),
        })
    }

    /// The numpy dtype for a wire dtype string and its itemsize; `None` if numpy does
    /// not know it or it cannot travel as raw bytes (objects, fields, sub-arrays, size 0).
    pub fn numpy_dtype<'py>(
        &self,
        py: Python<'py>,
        s: &str,
    ) -> PyResult<Option<(Bound<'py, PyAny>, usize)>> {
        let dtype = match self.np_dtype.bind(py).call1((s,)) {
            Ok(d) => d,
            Err(e) if e.is_instance_of::<PyMemoryError>(py) => return Err(e),
            Err(_) => return Ok(None),
        };
        if dtype.getattr("hasobject")?.is_truthy()?
            || !dtype.getattr("names")?.is_none()
            || !dtype.getattr("subdtype")?.is_none()
        {
            return Ok(None);
        }
        let itemsize: usize = dtype.getattr("itemsize")?.extract()?;
        if itemsize == 0 {
            return Ok(None);
        }
        Ok(Some((dtype, itemsize)))
    }
}

/// Most distinct dtype strings remembered per decoder (a peer cannot grow it further).
const DTYPE_CACHE_MAX: usize = 32;

/// Wire dtype string -> (dtype object, itemsize), for the few dtypes a peer uses.
#[derive(Default)]
pub struct DtypeCache {
    entries: Vec<DtypeEntry>,
}

struct DtypeEntry {
    /// The dtype string's first 16 bytes, zero-padded: numpy's strings (`"<f4"`) and
    /// torch's names (`"bfloat16"`) fit, so finding one is a compare of two words
    /// (a lookup runs for every array, three times per output with logprobs).
    head: u128,
    key: Box<str>,
    dtype: Py<PyAny>,
    itemsize: usize,
}

/// The first 16 bytes of `s`, zero-padded, as a little-endian number. Built byte by
/// byte in a register: copying into a stack buffer and reading it back as words stalls
/// on store forwarding, which cost more than the whole lookup.
#[inline]
fn head(s: &[u8]) -> u128 {
    let mut v = 0u128;
    for (i, &b) in s.iter().take(16).enumerate() {
        v |= (b as u128) << (8 * i);
    }
    v
}

/// What `DtypeCache::lookup` finds: the dtype object and its itemsize, or None.
pub type DtypeFound<'py> = Option<(Bound<'py, PyAny>, usize)>;

impl DtypeCache {
    /// The cached dtype object for `s` (borrowed: entries live as long as the cache) and
    /// its itemsize.
    #[inline]
    pub fn find(&self, s: &str) -> Option<(*mut pyo3::ffi::PyObject, usize)> {
        let h = head(s.as_bytes());
        self.entries
            .iter()
            .find(|e| e.head == h && e.key.len() == s.len() && (s.len() <= 16 || *e.key == *s))
            .map(|e| (e.dtype.as_ptr(), e.itemsize))
    }

    /// The cached entry for `s`, or what `make` says (cached when found and room left).
    #[inline]
    pub fn lookup<'py>(
        &mut self,
        py: Python<'py>,
        s: &str,
        make: impl FnOnce(Python<'py>, &str) -> PyResult<DtypeFound<'py>>,
    ) -> PyResult<DtypeFound<'py>> {
        let h = head(s.as_bytes());
        for e in &self.entries {
            if e.head == h && (s.len() <= 16 || *e.key == *s) && e.key.len() == s.len() {
                return Ok(Some((e.dtype.bind(py).clone(), e.itemsize)));
            }
        }
        self.lookup_slow(py, s, make)
    }

    #[cold]
    #[inline(never)]
    fn lookup_slow<'py>(
        &mut self,
        py: Python<'py>,
        s: &str,
        make: impl FnOnce(Python<'py>, &str) -> PyResult<DtypeFound<'py>>,
    ) -> PyResult<DtypeFound<'py>> {
        let made = make(py, s)?;
        if let Some((dtype, itemsize)) = &made {
            if self.entries.len() < DTYPE_CACHE_MAX {
                self.entries.push(DtypeEntry {
                    head: head(s.as_bytes()),
                    key: s.into(),
                    dtype: dtype.clone().unbind(),
                    itemsize: *itemsize,
                });
            }
        }
        Ok(made)
    }
}
