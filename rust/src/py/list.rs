//! Setting a list's items without a call into the interpreter per item.
//!
//! `PyList_SetItem` is the only way the stable ABI offers, and on the decoder's hot path
//! (two per output: its token list, and its place in the message's list) the call with
//! its type and bounds checks costs more than the store. `PyListObject`'s layout (a
//! variable-size header, then the item array and its capacity) has not changed since
//! Python 2 in builds with the GIL, the only ones an abi3 module loads in; it is still
//! checked once at start-up by [`probe`] against `PyList_SetItem`'s own result, and the
//! call is kept when the check fails.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;

use super::refcnt::decref;

/// The leading fields of CPython's `PyListObject` (Include/cpython/listobject.h).
#[repr(C)]
struct ListFields {
    ob_base: ffi::PyVarObject,
    ob_item: *mut *mut ffi::PyObject,
    allocated: ffi::Py_ssize_t,
}

/// Whether [`probe`] found the layout above.
static DIRECT: AtomicBool = AtomicBool::new(false);

/// Checks the list layout against the interpreter (once, at module start-up).
pub fn probe(py: Python<'_>) -> PyResult<()> {
    // Two distinct objects, set through the interpreter, then read back by layout.
    let a = py.None();
    let b = 0i32.into_pyobject(py)?.into_any().unbind();
    // SAFETY: a new list of two NULL items; both are set before it is read or dropped;
    // PyList_SetItem steals the references given.
    let found = unsafe {
        let list = Bound::from_owned_ptr_or_err(py, ffi::PyList_New(2))?;
        let p = list.as_ptr();
        ffi::PyList_SetItem(p, 0, a.clone_ref(py).into_ptr());
        ffi::PyList_SetItem(p, 1, b.clone_ref(py).into_ptr());
        let f = p.cast::<ListFields>();
        (*f).ob_base.ob_size == 2
            && (*f).allocated >= 2
            && !(*f).ob_item.is_null()
            && *(*f).ob_item == a.as_ptr()
            && *(*f).ob_item.add(1) == b.as_ptr()
    };
    DIRECT.store(found, Ordering::Relaxed);
    Ok(())
}

/// `PyList_SetItem(list, index, item)`: stores `item` (stealing the reference) and
/// releases the item it replaces, if any.
///
/// # Safety
/// `list` is a live exact list and `index` is below its length; `item` is an owned
/// reference; attached.
#[inline(always)]
pub unsafe fn set_item(list: *mut ffi::PyObject, index: usize, item: *mut ffi::PyObject) {
    // SAFETY: per the contract, and the layout checked by `probe`.
    unsafe {
        if DIRECT.load(Ordering::Relaxed) {
            let slot = (*list.cast::<ListFields>()).ob_item.add(index);
            let old = *slot;
            *slot = item;
            if !old.is_null() {
                decref(old);
            }
        } else {
            ffi::PyList_SetItem(list, index as ffi::Py_ssize_t, item);
        }
    }
}
