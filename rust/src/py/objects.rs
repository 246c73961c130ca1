//! The Python objects a decoded message is made of.
//!
//! `EngineCoreOutputs` and `EngineCoreOutput` mirror `corewire.protocol`'s structs of the
//! same names, field for field: their slots, attributes, docs, repr and
//! `__struct_fields__` all come from the struct's table in [`crate::core::wire`]. They are
//! built here with the C API rather than as pyo3 classes, because the per-output object
//! is the decoder's hot path and pyo3 0.30 classes are always cyclic-GC types:
//!
//! - not GC types: creating one neither tracks it nor counts toward a collection, and
//!   the collector never traverses them (they cannot be part of a cycle unless a caller
//!   appends a message into its own lists or sets a field to something that refers back
//!   to the output; such a cycle would not be collected);
//! - fields are `Py_T_OBJECT_EX` struct members, which CPython's attribute cache
//!   specialises (`out.request_id` costs what a `__slots__` read costs), read-only but
//!   for those vLLM's front-end assigns (`new_logprobs` and the later fields, attributes
//!   with setters); the native output processing reads them in place
//!   ([`output_fields`]);
//! - a field holding None holds no reference to it (None is immortal in 3.12+ and never
//!   freed before), which saves two reference-count calls per empty field per output;
//! - freed output objects go to a free list, and so do their `new_token_ids` lists when
//!   nothing else holds them: in steady state a decode step allocates no object per
//!   output at all (a list the caller keeps is simply not recycled), and token ids map
//!   to cached ints;
//! - likewise a dead output's `LogprobsLists` of inline arrays, when nothing else holds
//!   the tuple or its arrays, is pooled and refilled in place by a later message;
//! - an output holds vLLM 0.25.1's fields inline and the fields later versions added
//!   out of line, in one tuple made only when one of them is set (they are rare: errors,
//!   transfers, masks), so that every version's outputs stay as small as 0.25.1's were
//!   (a batch of them fits the same cache).

use std::ffi::{c_int, c_void, CStr};
use std::mem::offset_of;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyTuple, PyType};

use super::ffi::reusable_array;
use super::list::{self, set_item};
use super::refcnt::{decref, incref};
use crate::core::schema::{MessageSlots, OutputSlots};
use crate::core::wire::{FieldType, MessageField, OutputField, WireStruct, LAYOUT_0_25_1};

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

/// Token ids below this get their Python int cached for the life of the process (like
/// CPython's small-int cache, sized for vocabularies): a vocabulary's ids are few and
/// repeat constantly, and an int allocation per token is most of a decode step's cost.
const TOKEN_CACHE_LIMIT: usize = 1 << 18;

/// `id -> int object` (NULL until first seen); grows to the largest id seen.
struct TokenInts(std::cell::UnsafeCell<Vec<*mut ffi::PyObject>>);

// SAFETY: as for `FreeList`: only touched with the GIL held.
unsafe impl Sync for TokenInts {}

static TOKEN_INTS: TokenInts = TokenInts(std::cell::UnsafeCell::new(Vec::new()));

/// A new reference to the int for token id `v`.
#[inline]
fn token_int(py: Python<'_>, v: u32) -> PyResult<*mut ffi::PyObject> {
    let i = v as usize;
    // SAFETY: attached (we hold `py`); no Python code runs while the table is borrowed
    // (PyLong_FromLong only allocates).
    unsafe {
        let table = &mut *TOKEN_INTS.0.get();
        if let Some(&cached) = table.get(i) {
            if !cached.is_null() {
                incref(cached);
                return Ok(cached);
            }
        }
        let obj = ffi::PyLong_FromLong(v as std::ffi::c_long);
        if obj.is_null() {
            return Err(PyErr::fetch(py));
        }
        if i < TOKEN_CACHE_LIMIT {
            if table.len() <= i {
                table.resize((i + 1).next_power_of_two().max(1024), ptr::null_mut());
            }
            // The table keeps one reference for the life of the process.
            incref(obj);
            table[i] = obj;
        }
        Ok(obj)
    }
}

/// Lists of up to this many token ids are recycled (a decode step emits 1 token per
/// request; speculative decoding a few).
const POOLED_LIST_MAX_LEN: usize = 8;
/// Most recycled lists kept per length.
const POOLED_LISTS_PER_LEN: usize = 2048;

/// `new_token_ids` lists whose output died while nothing else referenced them, by
/// length - 1, ready to be refilled.
struct ListPool(std::cell::UnsafeCell<[Vec<*mut ffi::PyObject>; POOLED_LIST_MAX_LEN]>);

// SAFETY: as for `FreeList`: only touched with the GIL held.
unsafe impl Sync for ListPool {}

static LIST_POOL: ListPool = ListPool(std::cell::UnsafeCell::new(
    [const { Vec::new() }; POOLED_LIST_MAX_LEN],
));

/// A new list (a new reference) holding `ids` as Python ints.
pub fn token_list<'py>(py: Python<'py>, ids: &[i128]) -> PyResult<Bound<'py, PyAny>> {
    let n = ids.len();
    // SAFETY: attached; the pool is not borrowed across Python code (only the pop).
    let pooled = match n {
        1..=POOLED_LIST_MAX_LEN => unsafe { (*LIST_POOL.0.get())[n - 1].pop() },
        _ => None,
    };
    // SAFETY: a pooled list is a list of length `n` that only the pool referenced; a new
    // one from PyList_New has `n` NULL slots. Every slot is set below (`set_item`
    // steals the new reference and releases the old item) before the list is used.
    unsafe {
        let list = match pooled {
            Some(list) => Bound::from_owned_ptr(py, list),
            None => Bound::from_owned_ptr_or_err(py, ffi::PyList_New(n as isize))?,
        };
        for (i, &v) in ids.iter().enumerate() {
            let item = match u32::try_from(v) {
                Ok(small) => token_int(py, small)?,
                Err(_) => int_object(py, v)?.into_ptr(),
            };
            set_item(list.as_ptr(), i, item);
        }
        Ok(list)
    }
}

/// Releases an output's `new_token_ids` list, recycling it if the output held the only
/// reference and it still has a poolable length.
///
/// # Safety
/// `list` is NULL or an owned reference to a list, given up by the caller; the caller
/// is attached to the interpreter.
#[inline]
unsafe fn release_token_list(list: *mut ffi::PyObject) {
    // SAFETY: `list` is an owned reference to a list (or NULL); attached.
    unsafe {
        if list.is_null() {
            return;
        }
        if ffi::Py_REFCNT(list) == 1 {
            let n = ffi::Py_SIZE(list);
            if (1..=POOLED_LIST_MAX_LEN as isize).contains(&n) {
                let pool = &mut (*LIST_POOL.0.get())[n as usize - 1];
                if pool.len() < POOLED_LISTS_PER_LEN {
                    pool.push(list);
                    return;
                }
            }
        }
        decref(list);
    }
}

/// Most `LogprobsLists` kept for reuse (a step of this many outputs with logprobs
/// allocates nothing for them in steady state).
const LOGPROBS_POOL_MAX: usize = 4096;

/// `LogprobsLists` whose output died while nothing else referenced the tuple or its three
/// arrays (each an exact ndarray owning its memory: inline arrays the decoder copied),
/// kept with their arrays to be refilled in place by the next message: a tuple and three
/// arrays per output with logprobs cost most of a decode step otherwise. Pooled tuples
/// are untracked by the cyclic GC (nothing can reach them); the decoder tracks one again
/// only if it hands it out with a `cu_num_generated_tokens` list.
struct LogprobsPool(std::cell::UnsafeCell<Vec<PooledLists>>);

/// A pooled `LogprobsLists` (an owned reference) and its three arrays (borrowed from it).
pub struct PooledLists {
    pub tuple: *mut ffi::PyObject,
    pub arrays: [*mut ffi::PyObject; 3],
}

// SAFETY: as for `FreeList`: only touched with the GIL held.
unsafe impl Sync for LogprobsPool {}

static LOGPROBS_POOL: LogprobsPool = LogprobsPool(std::cell::UnsafeCell::new(Vec::new()));

/// The `LogprobsLists` class and `numpy.ndarray` (null until the decoder first builds a
/// `LogprobsLists`: nothing is pooled before). Both are kept alive by the decoder's
/// process-wide constants.
static LOGPROBS_TYPE: AtomicPtr<ffi::PyTypeObject> = AtomicPtr::new(ptr::null_mut());
static NDARRAY_TYPE: AtomicPtr<ffi::PyTypeObject> = AtomicPtr::new(ptr::null_mut());

/// Turns the `LogprobsLists` pool on for tuples of `lists_type` over `array_type` arrays.
#[inline]
pub fn enable_logprobs_pool(
    lists_type: *mut ffi::PyTypeObject,
    array_type: *mut ffi::PyTypeObject,
) {
    if LOGPROBS_TYPE.load(Ordering::Relaxed).is_null() {
        NDARRAY_TYPE.store(array_type, Ordering::Relaxed);
        LOGPROBS_TYPE.store(lists_type, Ordering::Relaxed);
    }
}

/// A pooled `LogprobsLists` (the only reference to it; still untracked by the GC, and
/// its arrays referenced only by it) and its arrays, if any.
#[inline]
pub fn pop_logprobs(py: Python<'_>) -> Option<(Bound<'_, PyAny>, [*mut ffi::PyObject; 3])> {
    // SAFETY: attached; no Python code runs while the pool is borrowed. A pooled tuple
    // is an owned reference.
    unsafe {
        (*LOGPROBS_POOL.0.get())
            .pop()
            .map(|p| (Bound::from_owned_ptr(py, p.tuple), p.arrays))
    }
}

/// Releases an output's `new_logprobs`, pooling it when it may be refilled in place.
///
/// # Safety
/// `p` is a field value: None, or an owned reference given up by the caller; the caller
/// is attached to the interpreter.
#[inline]
unsafe fn release_logprobs(p: *mut ffi::PyObject) {
    // SAFETY: `p` is an owned reference (or None, which `release` skips); attached; no
    // Python code runs while the pool is borrowed (GetItem and UnTrack run none).
    unsafe {
        if p != none_ptr()
            && ffi::Py_REFCNT(p) == 1
            && ffi::Py_TYPE(p) == LOGPROBS_TYPE.load(Ordering::Relaxed)
            && ffi::Py_SIZE(p) == 4
        {
            let pool = &mut *LOGPROBS_POOL.0.get();
            let array_type = NDARRAY_TYPE.load(Ordering::Relaxed);
            let arrays = [
                ffi::PyTuple_GetItem(p, 0),
                ffi::PyTuple_GetItem(p, 1),
                ffi::PyTuple_GetItem(p, 2),
            ];
            let arrays_free = arrays
                .iter()
                .all(|&a| !a.is_null() && ffi::Py_TYPE(a) == array_type && reusable_array(a));
            if arrays_free && pool.len() < LOGPROBS_POOL_MAX {
                if ffi::PyObject_GC_IsTracked(p) != 0 {
                    ffi::PyObject_GC_UnTrack(p.cast());
                }
                pool.push(PooledLists { tuple: p, arrays });
                return;
            }
        }
        release(p);
    }
}

#[inline]
fn none_ptr() -> *mut ffi::PyObject {
    // SAFETY: Py_None is a static object.
    unsafe { ffi::Py_None() }
}

/// The int 0, held by this module for the life of the process, so that (like None) a
/// field can hold it without a reference of its own: `num_nans_in_logits` of nearly
/// every output. (Small ints are immortal in 3.12+ and never freed before.)
static ZERO: std::sync::atomic::AtomicPtr<ffi::PyObject> =
    std::sync::atomic::AtomicPtr::new(ptr::null_mut());

#[inline]
fn zero_ptr() -> *mut ffi::PyObject {
    ZERO.load(std::sync::atomic::Ordering::Relaxed)
}

/// Releases a field's reference (None and 0 fields hold none).
///
/// # Safety
/// `p` is NULL, None, the shared 0, or an owned reference given up by the caller; the
/// caller is attached to the interpreter.
#[inline]
unsafe fn release(p: *mut ffi::PyObject) {
    if !p.is_null() && p != none_ptr() && p != zero_ptr() {
        // SAFETY: per the caller, `p` is an owned reference.
        unsafe { decref(p) }
    }
}

// ------------------------------------------------------------------ EngineCoreOutput

/// A struct's slots as the object's field pointers: each value (an owned reference), or
/// the field's default, which the object holds without a reference: None, or the shared
/// 0 of a count (a builder hands nil and 0 over as no value).
#[inline(always)]
fn store_slots<F: WireStruct, const N: usize>(
    slots: &mut [Option<Bound<'_, PyAny>>; N],
) -> [*mut ffi::PyObject; N] {
    let none = none_ptr();
    let zero = zero_ptr();
    let count_default = if zero.is_null() { none } else { zero };
    let mut out = [none; N];
    // A select per slot, without branches on the usual path (most slots are empty).
    for (i, (v, o)) in slots.iter_mut().zip(out.iter_mut()).enumerate() {
        let p = v.take().map_or(ptr::null_mut(), Bound::into_ptr);
        let default = if F::COUNT_MASK & (1 << i) != 0 {
            count_default
        } else {
            none
        };
        *o = if p.is_null() { default } else { p };
        if p == none {
            // A value that is None: fields never own None, so its reference goes.
            // SAFETY: an owned reference to None, given up here.
            unsafe { decref(p) };
        }
    }
    out
}

/// Slots of an output held inline: those of vLLM 0.25.1 (the first slots of the table).
const INLINE: usize = LAYOUT_0_25_1.output.fields.len();
/// Slots held out of line, in `OutputObject::extra`.
const EXTRA: usize = OutputField::COUNT - INLINE;
const _: () = {
    // The out-of-line slots default to None (a NULL `extra` stands for all None).
    let mut i = INLINE;
    while i < OutputField::COUNT {
        assert!(!matches!(OutputField::INFO[i].ty, FieldType::Count));
        i += 1;
    }
};

/// Memory layout of an `EngineCoreOutput` instance.
#[repr(C)]
struct OutputObject {
    ob_base: ffi::PyObject,
    /// Members, by [`OutputField`] slot, up to [`INLINE`].
    fields: [*mut ffi::PyObject; INLINE],
    /// The later slots: NULL while every one is None, else a tuple of [`EXTRA`] items
    /// (owned references, None included).
    extra: *mut ffi::PyObject,
}

/// The request id and the token ids: the fields an output always owns (its required
/// slots, before the optional ones).
const REQUEST_ID: usize = OutputField::RequestId as usize;
const TOKENS: usize = OutputField::NewTokenIds as usize;
const _: () = assert!(REQUEST_ID < OutputField::REQUIRED && TOKENS < OutputField::REQUIRED);
const _: () = assert!(OutputField::REQUIRED == 2);
// `new_logprobs` is the first optional slot (the dealloc function pools it).
const _: () = assert!(OutputField::NewLogprobs as usize == OutputField::REQUIRED);

static OUTPUT_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static MESSAGE_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Freed output objects kept for reuse: allocating an output is then a pop and a
/// reference count set, with no allocator call, no zeroing and no call into CPython.
/// A kept object keeps its type and the reference to it that every heap-type instance
/// owns, so reusing it for the same type has nothing else to set.
///
/// Only touched while attached to the interpreter, and the GIL serialises that: abi3
/// extensions load only in builds with a GIL.
struct FreeList(std::cell::UnsafeCell<Vec<*mut ffi::PyObject>>);

// SAFETY: see the type's doc: every access holds the GIL.
unsafe impl Sync for FreeList {}

const FREE_LIST_MAX: usize = 4096;
static OUTPUT_FREE_LIST: FreeList = FreeList(std::cell::UnsafeCell::new(Vec::new()));

/// An output object's memory: a reused one, or a new one.
///
/// # Safety
/// `ty` is the output type made by [`register`]; the caller is attached and writes
/// every field before the object is used.
#[inline]
unsafe fn alloc_output(py: Python<'_>, ty: &Py<PyType>) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: attached (we hold `py`); no Python code runs while the list is borrowed.
    let reused = unsafe { (*OUTPUT_FREE_LIST.0.get()).pop() };
    match reused {
        // SAFETY: memory of a freed OutputObject that still holds its type and a
        // reference to it (see `free_output`): of the same type, only the count is
        // set (what `PyObject_Init` would do besides the type it would re-set and
        // re-reference; its tracemalloc note of a new reference is skipped, the
        // memory's own allocation trace stays).
        Some(obj) if unsafe { ffi::Py_TYPE(obj) } == ty.as_ptr().cast() => unsafe {
            (*obj).ob_refcnt = 1;
            Ok(obj)
        },
        // SAFETY: as above, of another type (the output type was made again):
        // its type reference is given up, then Init sets the type (with a new
        // reference, as GenericAlloc does) and a refcount of 1.
        Some(obj) => unsafe {
            decref(ffi::Py_TYPE(obj).cast());
            Ok(ffi::PyObject_Init(obj, ty.as_ptr().cast()))
        },
        None => unsafe { alloc(py, ty) },
    }
}

/// Returns an output object's memory to the free list, with its type and the
/// reference to it, or to the allocator when the list is full.
///
/// # Safety
/// `obj` is an output object whose refcount reached zero and whose fields were
/// released; it is not used again. Called from `tp_dealloc` (attached).
#[inline]
unsafe fn free_output(obj: *mut ffi::PyObject) {
    // SAFETY: attached (called from tp_dealloc), fields already released; no Python code
    // runs while the list is borrowed.
    unsafe {
        let list = &mut *OUTPUT_FREE_LIST.0.get();
        if list.len() < FREE_LIST_MAX {
            list.push(obj);
        } else {
            free(obj);
        }
    }
}

/// Allocates an instance of `ty` (a type made by `make_type`), fields zeroed.
///
/// # Safety
/// `ty` is a type made by `make_type`; the caller is attached and writes every field
/// before the object is used.
#[inline]
unsafe fn alloc(py: Python<'_>, ty: &Py<PyType>) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: GenericAlloc of a non-GC heap type: zeroed memory, refcount 1, and a new
    // reference to the type (released by the dealloc functions below).
    let obj = unsafe { ffi::PyType_GenericAlloc(ty.as_ptr().cast(), 0) };
    if obj.is_null() {
        return Err(PyErr::fetch(py));
    }
    Ok(obj)
}

/// Frees an instance made by `alloc`, after its fields were released.
///
/// # Safety
/// `obj` came from `alloc`, its refcount reached zero and its fields were released; it
/// is not used again. Called from `tp_dealloc` (attached).
#[inline]
unsafe fn free(obj: *mut ffi::PyObject) {
    // SAFETY: `obj` came from PyType_GenericAlloc of a non-GC type (PyObject_Malloc);
    // heap type instances own a reference to their type.
    unsafe {
        let ty = ffi::Py_TYPE(obj);
        ffi::PyObject_Free(obj.cast());
        ffi::Py_DECREF(ty.cast());
    }
}

/// A new `EngineCoreOutput` from a builder's slots (request id and token ids set),
/// taking every value out of them, also when it fails.
#[inline(always)]
pub fn new_output<'py>(
    py: Python<'py>,
    v: &mut OutputSlots<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (inline, later) = v.split_at_mut(INLINE);
    let inline: &mut [_; INLINE] = inline.try_into().expect("INLINE slots");
    let fields = store_slots::<OutputField, INLINE>(inline);
    let extra = if later.iter().all(Option::is_none) {
        ptr::null_mut()
    } else {
        match new_extra(py, later) {
            Ok(extra) => extra,
            Err(e) => {
                // SAFETY: attached; owned references nothing else will release.
                unsafe { fields.into_iter().for_each(|p| release(p)) };
                return Err(e);
            }
        }
    };
    let Some(ty) = OUTPUT_TYPE.get(py) else {
        // SAFETY: attached; the values are owned references nothing else will release.
        unsafe {
            fields.into_iter().for_each(|p| release(p));
            release(extra);
        }
        return Err(not_registered());
    };
    // SAFETY: a fresh OutputObject-sized allocation of the output type; every field is
    // written before the object is handed out, and the dealloc function releases them
    // (or here, if there is no object).
    unsafe {
        let obj = match alloc_output(py, ty) {
            Ok(obj) => obj,
            Err(e) => {
                for p in fields {
                    release(p);
                }
                release(extra);
                return Err(e);
            }
        };
        let o = obj.cast::<OutputObject>();
        ptr::addr_of_mut!((*o).fields).write(fields);
        ptr::addr_of_mut!((*o).extra).write(extra);
        Ok(Bound::from_owned_ptr(py, obj))
    }
}

/// The out-of-line slots of an output, one of them set, as its `extra` tuple (which
/// takes every value out of them, also when it fails).
#[cold]
#[inline(never)]
fn new_extra(
    py: Python<'_>,
    later: &mut [Option<Bound<'_, PyAny>>],
) -> PyResult<*mut ffi::PyObject> {
    let items: [Bound<'_, PyAny>; EXTRA] =
        std::array::from_fn(|i| later[i].take().unwrap_or_else(|| py.None().into_bound(py)));
    Ok(PyTuple::new(py, items)?.into_ptr())
}

/// The getter of an out-of-line output field; `closure` is its index in `extra`.
///
/// # Safety
/// Only CPython calls it, attached, with a live output.
unsafe extern "C" fn output_extra(
    obj: *mut ffi::PyObject,
    closure: *mut c_void,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls getters with a live instance of the output type, attached;
    // `extra` is NULL or a tuple of EXTRA items, and `closure` an index below EXTRA.
    unsafe {
        let extra = (*obj.cast::<OutputObject>()).extra;
        let value = if extra.is_null() {
            none_ptr()
        } else {
            ffi::PyTuple_GetItem(extra, closure as ffi::Py_ssize_t)
        };
        ffi::Py_INCREF(value);
        value
    }
}

/// The setter of an out-of-line output field; `closure` is its index in `extra`: a new
/// `extra` tuple holds the value (vLLM 0.32.0 on assigns `new_sampling_mask` when a stop
/// string cuts a step's tokens short).
///
/// # Safety
/// Only CPython calls it, attached, with a live output.
unsafe extern "C" fn output_set_extra(
    obj: *mut ffi::PyObject,
    value: *mut ffi::PyObject,
    closure: *mut c_void,
) -> c_int {
    if value.is_null() {
        return cannot_delete();
    }
    // SAFETY: a live instance of the output type, attached; `extra` is NULL or a tuple
    // of EXTRA items, `closure` an index below EXTRA; SetItem steals the reference
    // taken for it.
    unsafe {
        let o = obj.cast::<OutputObject>();
        let old = (*o).extra;
        if old.is_null() && value == none_ptr() {
            return 0; // already None, and `extra` stays NULL while every one is
        }
        let new = ffi::PyTuple_New(EXTRA as ffi::Py_ssize_t);
        if new.is_null() {
            return -1;
        }
        for j in 0..EXTRA {
            let item = if j == closure as usize {
                value
            } else if old.is_null() {
                none_ptr()
            } else {
                ffi::PyTuple_GetItem(old, j as ffi::Py_ssize_t)
            };
            ffi::Py_INCREF(item);
            ffi::PyTuple_SetItem(new, j as ffi::Py_ssize_t, item);
        }
        (*o).extra = new;
        release(old);
    }
    0
}

/// The getter of an inline output field that has a setter (see [`SETTABLE_INLINE`]);
/// `closure` is its slot.
///
/// # Safety
/// Only CPython calls it, attached, with a live output.
unsafe extern "C" fn output_inline(
    obj: *mut ffi::PyObject,
    closure: *mut c_void,
) -> *mut ffi::PyObject {
    // SAFETY: a live instance of the output type, attached; `closure` is an inline slot.
    unsafe {
        let value = (*obj.cast::<OutputObject>()).fields[closure as usize];
        let value = if value.is_null() { none_ptr() } else { value };
        ffi::Py_INCREF(value);
        value
    }
}

/// The setter of an inline output field (see [`SETTABLE_INLINE`]); `closure` is its
/// slot. None and the shared 0 are held without a reference of their own, as
/// `new_output` stores them (and `release` expects).
///
/// # Safety
/// Only CPython calls it, attached, with a live output.
unsafe extern "C" fn output_set_inline(
    obj: *mut ffi::PyObject,
    value: *mut ffi::PyObject,
    closure: *mut c_void,
) -> c_int {
    if value.is_null() {
        return cannot_delete();
    }
    // SAFETY: a live instance of the output type, attached; `closure` is an inline
    // slot; the old value is released after the new one is in place.
    unsafe {
        if value != none_ptr() && value != zero_ptr() {
            ffi::Py_INCREF(value);
        }
        let slot = &mut (*obj.cast::<OutputObject>()).fields[closure as usize];
        let old = std::mem::replace(slot, value);
        release(old);
    }
    0
}

/// Raises `TypeError` for `del output.field` (a field always holds a value); -1.
#[cold]
fn cannot_delete() -> c_int {
    // SAFETY: attached (called from a setter); a static message.
    unsafe {
        ffi::PyErr_SetString(
            ffi::PyExc_TypeError,
            c"an EngineCoreOutput field cannot be deleted".as_ptr(),
        )
    };
    -1
}

/// A decoded output's fields read in place: what an attribute lookup per field returns,
/// without the lookup. The native output processing reads about fifteen fields of every
/// output of every engine step (to route it, then to handle it), and for this type each
/// lookup would walk the type's attribute cache and a descriptor to load one pointer.
pub struct OutputFields<'a, 'py> {
    obj: &'a Bound<'py, PyAny>,
}

/// `obj`'s fields when it is an `EngineCoreOutput` of the type this module made (what the
/// decoder builds); None for any other object (vLLM's own struct, or an output of a type
/// made before the current one), which the caller reads by attribute.
#[inline]
pub fn output_fields<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> Option<OutputFields<'a, 'py>> {
    let ty = OUTPUT_TYPE.get(obj.py())?;
    // SAFETY: the type of a live object.
    let same = unsafe { ffi::Py_TYPE(obj.as_ptr()) } == ty.as_ptr().cast();
    same.then_some(OutputFields { obj })
}

/// `obj`'s field `field`: read in place where `fields` (its [`output_fields`]) has it,
/// else by attribute `name`.
#[inline]
pub fn output_field<'py>(
    obj: &Bound<'py, PyAny>,
    fields: Option<&OutputFields<'_, 'py>>,
    field: OutputField,
    name: &Py<PyString>,
) -> PyResult<Bound<'py, PyAny>> {
    match fields {
        Some(f) => Ok(f.get(field)),
        None => obj.getattr(name.bind(obj.py())),
    }
}

impl<'py> OutputFields<'_, 'py> {
    /// The object `field` holds (borrowed from the output), None included.
    #[inline]
    fn ptr(&self, field: OutputField) -> *mut ffi::PyObject {
        let slot = field.slot();
        // SAFETY: a live instance of the output type (checked by `output_fields`), read
        // attached: `new_output` wrote every inline field, and `extra` is NULL or a tuple
        // of EXTRA items (`slot - INLINE` is below EXTRA).
        unsafe {
            let o = self.obj.as_ptr().cast::<OutputObject>();
            let p = if slot < INLINE {
                (*o).fields[slot]
            } else if (*o).extra.is_null() {
                ptr::null_mut()
            } else {
                let item = ffi::PyTuple_GetItem((*o).extra, (slot - INLINE) as ffi::Py_ssize_t);
                debug_assert!(!item.is_null(), "extra holds EXTRA items");
                item
            };
            if p.is_null() {
                none_ptr()
            } else {
                p
            }
        }
    }

    /// Whether `field` holds None (as `getattr(output, name) is None`).
    #[inline]
    pub fn is_none(&self, field: OutputField) -> bool {
        self.ptr(field) == none_ptr()
    }

    /// `field`'s value (as `getattr(output, name)`).
    #[inline]
    pub fn get(&self, field: OutputField) -> Bound<'py, PyAny> {
        // SAFETY: a live object the output holds (or None), attached; a new reference.
        unsafe { Bound::from_borrowed_ptr(self.obj.py(), self.ptr(field)) }
    }
}

/// `tp_dealloc` of `EngineCoreOutput`: releases the fields (recycling what can be) and
/// the object's memory.
///
/// # Safety
/// Only CPython calls it, attached, with an output whose refcount reached zero.
unsafe extern "C" fn output_dealloc(obj: *mut ffi::PyObject) {
    // SAFETY: called by CPython once the refcount is zero; fields were written by
    // `new_output`.
    unsafe {
        let o = obj.cast::<OutputObject>();
        let fields = &(*o).fields;
        release(fields[REQUEST_ID]);
        release_token_list(fields[TOKENS]);
        // Usually every optional field is None or 0: one branch-free scan (every field
        // was written by `new_output`, none is NULL) instead of a test per field.
        let (none, zero) = (none_ptr(), zero_ptr());
        let optional = &fields[OutputField::REQUIRED..];
        if optional
            .iter()
            .fold(false, |any, &p| any | ((p != none) & (p != zero)))
        {
            release_logprobs(optional[0]);
            for &p in &optional[1..] {
                release(p);
            }
        }
        release((*o).extra);
        free_output(obj);
    }
}

/// The `finished` getter of `EngineCoreOutput`.
///
/// # Safety
/// Only CPython calls it, attached, with a live output.
unsafe extern "C" fn output_finished(
    obj: *mut ffi::PyObject,
    _closure: *mut c_void,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls getters with a live instance of the output type, attached.
    unsafe {
        let o = obj.cast::<OutputObject>();
        let reason = (*o).fields[OutputField::FinishReason as usize];
        let result = if reason.is_null() || reason == none_ptr() {
            ffi::Py_False()
        } else {
            ffi::Py_True()
        };
        ffi::Py_INCREF(result);
        result
    }
}

/// `tp_repr` of `EngineCoreOutput`.
///
/// # Safety
/// Only CPython calls it, attached, with a live output.
unsafe extern "C" fn output_repr(obj: *mut ffi::PyObject) -> *mut ffi::PyObject {
    // SAFETY: CPython calls tp_repr with a live object, attached.
    unsafe { repr_of::<OutputField>(obj) }
}

// ------------------------------------------------------------------ EngineCoreOutputs

#[repr(C)]
struct MessageObject {
    ob_base: ffi::PyObject,
    /// Members, by [`MessageField`] slot.
    fields: [*mut ffi::PyObject; MessageField::COUNT],
}

/// A new `EngineCoreOutputs` from a builder's slots, taking every value out of them,
/// also when it fails.
pub fn new_message<'py>(
    py: Python<'py>,
    v: &mut MessageSlots<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let fields = store_slots::<MessageField, { MessageField::COUNT }>(v);
    let Some(ty) = MESSAGE_TYPE.get(py) else {
        // SAFETY: attached; the values are owned references nothing else will release.
        unsafe { fields.into_iter().for_each(|p| release(p)) };
        return Err(not_registered());
    };
    // SAFETY: as in `new_output`.
    unsafe {
        let obj = match alloc(py, ty) {
            Ok(obj) => obj,
            Err(e) => {
                for p in fields {
                    release(p);
                }
                return Err(e);
            }
        };
        let o = obj.cast::<MessageObject>();
        ptr::addr_of_mut!((*o).fields).write(fields);
        Ok(Bound::from_owned_ptr(py, obj))
    }
}

/// `tp_dealloc` of `EngineCoreOutputs`.
///
/// # Safety
/// Only CPython calls it, attached, with a message whose refcount reached zero.
unsafe extern "C" fn message_dealloc(obj: *mut ffi::PyObject) {
    // SAFETY: as in `output_dealloc`.
    unsafe {
        let o = obj.cast::<MessageObject>();
        for &p in &(*o).fields {
            release(p);
        }
        free(obj);
    }
}

/// `tp_repr` of `EngineCoreOutputs`.
///
/// # Safety
/// Only CPython calls it, attached, with a live message.
unsafe extern "C" fn message_repr(obj: *mut ffi::PyObject) -> *mut ffi::PyObject {
    // SAFETY: as in `output_repr`.
    unsafe { repr_of::<MessageField>(obj) }
}

// ------------------------------------------------------------------ shared

/// `Name(field=value, ...)` over every attribute of `F`'s table.
///
/// # Safety
/// Called from `tp_repr` of a type made for `F` (attached, live object).
#[cold]
unsafe fn repr_of<F: WireStruct>(obj: *mut ffi::PyObject) -> *mut ffi::PyObject {
    // SAFETY: per the caller, attached and `obj` is alive.
    unsafe {
        let py = Python::assume_attached();
        let obj = Bound::from_borrowed_ptr(py, obj);
        let text = (|| -> PyResult<String> {
            let mut parts = Vec::with_capacity(F::ALL.len());
            for field in F::ALL {
                let name = field.info().name;
                parts.push(format!("{name}={}", obj.getattr(name)?.repr()?));
            }
            Ok(format!("{}({})", F::STRUCT, parts.join(", ")))
        })();
        match text {
            Ok(text) => PyString::new(py, &text).into_ptr(),
            Err(e) => {
                e.restore(py);
                ptr::null_mut()
            }
        }
    }
}

#[cold]
fn not_registered() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err("corewire._native types are not initialised")
}

/// How to build the type of struct `F`, whose instances hold a field pointer per slot
/// from `members_offset` on.
struct TypeDef {
    name: &'static CStr,
    doc: &'static CStr,
    basicsize: usize,
    members_offset: usize,
    getsets: Vec<ffi::PyGetSetDef>,
    dealloc: ffi::destructor,
    repr: ffi::reprfunc,
    /// `__struct_fields__`: the attribute names, in slot order.
    fields: Vec<&'static str>,
    /// Slots held as members (the rest have getters among `getsets`).
    members: usize,
    /// Slots below `members` that have a getter and a setter among `getsets` instead.
    settable: &'static [usize],
}

fn make_type<'py, F: WireStruct>(py: Python<'py>, def: TypeDef) -> PyResult<Bound<'py, PyType>> {
    let ptr_size = std::mem::size_of::<*mut ffi::PyObject>();
    let mut members: Vec<ffi::PyMemberDef> = F::ALL[..def.members]
        .iter()
        .filter(|field| !def.settable.contains(&field.slot()))
        .map(|field| ffi::PyMemberDef {
            name: field.info().c_name.as_ptr(),
            type_code: ffi::Py_T_OBJECT_EX,
            offset: (def.members_offset + field.slot() * ptr_size) as ffi::Py_ssize_t,
            flags: ffi::Py_READONLY,
            doc: field.info().doc.as_ptr(),
        })
        .collect();
    members.push(ffi::PyMemberDef::default());
    let mut getsets = def.getsets;
    getsets.push(ffi::PyGetSetDef::default());
    // CPython keeps pointers to the getset table (members are copied): it must live as
    // long as the type, i.e. the process. Two small tables, made once.
    let getsets: &'static mut [ffi::PyGetSetDef] = Box::leak(getsets.into_boxed_slice());
    let mut slots = [
        ffi::PyType_Slot {
            slot: ffi::Py_tp_dealloc,
            pfunc: def.dealloc as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_repr,
            pfunc: def.repr as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_doc,
            pfunc: def.doc.as_ptr() as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_members,
            pfunc: members.as_mut_ptr().cast(),
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_getset,
            pfunc: getsets.as_mut_ptr().cast(),
        },
        ffi::PyType_Slot::default(),
    ];
    let mut spec = ffi::PyType_Spec {
        name: def.name.as_ptr(),
        basicsize: def.basicsize as i32,
        itemsize: 0,
        // Not a GC type, not subclassable, not instantiable from Python.
        flags: (ffi::Py_TPFLAGS_DEFAULT | ffi::Py_TPFLAGS_DISALLOW_INSTANTIATION) as u32,
        slots: slots.as_mut_ptr(),
    };
    // SAFETY: a complete spec; CPython copies the slots and members it reads.
    let ty = unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyType_FromSpec(&mut spec))? };
    drop(members);
    ty.setattr("__struct_fields__", PyTuple::new(py, &def.fields)?)?;
    Ok(ty.cast_into::<PyType>()?)
}

fn getset(name: &'static CStr, get: ffi::getter, doc: &'static CStr) -> ffi::PyGetSetDef {
    ffi::PyGetSetDef {
        name: name.as_ptr(),
        get: Some(get),
        set: None,
        doc: doc.as_ptr(),
        closure: ptr::null_mut(),
    }
}

/// The inline output fields that vLLM's front-end assigns (its `_trim_surplus_tokens`,
/// vLLM 0.32.0 on, cuts a step's logprobs where a stop string ends the text): attributes
/// with a setter, where the other inline fields are read-only members (which CPython's
/// attribute cache reads fastest). Every out-of-line field has a setter too.
const SETTABLE_INLINE: [usize; 1] = [OutputField::NewLogprobs as usize];
const _: () = assert!(OutputField::NewLogprobs as usize >= OutputField::REQUIRED);

/// The getters of an output: `finished`, one per settable inline field and one per
/// out-of-line field (those two kinds with setters).
fn output_getsets() -> Vec<ffi::PyGetSetDef> {
    let mut getsets = vec![getset(
        c"finished",
        output_finished,
        c"Whether this is the request's last output (finish_reason is not None).",
    )];
    for &slot in &SETTABLE_INLINE {
        let info = OutputField::ALL[slot].info();
        let mut def = getset(info.c_name, output_inline, info.doc);
        def.set = Some(output_set_inline);
        def.closure = slot as *mut c_void;
        getsets.push(def);
    }
    for (i, field) in OutputField::ALL[INLINE..].iter().enumerate() {
        let info = field.info();
        let mut def = getset(info.c_name, output_extra, info.doc);
        def.set = Some(output_set_extra);
        def.closure = i as *mut c_void;
        getsets.push(def);
    }
    debug_assert_eq!(getsets.len(), 1 + SETTABLE_INLINE.len() + EXTRA);
    getsets
}

/// `F`'s attribute names in slot order (`__struct_fields__`): every version's fields,
/// 0.25.1's first, in its wire order, then those later versions added. Each version's
/// wire order is `_native.wire_fields(name, protocol)`.
fn slot_order<F: WireStruct>() -> Vec<&'static str> {
    F::ALL.iter().map(|f| f.info().name).collect()
}

/// The `EngineCoreOutputs` and `EngineCoreOutput` types, created on first call (for the
/// module to export; the decoder builds their instances).
pub fn types(py: Python<'_>) -> PyResult<[&Py<PyType>; 2]> {
    list::probe(py)?;
    if zero_ptr().is_null() {
        // Kept for the life of the process (this reference is never released).
        let zero = 0i32.into_pyobject(py)?.into_any().into_ptr();
        ZERO.store(zero, std::sync::atomic::Ordering::Relaxed);
    }
    let output = OUTPUT_TYPE.get_or_try_init(py, || {
        make_type::<OutputField>(
            py,
            TypeDef {
                name: c"corewire._native.EngineCoreOutput",
                doc: c"One request's new output: the fields of corewire.protocol.EngineCoreOutput.",
                basicsize: std::mem::size_of::<OutputObject>(),
                members_offset: offset_of!(OutputObject, fields),
                getsets: output_getsets(),
                dealloc: output_dealloc,
                repr: output_repr,
                fields: slot_order::<OutputField>(),
                members: INLINE,
                settable: &SETTABLE_INLINE,
            },
        )
        .map(Bound::unbind)
    })?;
    let message = MESSAGE_TYPE.get_or_try_init(py, || {
        make_type::<MessageField>(
            py,
            TypeDef {
                name: c"corewire._native.EngineCoreOutputs",
                doc: c"One message from an engine: the fields of corewire.protocol.EngineCoreOutputs.",
                basicsize: std::mem::size_of::<MessageObject>(),
                members_offset: offset_of!(MessageObject, fields),
                getsets: Vec::new(),
                dealloc: message_dealloc,
                repr: message_repr,
                fields: slot_order::<MessageField>(),
                members: MessageField::COUNT,
                settable: &[],
            },
        )
        .map(Bound::unbind)
    })?;
    Ok([message, output])
}
