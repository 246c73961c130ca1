//! Received frames as byte slices, and the objects that keep their memory alive.
//!
//! A `bytes` frame is read in place and is itself the `base` of the arrays that view it
//! (bytes never move or change). Any other buffer (`zmq.Frame`, `memoryview`,
//! `bytearray` ...) is read through a buffer export, which pins its memory (a
//! `bytearray` cannot be resized while exported); when an array views the frame, the
//! export moves into a [`FrameBuffer`] that becomes the array's base, so the frame lives
//! exactly as long as its last array. Exports no array needed are released when the
//! decode call returns.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::ffi::HeldBuffer;
use crate::core::error::{DecodeError, ErrorKind};

/// One frame of the message being decoded.
pub struct Frame<'py> {
    /// The object whose memory this is, for consumers that take a buffer themselves
    /// (`torch.frombuffer`).
    pub obj: Bound<'py, PyAny>,
    ptr: *const u8,
    len: usize,
    /// Whether the memory may be written (so views of it may be writable).
    pub writable: bool,
    /// The export that pins the memory, until an array needs it as its base.
    held: Option<HeldBuffer>,
    /// What arrays over this frame hold on to (created on first need).
    base: Option<Bound<'py, PyAny>>,
}

impl<'py> Frame<'py> {
    /// Reads frame `index` of a message.
    pub fn acquire(index: usize, obj: &Bound<'py, PyAny>) -> Result<Self, DecodeError> {
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            let data = bytes.as_bytes();
            return Ok(Frame {
                obj: obj.clone(),
                ptr: data.as_ptr(),
                len: data.len(),
                writable: false,
                held: None,
                base: Some(obj.clone()),
            });
        }
        let (exporter, held) = match HeldBuffer::acquire(obj) {
            Ok(held) => (obj.clone(), held),
            Err(err) => {
                // Objects that are not buffers but carry one (`.buffer`, like zmq.Frame).
                let inner = if err.is_instance_of::<PyTypeError>(obj.py()) {
                    obj.getattr("buffer").ok()
                } else {
                    None
                };
                match inner.map(|b| HeldBuffer::acquire(&b).map(|h| (b, h))) {
                    Some(Ok(pair)) => pair,
                    _ => return Err(bad_frame(index, obj, &err)),
                }
            }
        };
        Ok(Frame {
            obj: exporter,
            ptr: held.ptr(),
            len: held.len(),
            writable: held.writable(),
            held: Some(held),
            base: None,
        })
    }

    /// The frame's bytes.
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr..ptr+len` is pinned by `held`, by `base` (a FrameBuffer holding
        // the export, or the immutable bytes object), for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Address of byte `offset`.
    #[inline]
    pub fn ptr_at(&self, offset: usize) -> *const u8 {
        self.ptr.wrapping_add(offset)
    }

    /// The object arrays over this frame must keep alive.
    pub fn base(&mut self) -> PyResult<&Bound<'py, PyAny>> {
        if self.base.is_none() {
            let Some(held) = self.held.take() else {
                return Err(PyTypeError::new_err("frame has no buffer export"));
            };
            let owner = Bound::new(self.obj.py(), FrameBuffer { held })?;
            self.base = Some(owner.into_any());
        }
        match &self.base {
            Some(base) => Ok(base),
            None => Err(PyTypeError::new_err("frame has no buffer export")),
        }
    }
}

#[cold]
#[inline(never)]
fn bad_frame(index: usize, obj: &Bound<'_, PyAny>, err: &PyErr) -> DecodeError {
    let type_name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned());
    let py = obj.py();
    let detail = if err.is_instance_of::<PyTypeError>(py) {
        format!("a frame must be bytes-like (bytes, memoryview, zmq.Frame), got {type_name}")
    } else {
        format!("cannot read {type_name} as contiguous bytes: {err}")
    };
    DecodeError::new(ErrorKind::BadFrame { index, detail })
}

/// Keeps a received frame's buffer export alive for the arrays that view it: the `base`
/// of every decoded ndarray over a non-`bytes` frame. The frame is released when the
/// last such array is gone.
#[pyclass(module = "corewire._native", name = "FrameBuffer", frozen)]
pub struct FrameBuffer {
    held: HeldBuffer,
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
