//! Reference counting inlined, as the stable ABI's own headers before Python 3.12 inline
//! it.
//!
//! pyo3 calls the interpreter's `_Py_IncRef` / `_Py_DecRef` for every count change in an
//! abi3 build; on the decoder's hot path (a few per output) the calls cost more than the
//! counting. A C extension built for the abi3-py310 stable ABI does exactly what these do
//! (`Py_INCREF` / `Py_DECREF` of the 3.10 and 3.11 headers change `ob_refcnt` in place),
//! and every later CPython keeps such binaries working: immortal objects (3.12+) start
//! at a count that these changes never bring to zero or make mortal (PEP 683). Builds
//! without the GIL do not load abi3-py310 modules at all.

use pyo3::ffi;

extern "C" {
    /// Part of the stable ABI (what `Py_DECREF` of the 3.10/3.11 headers calls).
    fn _Py_Dealloc(op: *mut ffi::PyObject);
}

/// `Py_INCREF`.
///
/// # Safety
/// `op` is a live object; the caller is attached to the interpreter.
#[inline(always)]
pub unsafe fn incref(op: *mut ffi::PyObject) {
    // SAFETY: per the contract; the field is the whole count before 3.12 and counts the
    // same way in its low half after (see the module doc).
    unsafe { (*op).ob_refcnt += 1 }
}

/// `Py_DECREF`: gives up a reference, freeing the object with its last one.
///
/// # Safety
/// `op` is a live object and the caller owns the reference it gives up; attached.
#[inline(always)]
pub unsafe fn decref(op: *mut ffi::PyObject) {
    // SAFETY: per the contract; as for `incref`.
    unsafe {
        (*op).ob_refcnt -= 1;
        if (*op).ob_refcnt == 0 {
            _Py_Dealloc(op);
        }
    }
}
