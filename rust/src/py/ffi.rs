//! The few C entry points the decoder needs beyond pyo3's abi3-py310 bindings.
//!
//! - The buffer protocol (`PyObject_GetBuffer` / `PyBuffer_Release`) joined the stable
//!   ABI in 3.11, but both functions and `Py_buffer`'s layout are the same in every
//!   CPython since 3.3, and the interpreter exports them on 3.10 too. Declaring them here
//!   lets the abi3-py310 module take zero-copy views of `memoryview`s and `zmq.Frame`s.
//! - numpy's C API, reached through the `_ARRAY_API` capsule as numpy's own headers do
//!   (`import_array`): creating an array over existing memory costs one C call instead
//!   of a Python-level `np.frombuffer` call per array. The slots used here have the same
//!   index in numpy 1.x and 2.x.

use std::ffi::{c_char, c_int, c_void};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// `Py_buffer` (Include/pybuffer.h), unchanged since Python 3.3.
#[repr(C)]
pub struct PyBufferRaw {
    pub buf: *mut c_void,
    pub obj: *mut ffi::PyObject,
    pub len: ffi::Py_ssize_t,
    pub itemsize: ffi::Py_ssize_t,
    pub readonly: c_int,
    pub ndim: c_int,
    pub format: *mut c_char,
    pub shape: *mut ffi::Py_ssize_t,
    pub strides: *mut ffi::Py_ssize_t,
    pub suboffsets: *mut ffi::Py_ssize_t,
    pub internal: *mut c_void,
}

/// `PyBUF_SIMPLE`: a contiguous run of bytes, no format or shape needed.
pub const PYBUF_SIMPLE: c_int = 0;

extern "C" {
    pub fn PyObject_GetBuffer(
        obj: *mut ffi::PyObject,
        view: *mut PyBufferRaw,
        flags: c_int,
    ) -> c_int;
    pub fn PyBuffer_Release(view: *mut PyBufferRaw);
}

/// A buffer export held until dropped (drop only with the GIL held: every owner of one
/// is dropped by Python's deallocator or inside a decode call).
pub struct HeldBuffer(Box<PyBufferRaw>);

// SAFETY: the export is only read or released while attached to the interpreter; the raw
// pointers inside are owned by the exporter, which this export keeps alive.
unsafe impl Send for HeldBuffer {}
unsafe impl Sync for HeldBuffer {}

impl HeldBuffer {
    /// Takes a simple (contiguous bytes) export of `obj`.
    pub fn acquire(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut view = Box::new(PyBufferRaw {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `view` is a valid, writable Py_buffer; on failure nothing is held.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_SIMPLE) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(HeldBuffer(view))
    }

    /// Start of the exported bytes.
    pub fn ptr(&self) -> *const u8 {
        self.0.buf as *const u8
    }

    /// Number of exported bytes.
    pub fn len(&self) -> usize {
        self.0.len.max(0) as usize
    }

    /// Whether the exporter allows writes.
    pub fn writable(&self) -> bool {
        self.0.readonly == 0
    }

    /// The exporting object (None if the exporter did not say).
    pub fn exporter(&self, py: Python<'_>) -> Py<PyAny> {
        if self.0.obj.is_null() {
            return py.None();
        }
        // SAFETY: `obj` is a live object: the export holds a reference to it.
        unsafe { Bound::from_borrowed_ptr(py, self.0.obj).unbind() }
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        // SAFETY: acquired by PyObject_GetBuffer and released exactly once; every owner
        // is dropped while attached to the interpreter (see the type's doc).
        unsafe { PyBuffer_Release(&mut *self.0) }
    }
}

/// `NPY_ARRAY_WRITEABLE`.
pub const NPY_ARRAY_WRITEABLE: c_int = 0x0400;
/// `NPY_ARRAY_C_CONTIGUOUS`.
pub const NPY_ARRAY_C_CONTIGUOUS: c_int = 0x0001;
/// `NPY_ARRAY_OWNDATA`.
pub const NPY_ARRAY_OWNDATA: c_int = 0x0004;

/// The leading fields of numpy's `PyArrayObject_fields` (numpy/ndarraytypes.h). This
/// layout is part of numpy's ABI: every compiled extension reads these fields through
/// numpy's inline accessors (`PyArray_DATA`, `PyArray_DIMS` ...), so it is the same in
/// numpy 1.x and 2.x.
#[repr(C)]
pub struct NdArrayFields {
    pub ob_base: ffi::PyObject,
    pub data: *mut u8,
    pub nd: c_int,
    pub dimensions: *mut ffi::Py_ssize_t,
    pub strides: *mut ffi::Py_ssize_t,
    pub base: *mut ffi::PyObject,
    pub descr: *mut ffi::PyObject,
    pub flags: c_int,
    pub weakreflist: *mut ffi::PyObject,
}

type NewFromDescr = unsafe extern "C" fn(
    subtype: *mut ffi::PyTypeObject,
    descr: *mut ffi::PyObject,
    nd: c_int,
    dims: *const ffi::Py_ssize_t,
    strides: *const ffi::Py_ssize_t,
    data: *mut c_void,
    flags: c_int,
    obj: *mut ffi::PyObject,
) -> *mut ffi::PyObject;
type SetBaseObject =
    unsafe extern "C" fn(arr: *mut ffi::PyObject, obj: *mut ffi::PyObject) -> c_int;

/// The numpy C API functions the decoder calls.
pub struct NumpyApi {
    array_type: *mut ffi::PyTypeObject,
    new_from_descr: NewFromDescr,
    set_base_object: SetBaseObject,
    /// Keeps the capsule (and so the table) alive.
    _capsule: Py<PyAny>,
}

// SAFETY: the table is immutable after numpy's import and lives as long as the capsule,
// which this struct owns; the functions are called only while attached.
unsafe impl Send for NumpyApi {}
unsafe impl Sync for NumpyApi {}

// Slot numbers in numpy's `PyArray_API` table (numpy/__multiarray_api.h).
const SLOT_ARRAY_TYPE: usize = 2;
const SLOT_NEW_FROM_DESCR: usize = 94;
const SLOT_SET_BASE_OBJECT: usize = 282;

impl NumpyApi {
    /// Imports numpy and reads its C API table.
    pub fn load(py: Python<'_>) -> PyResult<Self> {
        let module = py
            .import("numpy._core.multiarray")
            .or_else(|_| py.import("numpy.core.multiarray"))?;
        let capsule = module.getattr("_ARRAY_API")?;
        let table = {
            let capsule = capsule.cast::<PyCapsule>()?;
            // SAFETY: reading the capsule's pointer with the name numpy gave it (none).
            let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) };
            if ptr.is_null() {
                return Err(PyErr::fetch(py));
            }
            ptr as *const *mut c_void
        };
        // SAFETY: numpy's table has these slots with these signatures in 1.x and 2.x.
        unsafe {
            Ok(NumpyApi {
                array_type: *table.add(SLOT_ARRAY_TYPE) as *mut ffi::PyTypeObject,
                new_from_descr: std::mem::transmute::<*mut c_void, NewFromDescr>(
                    *table.add(SLOT_NEW_FROM_DESCR),
                ),
                set_base_object: std::mem::transmute::<*mut c_void, SetBaseObject>(
                    *table.add(SLOT_SET_BASE_OBJECT),
                ),
                _capsule: capsule.unbind(),
            })
        }
    }

    /// `numpy.ndarray`.
    #[inline]
    pub fn array_type(&self) -> *mut ffi::PyTypeObject {
        self.array_type
    }

    /// A new C-contiguous ndarray of `descr` and `shape` that owns a copy of the
    /// `product(shape) * itemsize(descr)` bytes at `src`.
    ///
    /// # Safety
    /// `src` must point to that many readable bytes.
    pub unsafe fn array_copy<'py>(
        &self,
        descr: &Bound<'py, PyAny>,
        shape: &[usize],
        src: *const u8,
        len: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = descr.py();
        let mut dims = [0 as ffi::Py_ssize_t; crate::core::schema::MAX_DIMS];
        for (d, &s) in dims.iter_mut().zip(shape) {
            *d = s as ffi::Py_ssize_t;
        }
        // SAFETY: NULL data: numpy allocates (and owns) the array's memory; the
        // descriptor reference is stolen.
        let arr = unsafe {
            (self.new_from_descr)(
                self.array_type,
                descr.clone().into_ptr(),
                shape.len() as c_int,
                dims.as_ptr(),
                std::ptr::null(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: a new reference or NULL with an exception set.
        let arr = unsafe { Bound::from_owned_ptr_or_err(py, arr)? };
        if len != 0 {
            // SAFETY: the new array owns `len` bytes (the walk checked `len` against
            // shape and itemsize), which cannot overlap the frame.
            unsafe {
                let fields = arr.as_ptr().cast::<NdArrayFields>();
                std::ptr::copy_nonoverlapping(src, (*fields).data, len);
            }
        }
        Ok(arr)
    }

    /// A C-contiguous ndarray of `descr` and `shape` over `data`, which `base` keeps
    /// alive (the array holds a reference to `base`).
    ///
    /// # Safety
    /// `data` must point to `product(shape) * itemsize(descr)` bytes that stay valid
    /// while `base` is alive, and be writable if `writable`.
    pub unsafe fn array_over<'py>(
        &self,
        descr: &Bound<'py, PyAny>,
        shape: &[usize],
        data: *const u8,
        writable: bool,
        base: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = descr.py();
        let mut dims = [0 as ffi::Py_ssize_t; crate::core::schema::MAX_DIMS];
        for (d, &s) in dims.iter_mut().zip(shape) {
            *d = s as ffi::Py_ssize_t;
        }
        let flags = if writable { NPY_ARRAY_WRITEABLE } else { 0 };
        // NewFromDescr steals a reference to the descriptor.
        let descr_ref = descr.clone().into_ptr();
        // SAFETY: per this function's contract; the descriptor reference is stolen.
        let arr = unsafe {
            (self.new_from_descr)(
                self.array_type,
                descr_ref,
                shape.len() as c_int,
                dims.as_ptr(),
                std::ptr::null(),
                data as *mut c_void,
                flags,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: a new reference or NULL with an exception set.
        let arr = unsafe { Bound::from_owned_ptr_or_err(py, arr)? };
        // SetBaseObject steals a reference to the base, also when it fails.
        // SAFETY: `arr` is a fresh ndarray without a base.
        let rc = unsafe { (self.set_base_object)(arr.as_ptr(), base.clone().into_ptr()) };
        if rc != 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// Whether `arr` (an exact ndarray made by [`NumpyApi::array_copy`]) can take `len` new
/// bytes of the same dtype object and shape in place: nothing but its owner references
/// it (refcount 1, no weak references, no base) and it still owns its C-contiguous,
/// writable memory of that shape.
///
/// # Safety
/// `arr` must be a live exact ndarray, attached.
#[inline]
pub unsafe fn reusable_array(arr: *mut ffi::PyObject) -> bool {
    const WANTED: c_int = NPY_ARRAY_OWNDATA | NPY_ARRAY_WRITEABLE | NPY_ARRAY_C_CONTIGUOUS;
    // SAFETY: per the contract, `arr` has numpy's array layout.
    unsafe {
        let f = arr.cast::<NdArrayFields>();
        ffi::Py_REFCNT(arr) == 1
            && (*f).base.is_null()
            && (*f).weakreflist.is_null()
            && (*f).flags & WANTED == WANTED
            && !(*f).data.is_null()
    }
}

/// Copies `len` bytes from `src` into the pooled array `arr` if it has exactly dtype
/// object `descr` and `shape`; false (nothing written) otherwise.
///
/// # Safety
/// `arr` must be an exact ndarray for which [`reusable_array`] held when it was pooled
/// and that nothing else referenced since; `src` must point to `len` readable bytes,
/// `len == product(shape) * itemsize(descr)`.
#[inline]
pub unsafe fn refill_array(
    arr: *mut ffi::PyObject,
    descr: *mut ffi::PyObject,
    shape: &[usize],
    src: *const u8,
    len: usize,
) -> bool {
    // SAFETY: per the contract.
    unsafe {
        let f = arr.cast::<NdArrayFields>();
        if (*f).descr != descr || (*f).nd as usize != shape.len() {
            return false;
        }
        if !shape.is_empty() {
            let dims = std::slice::from_raw_parts((*f).dimensions, shape.len());
            if dims.iter().zip(shape).any(|(&d, &s)| d as usize != s) {
                return false;
            }
        }
        copy_small(src, (*f).data, len);
        true
    }
}

/// `copy_nonoverlapping` for the few dozen bytes of a logprobs row, without a call to
/// `memcpy`: two overlapping word-sized moves cover any length from one word to two.
///
/// # Safety
/// As for `copy_nonoverlapping`.
#[inline(always)]
unsafe fn copy_small(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: per the contract; unaligned reads and writes within `len` bytes.
    unsafe {
        macro_rules! two {
            ($t:ty) => {{
                let n = std::mem::size_of::<$t>();
                let head = src.cast::<$t>().read_unaligned();
                let tail = src.add(len - n).cast::<$t>().read_unaligned();
                dst.cast::<$t>().write_unaligned(head);
                dst.add(len - n).cast::<$t>().write_unaligned(tail);
            }};
        }
        match len {
            0 => {}
            1..=3 => {
                for i in 0..len {
                    *dst.add(i) = *src.add(i);
                }
            }
            4..=7 => two!(u32),
            8..=15 => two!(u64),
            16..=31 => two!(u128),
            _ => std::ptr::copy_nonoverlapping(src, dst, len),
        }
    }
}
