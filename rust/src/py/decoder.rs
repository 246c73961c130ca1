//! `corewire._native.NativeDecoder`: engine output frames -> Python objects.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::builder::{DecoderState, PyBuilder, StatsTypes};
use super::consts::{Consts, DtypeCache};
use super::frames::Frame;
use crate::core::error::{DecodeError, ErrorKind};
use crate::core::intern::InternCache;
use crate::core::schema::{decode_outputs_for, Scratch};
use crate::core::wire::{layout_from_names, LayoutNames, LayoutRef, Protocol};

pyo3::create_exception!(
    corewire,
    ProtocolError,
    pyo3::exceptions::PyValueError,
    "A frame that does not follow the engine-core wire protocol."
);

/// Decodes `EngineCoreOutputs` frames (`[payload, aux_1, ...]`) into Python objects.
///
/// `release` is the vLLM release whose wire the frames follow (default:
/// `corewire.releases.DEFAULT`, the installed vLLM's release, else the newest). `layout`, when given, says where that version puts each field: a
/// mapping from each struct's name (`EngineCoreOutputs`, `EngineCoreOutput`,
/// `UtilityOutput`, `LogprobsLists`, `LogprobsTensors`, and `SamplingMaskLists` where the
/// version has it) to its field names in wire order, derived from that release's own
/// structs (`corewire.releases`); any release whose fields the decoder knows can then be
/// read, a compiled-in walk is used where the positions are one of its own, and a field
/// it does not know raises `ValueError` naming it. Without `layout`, a version other than
/// the compiled-in ones is laid out as `corewire.releases` has it (one it does not know
/// raises `corewire.releases.UnsupportedProtocolError`). The decoded
/// objects carry every version's fields as attributes (a field the version lacks is
/// None, or 0 for a count). A frame of another layout with request outputs fails with
/// `ProtocolError`; one without outputs (a utility reply, stats only) may decode under
/// either (docs/protocol.md, "Versions").
///
/// Arrays and tensors are zero-copy views of the frames and keep them alive; request
/// ids are interned (bounded); malformed frames raise `corewire.ProtocolError`. One
/// decoder is meant for one thread (the receiving loop); it is not re-entrant.
#[pyclass(module = "corewire._native", name = "NativeDecoder")]
pub struct NativeDecoder {
    consts: &'static Consts,
    state: DecoderState,
    scratch: Scratch,
    stats_types: StatsTypes,
    /// The positions the walk reads.
    layout: LayoutRef,
    /// The release named by the caller (or the default's).
    release: String,
}

/// Frames per message handled without a heap allocation.
const FEW_FRAMES: usize = 8;

/// Default bound of the request-id intern cache.
const DEFAULT_INTERN_CAPACITY: usize = 16_384;
/// Bound of the map-key cache.
const KEY_CACHE_CAPACITY: usize = 1024;
/// Keys longer than this are not worth caching.
const MAX_CACHED_KEY: usize = 64;

#[pymethods]
impl NativeDecoder {
    #[new]
    #[pyo3(
        signature = (intern_capacity = DEFAULT_INTERN_CAPACITY, *, prefill_stats = None, scheduler_stats = None, release = None, layout = None, protocol = None),
        text_signature = "(intern_capacity=16384, *, prefill_stats=None, scheduler_stats=None, release=None, layout=None, protocol=None)"
    )]
    fn new(
        py: Python<'_>,
        intern_capacity: usize,
        prefill_stats: Option<Bound<'_, PyAny>>,
        scheduler_stats: Option<Bound<'_, PyAny>>,
        release: Option<&str>,
        layout: Option<Bound<'_, PyAny>>,
        protocol: Option<&str>,
    ) -> PyResult<Self> {
        let release = deprecated_protocol(py, release, protocol)?;
        // Without a release, the one every other part of corewire defaults to (it
        // depends on the installed vLLM, which only the Python side knows).
        let name = match release {
            Some(n) => n.to_owned(),
            None => default_release(py)?,
        };
        let layout = match layout {
            Some(map) => layout_of_mapping(&name, &map)?,
            None => match Protocol::from_name(&name) {
                Some(p) => LayoutRef::Builtin(p),
                None => layout_of_mapping(&name, &release_layout(py, &name)?)?,
            },
        };
        let callable = |name: &str, v: Option<Bound<'_, PyAny>>| -> PyResult<Option<Py<PyAny>>> {
            match v {
                Some(f) if !f.is_callable() => Err(pyo3::exceptions::PyTypeError::new_err(
                    format!("{name} must be callable"),
                )),
                v => Ok(v.map(Bound::unbind)),
            }
        };
        let stats_types = StatsTypes {
            prefill: callable("prefill_stats", prefill_stats)?,
            scheduler: callable("scheduler_stats", scheduler_stats)?,
        };
        let mut keys = InternCache::new(KEY_CACHE_CAPACITY);
        keys.set_max_key_len(MAX_CACHED_KEY);
        Ok(NativeDecoder {
            consts: Consts::get(py)?,
            state: DecoderState {
                ids: InternCache::new(intern_capacity.max(2)),
                keys,
                np_dtypes: DtypeCache::default(),
                torch_dtypes: DtypeCache::default(),
                orders: Vec::new(),
                refreshed_at: 0,
            },
            scratch: Scratch::default(),
            stats_types,
            layout,
            release: name,
        })
    }

    /// Decodes one message: `frames` is `[payload, aux_1, ...]` as a list or tuple of
    /// `bytes`, `bytearray`, `memoryview` or `zmq.Frame` (a single buffer is the payload).
    fn decode(&mut self, py: Python<'_>, frames: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let mut held = acquire_frames(frames).map_err(to_protocol_error)?;
        // The frames' bytes for the core, on the stack for the usual few frames. They
        // borrow the frames' memory, not `held` itself: the builder below needs `held`
        // mutably to create array owners, which never moves or frees that memory.
        let mut few: [&[u8]; FEW_FRAMES] = [&[]; FEW_FRAMES];
        let many: Vec<&[u8]>;
        let slices: &[&[u8]] = if held.len() <= FEW_FRAMES {
            for (slot, frame) in few.iter_mut().zip(&held) {
                // SAFETY: `held` is declared first, so it outlives the slices.
                *slot = unsafe { detach(frame) };
            }
            &few[..held.len()]
        } else {
            // SAFETY: as above.
            many = held.iter().map(|f| unsafe { detach(f) }).collect();
            &many
        };
        let mut builder = PyBuilder::new(
            py,
            self.consts,
            &mut self.state,
            &mut held,
            &self.stats_types,
            self.layout,
        );
        let scratch = &mut self.scratch;
        let layout = self.layout;
        let result = catch_unwind(AssertUnwindSafe(|| {
            decode_outputs_for(layout, slices, &mut builder, scratch)
        }));
        match result {
            Ok(Ok(obj)) => Ok(obj.unbind()),
            Ok(Err(err)) => {
                let foreign = builder.error.take();
                Err(match (err.kind(), foreign) {
                    (ErrorKind::Foreign, Some(py_err)) => py_err,
                    _ => to_protocol_error(err),
                })
            }
            Err(_) => Err(ProtocolError::new_err(
                "EngineCoreOutputs: internal decoder error (a bug in corewire): frame rejected",
            )),
        }
    }

    /// The vLLM release whose wire this decoder reads (`"0.25.1"`, `"0.33.0"`...).
    #[getter]
    fn release(&self) -> &str {
        &self.release
    }

    /// Deprecated name of :attr:`release`.
    #[getter]
    fn protocol(&self, py: Python<'_>) -> PyResult<&str> {
        warn_deprecated(
            py,
            c"NativeDecoder.protocol is deprecated: read NativeDecoder.release",
        )?;
        Ok(&self.release)
    }

    /// Whether the walk is one compiled into this build for these positions (the fastest),
    /// rather than one over positions read at run time.
    #[getter]
    fn compiled_layout(&self) -> bool {
        matches!(self.layout, LayoutRef::Builtin(_))
    }

    /// Number of request ids held by the intern cache now.
    #[getter]
    fn interned(&self) -> usize {
        self.state.ids.len()
    }

    /// Most request ids the intern cache holds.
    #[getter]
    fn intern_capacity(&self) -> usize {
        self.state.ids.capacity()
    }
}

/// The struct names a `layout` mapping has, in [`LayoutNames`]' order (the last optional).
const LAYOUT_STRUCTS: [&str; 6] = [
    "EngineCoreOutputs",
    "EngineCoreOutput",
    "UtilityOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "SamplingMaskLists",
];

/// The layout a `layout=` mapping describes (see `NativeDecoder`).
fn layout_of_mapping(version: &str, map: &Bound<'_, PyAny>) -> PyResult<LayoutRef> {
    let mut names: Vec<Option<Vec<String>>> = Vec::with_capacity(LAYOUT_STRUCTS.len());
    for (i, strukt) in LAYOUT_STRUCTS.iter().enumerate() {
        let optional = i == LAYOUT_STRUCTS.len() - 1;
        let fields = match map.get_item(strukt) {
            Ok(v) if v.is_none() && optional => None,
            Ok(v) => Some(
                v.try_iter()?
                    .map(|f| f.and_then(|f| f.extract::<String>()))
                    .collect::<PyResult<Vec<String>>>()?,
            ),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyError>(map.py()) && optional => {
                None
            }
            Err(e) => return Err(e),
        };
        names.push(fields);
    }
    let refs: Vec<Option<Vec<&str>>> = names
        .iter()
        .map(|n| n.as_ref().map(|v| v.iter().map(String::as_str).collect()))
        .collect();
    let get = |i: usize| refs[i].as_deref().unwrap_or(&[]);
    let spec = LayoutNames {
        message: get(0),
        output: get(1),
        utility_output: get(2),
        logprobs_lists: get(3),
        logprobs_tensors: get(4),
        sampling_mask: refs[5].as_deref(),
    };
    layout_from_names(version, spec).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The frames of a message: a list or tuple of buffers, or one buffer.
fn acquire_frames<'py>(frames: &Bound<'py, PyAny>) -> Result<Vec<Frame<'py>>, DecodeError> {
    if let Ok(list) = frames.cast::<PyList>() {
        return collect(list.iter());
    }
    if let Ok(tuple) = frames.cast::<PyTuple>() {
        return collect(tuple.iter());
    }
    Ok(vec![Frame::acquire(0, frames)?])
}

fn collect<'py>(
    items: impl ExactSizeIterator<Item = Bound<'py, PyAny>>,
) -> Result<Vec<Frame<'py>>, DecodeError> {
    if items.len() == 0 {
        return Err(DecodeError::new(ErrorKind::EmptyMessage));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, obj) in items.enumerate() {
        out.push(Frame::acquire(i, &obj)?);
    }
    Ok(out)
}

/// A frame's bytes, borrowed from the memory the frame pins rather than from the
/// `Frame` value itself (which the builder needs mutably while the slices are in use).
///
/// # Safety
/// The caller must not use the slice after the `Frame` is dropped.
unsafe fn detach<'b>(frame: &Frame<'_>) -> &'b [u8] {
    let b = frame.bytes();
    // SAFETY: the memory is pinned by the Frame (bytes object or buffer export) for as
    // long as it lives, whatever happens to the Frame value's borrows.
    unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) }
}

/// The positions of release `name` as `corewire.releases` has them (read off the
/// release's recorded structs), for a release this build has no compiled walk for; its
/// `UnsupportedProtocolError` for a release it does not know (the one message that names
/// the supported releases lives there).
#[cold]
/// `corewire.releases.DEFAULT`'s version string.
fn default_release(py: Python<'_>) -> PyResult<String> {
    py.import("corewire.releases")?
        .getattr("DEFAULT")?
        .getattr("name")?
        .extract()
}

fn release_layout<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("corewire.releases")?
        .getattr("get")?
        .call1((name,))?
        .getattr("native_layout")
}

#[cold]
#[inline(never)]
/// The release a caller named: `release`, or the deprecated `protocol` keyword (with a
/// `DeprecationWarning`); both, when they differ, is a `TypeError`.
fn deprecated_protocol<'a>(
    py: Python<'_>,
    release: Option<&'a str>,
    protocol: Option<&'a str>,
) -> PyResult<Option<&'a str>> {
    let Some(old) = protocol else {
        return Ok(release);
    };
    warn_deprecated(py, c"NativeDecoder(protocol=) is deprecated: pass release=")?;
    match release {
        Some(new) if new != old => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "NativeDecoder got release={new:?} and protocol={old:?}: pass release= only"
        ))),
        _ => Ok(Some(old)),
    }
}

fn warn_deprecated(py: Python<'_>, message: &std::ffi::CStr) -> PyResult<()> {
    let category = py.get_type::<pyo3::exceptions::PyDeprecationWarning>();
    PyErr::warn(py, &category, message, 1)
}

fn to_protocol_error(err: DecodeError) -> PyErr {
    ProtocolError::new_err(err.to_string())
}
