//! The [`Builder`] that turns the core's schema walk into Python objects.
//!
//! Everything it needs from Python (classes, enum members, numpy's C API) was looked up
//! once, in [`Consts`]; the per-output path only allocates the output object and
//! increments reference counts. Python errors become [`ErrorKind::Rejected`] (reported
//! as `ProtocolError` with the place) unless they are not about the data (MemoryError,
//! KeyboardInterrupt ...), which are kept and re-raised as they are.

use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyString, PyTuple};

use super::consts::{Consts, DtypeCache};
use super::ffi::refill_array;
use super::frames::Frame;
use super::list::set_item;
use super::objects::{
    enable_logprobs_pool, int_object, new_message, new_output, pop_logprobs, token_list,
};
use super::refcnt::incref;
use super::torch;
use crate::core::error::{ArrayKind, DecodeError, DecodeResult, ErrorKind};
use crate::core::intern::{FrameOrder, InternCache};
use crate::core::msgpack::check_utf8;
use crate::core::schema::{ArrayRef, Builder, MaskSlots, MessageSlots, OutputSlots, UtilitySlots};
use crate::core::wire::{LayoutRef, StatsKind, TensorsField};

/// What a decoder keeps from frame to frame.
pub struct DecoderState {
    /// Request id bytes -> the one str object for that id.
    pub ids: InternCache<Py<PyString>>,
    /// Map key bytes -> str (scheduler_stats and friends repeat their keys).
    pub keys: InternCache<Py<PyString>>,
    pub np_dtypes: DtypeCache,
    pub torch_dtypes: DtypeCache,
    /// Per engine index: the order of its last message's request ids.
    pub orders: Vec<(i128, FrameOrder<Py<PyString>>)>,
    /// `ids.rotations()` when the ids held by `orders` were last looked up.
    pub refreshed_at: u64,
}

/// Optional converters of the stats maps (`prefill_stats`, `scheduler_stats`): a front-end
/// that reads them by attribute (vLLM's) passes callables that build its own types.
#[derive(Default)]
pub struct StatsTypes {
    pub prefill: Option<Py<PyAny>>,
    pub scheduler: Option<Py<PyAny>>,
}

/// Most engines whose output order is remembered (more engines only lose prediction).
const MAX_ORDERS: usize = 64;

impl DecoderState {
    /// The order memory of `engine_index` (made on first use), started for a new message.
    pub fn start_order(&mut self, engine_index: i128) -> Option<usize> {
        let at = match self.orders.iter().position(|(e, _)| *e == engine_index) {
            Some(at) => at,
            None if self.orders.len() < MAX_ORDERS => {
                self.orders.push((engine_index, FrameOrder::default()));
                self.orders.len() - 1
            }
            None => return None,
        };
        self.orders[at].1.start();
        Some(at)
    }

    /// Ids predicted by `orders` skip the intern cache, so the cache would age them out
    /// while they are alive; after the cache retires a generation, look them all up
    /// once, which keeps the same str object for the same id.
    pub fn refresh_if_rotated(&mut self) {
        if self.ids.rotations() == self.refreshed_at {
            return;
        }
        self.refreshed_at = self.ids.rotations();
        for (_, order) in &self.orders {
            for key in order.keys() {
                let _ = self.ids.get(key);
            }
        }
    }
}

/// Builds one message's Python objects.
pub struct PyBuilder<'a, 'py> {
    pub py: Python<'py>,
    pub consts: &'static Consts,
    pub state: &'a mut DecoderState,
    pub frames: &'a mut [Frame<'py>],
    /// Callables that turn decoded stats maps into the caller's stats objects.
    pub stats_types: &'a StatsTypes,
    /// Whether the layout's `LogprobsTensors` has later versions' fifth element (which
    /// named tuple a decoded one is).
    five_element_tensors: bool,
    /// A foreign Python error behind an [`ErrorKind::Foreign`] result.
    pub error: Option<PyErr>,
    /// The dtype object found by the last `dtype_itemsize`, for the `array` call after it.
    dtype: HeldDtype<'py>,
    /// Index in `state.orders` of the sending engine's id order, if tracked.
    order: Option<usize>,
    /// The `LogprobsLists` whose arrays are being built, between `begin_logprobs` and
    /// `logprobs`.
    lists: Option<PendingLists<'py>>,
}

/// A dtype object found for the next array.
enum HeldDtype<'py> {
    None,
    /// Borrowed from the decoder's dtype cache (whose entries outlive the builder): no
    /// reference count traffic on the usual path.
    Cached(*mut ffi::PyObject),
    /// Not cached (the cache was full).
    Owned(Bound<'py, PyAny>),
}

/// A `LogprobsLists` in the making.
struct PendingLists<'py> {
    /// Which of its arrays the next `array` call builds (0 ids, 1 logprobs, 2 ranks).
    next: usize,
    /// A pooled tuple, and its arrays, which are refilled in place where dtype and
    /// shape match.
    reuse: Option<(Bound<'py, PyAny>, [*mut ffi::PyObject; 3])>,
}

type Obj<'py> = Bound<'py, PyAny>;

impl<'a, 'py> PyBuilder<'a, 'py> {
    /// A builder over `frames`.
    pub fn new(
        py: Python<'py>,
        consts: &'static Consts,
        state: &'a mut DecoderState,
        frames: &'a mut [Frame<'py>],
        stats_types: &'a StatsTypes,
        layout: LayoutRef,
    ) -> Self {
        let five_element_tensors = layout
            .layout()
            .logprobs_tensors
            .fields
            .contains(&Some(TensorsField::CuNumGeneratedTokensTensor));
        PyBuilder {
            py,
            consts,
            state,
            frames,
            stats_types,
            five_element_tensors,
            error: None,
            dtype: HeldDtype::None,
            order: None,
            lists: None,
        }
    }

    /// Converts a Python error raised while building into a decoding error.
    #[cold]
    #[inline(never)]
    fn fail(&mut self, err: PyErr) -> DecodeError {
        let py = self.py;
        if err.is_instance_of::<PyException>(py) && !err.is_instance_of::<PyMemoryError>(py) {
            let kind = err
                .get_type(py)
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            DecodeError::new(ErrorKind::Rejected(format!("{kind}: {}", err.value(py))))
        } else {
            self.error = Some(err);
            DecodeError::new(ErrorKind::Foreign)
        }
    }

    #[inline]
    fn check<T>(&mut self, r: PyResult<T>) -> DecodeResult<T> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => Err(self.fail(e)),
        }
    }

    #[inline]
    fn opt(&self, v: Option<Obj<'py>>) -> Py<PyAny> {
        match v {
            Some(v) => v.unbind(),
            None => self.py.None(),
        }
    }

    /// The interned str for request id bytes, from the cache or made (and cached).
    #[inline]
    fn interned(&mut self, raw: &[u8]) -> DecodeResult<Bound<'py, PyString>> {
        // Known ids were checked when first seen: no UTF-8 check, no allocation.
        if let Some(s) = self.state.ids.get(raw) {
            let s = s.bind(self.py).clone();
            // (a lookup may promote an entry and so retire a generation)
            self.state.refresh_if_rotated();
            return Ok(s);
        }
        self.new_request_id(raw)
    }

    #[cold]
    #[inline(never)]
    fn new_request_id(&mut self, raw: &[u8]) -> DecodeResult<Bound<'py, PyString>> {
        let s = check_utf8(raw)?;
        let obj = PyString::new(self.py, s);
        self.state.ids.insert(raw, obj.clone().unbind());
        self.state.refresh_if_rotated();
        Ok(obj)
    }

    #[cold]
    #[inline(never)]
    fn new_key(&mut self, v: &str) -> DecodeResult<Obj<'py>> {
        let obj = PyString::new(self.py, v);
        self.state.keys.insert(v.as_bytes(), obj.clone().unbind());
        Ok(obj.into_any())
    }

    /// An inline array of a `LogprobsLists` (`slot` 0 ids, 1 logprobs, 2 ranks): the
    /// pooled tuple's array refilled in place, or a new array owning a copy of the bytes.
    /// A copy of a few dozen bytes costs less than a view's base bookkeeping, and lets
    /// the tuple be pooled and the payload be freed while the front-end keeps the arrays.
    fn inline_lists_array(
        &mut self,
        slot: usize,
        a: &ArrayRef<'_>,
        dtype_ptr: *mut ffi::PyObject,
        dtype: impl FnOnce() -> Obj<'py>,
    ) -> PyResult<Obj<'py>> {
        let src = self.frames[0].ptr_at(a.data.offset);
        if let Some((_, arrays)) = self.lists.as_ref().and_then(|l| l.reuse.as_ref()) {
            // SAFETY: the items of a pooled tuple, arrays only it references (checked
            // when pooled; nothing could reach them since); the walk checked that `len`
            // bytes of that dtype and shape lie at `src`.
            unsafe {
                let item = arrays[slot];
                if refill_array(item, dtype_ptr, a.shape, src, a.data.len) {
                    return Ok(Bound::from_borrowed_ptr(self.py, item));
                }
            }
        }
        // SAFETY: as above, `len` readable bytes at `src`.
        unsafe {
            self.consts
                .numpy
                .array_copy(&dtype(), a.shape, src, a.data.len)
        }
    }

    /// Completes a pooled `LogprobsLists` with the arrays built for it (usually its own,
    /// refilled) and `cu`, and hands it out again.
    fn refilled_lists(
        &mut self,
        (t, items): (Obj<'py>, [*mut ffi::PyObject; 3]),
        arrays: [Obj<'py>; 3],
        cu: Option<Obj<'py>>,
    ) -> Obj<'py> {
        let py = self.py;
        // SAFETY: `t` is a 4-tuple only this reference holds (so SetItem may replace
        // items: it steals the new reference and releases the old item), untracked;
        // `items` are its first three items.
        unsafe {
            for (i, (array, item)) in arrays.into_iter().zip(items).enumerate() {
                // A refilled array is the item itself (the extra reference drops here).
                if array.as_ptr() != item {
                    ffi::PyTuple_SetItem(t.as_ptr(), i as isize, array.into_ptr());
                }
            }
            // Untracked like a new one (see `logprobs`) unless `cu` is a list.
            let track = cu.is_some();
            let cu = cu.unwrap_or_else(|| py.None().into_bound(py));
            if ffi::PyTuple_GetItem(t.as_ptr(), 3) != cu.as_ptr() {
                ffi::PyTuple_SetItem(t.as_ptr(), 3, cu.into_ptr());
            }
            if track {
                ffi::PyObject_GC_Track(t.as_ptr().cast());
            }
        }
        t
    }

    /// `dtype_itemsize` for a dtype not in the cache yet.
    #[cold]
    #[inline(never)]
    fn new_dtype(&mut self, kind: ArrayKind, dtype: &str) -> DecodeResult<usize> {
        let consts = self.consts;

        let r = match kind {
            ArrayKind::Ndarray => self
                .state
                .np_dtypes
                .lookup(self.py, dtype, |py, s| consts.numpy_dtype(py, s)),
            ArrayKind::Tensor => self
                .state
                .torch_dtypes
                .lookup(self.py, dtype, |py, s| torch::dtype(py, s)),
        };
        match r {
            Ok(Some((obj, itemsize))) => {
                self.dtype = HeldDtype::Owned(obj);
                Ok(itemsize)
            }
            Ok(None) => Err(DecodeError::new(ErrorKind::UnknownDtype {
                kind,
                dtype: dtype.to_owned(),
            })),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn tensor(&mut self, a: &ArrayRef<'_>, dtype: Obj<'py>) -> PyResult<Obj<'py>> {
        let py = self.py;
        let api = torch::api(py)?;
        if a.data.len != 0 {
            let frame = &mut self.frames[a.data.frame];
            let ptr = frame.ptr_at(a.data.offset);
            if let Some(twin) = api.numpy_twin(py, a.dtype) {
                // torch keeps the array (and so its base, the frame) alive. Aligned data
                // only: inline bytes can sit at any offset of the payload.
                if (ptr as usize) % a.itemsize == 0 {
                    let base = frame.base()?;
                    // The array is marked writable even over read-only memory: it is
                    // torch's alone, and a tensor is writable whatever its memory (which
                    // `torch.frombuffer` would only warn about).
                    // SAFETY: the walk checked that `len == product(shape) * itemsize`
                    // bytes lie at `ptr` inside the frame, which `base` keeps alive.
                    let arr = unsafe {
                        self.consts
                            .numpy
                            .array_over(twin, a.shape, ptr, true, base)?
                    };
                    return api.from_numpy.bind(py).call1((arr,));
                }
            }
        }
        let shape = PyTuple::new(py, a.shape)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", &dtype)?;
        if a.data.len == 0 {
            // Nothing to share: an empty tensor of the right shape.
            return api.empty.bind(py).call((shape,), Some(&kwargs));
        }
        kwargs.set_item("count", a.count())?;
        kwargs.set_item("offset", a.data.offset)?;
        let frame = &self.frames[a.data.frame];
        let call = || api.frombuffer.bind(py).call((&frame.obj,), Some(&kwargs));
        let flat = if frame.writable {
            call()?
        } else {
            // torch shares read-only memory too but warns that it cannot mark the tensor
            // read-only; that warning is expected here and silenced for this call only.
            api.without_readonly_warning(py, call)?
        };
        if a.shape.len() == 1 {
            return Ok(flat);
        }
        flat.call_method1("view", (shape,))
    }
}

impl<'py> Builder for PyBuilder<'_, 'py> {
    type Obj = Obj<'py>;

    #[inline]
    fn none(&mut self) -> Obj<'py> {
        self.py.None().into_bound(self.py)
    }

    fn bool(&mut self, v: bool) -> Obj<'py> {
        pyo3::types::PyBool::new(self.py, v).to_owned().into_any()
    }

    #[inline]
    fn int(&mut self, v: i128) -> DecodeResult<Obj<'py>> {
        let r = int_object(self.py, v);
        self.check(r)
    }

    fn float(&mut self, v: f64) -> DecodeResult<Obj<'py>> {
        Ok(PyFloat::new(self.py, v).into_any())
    }

    fn str(&mut self, v: &str) -> DecodeResult<Obj<'py>> {
        Ok(PyString::new(self.py, v).into_any())
    }

    #[inline]
    fn key_str(&mut self, v: &str) -> DecodeResult<Obj<'py>> {
        if let Some(s) = self.state.keys.get(v.as_bytes()) {
            return Ok(s.bind(self.py).clone().into_any());
        }
        self.new_key(v)
    }

    fn bytes(&mut self, v: &[u8]) -> DecodeResult<Obj<'py>> {
        Ok(pyo3::types::PyBytes::new(self.py, v).into_any())
    }

    #[inline]
    fn list(&mut self, len: usize) -> DecodeResult<Obj<'py>> {
        // SAFETY: a new list of NULLs; the walk sets every element before the list
        // escapes (a list dropped half-filled is fine: its deallocator skips NULLs).
        let r = unsafe { Bound::from_owned_ptr_or_err(self.py, ffi::PyList_New(len as isize)) };
        self.check(r)
    }

    #[inline]
    fn list_set(&mut self, list: &mut Obj<'py>, index: usize, item: Obj<'py>) {
        // SAFETY: `list` is a list from `list()` and `index` is in range; the reference
        // to `item` is stolen.
        unsafe { set_item(list.as_ptr(), index, item.into_ptr()) }
    }

    fn tuple_from_list(&mut self, list: Obj<'py>) -> DecodeResult<Obj<'py>> {
        // SAFETY: `list` is a complete list.
        let r =
            unsafe { Bound::from_owned_ptr_or_err(self.py, ffi::PyList_AsTuple(list.as_ptr())) };
        self.check(r)
    }

    fn dict(&mut self) -> DecodeResult<Obj<'py>> {
        Ok(PyDict::new(self.py).into_any())
    }

    fn dict_set(
        &mut self,
        dict: &mut Obj<'py>,
        key: Obj<'py>,
        value: Obj<'py>,
    ) -> DecodeResult<()> {
        // SAFETY: `dict` is a dict from `dict()`; references are borrowed.
        let rc = unsafe { ffi::PyDict_SetItem(dict.as_ptr(), key.as_ptr(), value.as_ptr()) };
        if rc != 0 {
            let err = PyErr::fetch(self.py);
            return Err(self.fail(err));
        }
        Ok(())
    }

    fn set(&mut self) -> DecodeResult<Obj<'py>> {
        let r = pyo3::types::PySet::empty(self.py).map(Bound::into_any);
        self.check(r)
    }

    fn set_add(&mut self, set: &mut Obj<'py>, item: Obj<'py>) -> DecodeResult<()> {
        // SAFETY: `set` is a set from `set()`; the item reference is borrowed.
        let rc = unsafe { ffi::PySet_Add(set.as_ptr(), item.as_ptr()) };
        if rc != 0 {
            let err = PyErr::fetch(self.py);
            return Err(self.fail(err));
        }
        Ok(())
    }

    fn begin_outputs(&mut self, engine_index: i128) {
        self.order = self.state.start_order(engine_index);
    }

    // Always inlined: the hot path of both versions' walks (two callers would let the
    // optimiser keep it out of line).
    #[inline(always)]
    fn request_id(&mut self, raw: &[u8]) -> DecodeResult<Obj<'py>> {
        let py = self.py;
        let Some(at) = self.order else {
            return self.interned(raw).map(Bound::into_any);
        };
        // Usually the id is the one that followed the previous one last time.
        let order = &mut self.state.orders[at].1;
        if let Some(hit) = order.take_predicted(raw) {
            let ptr = hit.value.as_ptr();
            order.keep(hit);
            // SAFETY: a live str, which the order holds; the new reference is the
            // output's (an inlined count, where `clone` would call the interpreter).
            return Ok(unsafe {
                incref(ptr);
                Bound::from_owned_ptr(py, ptr)
            });
        }
        let obj = self.interned(raw)?;
        let order = &mut self.state.orders[at].1;
        order.resync(raw);
        order.push(raw, obj.clone().unbind());
        Ok(obj.into_any())
    }

    fn finished_request_id(&mut self, raw: &[u8]) -> DecodeResult<Obj<'py>> {
        self.interned(raw).map(Bound::into_any)
    }

    fn event(&mut self, kind: u8, timestamp: f64) -> DecodeResult<Obj<'py>> {
        let c = self.consts;
        let member = c.event_types[(kind - 1) as usize].bind(self.py);
        let r = c.event_cls.bind(self.py).call1((member, timestamp));
        self.check(r)
    }

    // Always inlined: the hot path of both versions' walks (two callers would let the
    // optimiser keep it out of line).
    #[inline(always)]
    fn dtype_itemsize(&mut self, kind: ArrayKind, dtype: &str) -> DecodeResult<usize> {
        let cache = match kind {
            ArrayKind::Ndarray => &self.state.np_dtypes,
            ArrayKind::Tensor => &self.state.torch_dtypes,
        };
        if let Some((obj, itemsize)) = cache.find(dtype) {
            self.dtype = HeldDtype::Cached(obj);
            return Ok(itemsize);
        }
        self.new_dtype(kind, dtype)
    }

    fn array(&mut self, a: &ArrayRef<'_>) -> DecodeResult<Obj<'py>> {
        let (dtype_ptr, owned) = match std::mem::replace(&mut self.dtype, HeldDtype::None) {
            HeldDtype::Cached(p) => (p, None),
            HeldDtype::Owned(d) => (d.as_ptr(), Some(d)),
            HeldDtype::None => {
                return Err(DecodeError::new(ErrorKind::Rejected(
                    "internal error: array without dtype".into(),
                )))
            }
        };
        let py = self.py;
        let dtype = || match &owned {
            Some(d) => d.clone(),
            // SAFETY: a live dtype object: in the cache, or held by `owned`.
            None => unsafe { Bound::from_borrowed_ptr(py, dtype_ptr) },
        };
        // Which array of a LogprobsLists this is, if it is one.
        let slot = match self.lists.as_mut() {
            Some(l) if l.next < 3 => {
                l.next += 1;
                Some(l.next - 1)
            }
            _ => None,
        };
        let r = match (a.kind, slot) {
            (ArrayKind::Ndarray, Some(slot)) if a.data.frame == 0 => {
                self.inline_lists_array(slot, a, dtype_ptr, dtype)
            }
            (ArrayKind::Ndarray, _) => {
                let frame = &mut self.frames[a.data.frame];
                let ptr = frame.ptr_at(a.data.offset);
                let writable = frame.writable;
                match frame.base() {
                    // SAFETY: the walk checked that `len == product(shape) * itemsize`
                    // bytes lie at `ptr` inside the frame, which `base` keeps alive.
                    Ok(base) => unsafe {
                        self.consts
                            .numpy
                            .array_over(&dtype(), a.shape, ptr, writable, base)
                    },
                    Err(e) => Err(e),
                }
            }
            (ArrayKind::Tensor, _) => self.tensor(a, dtype()),
        };
        self.check(r)
    }

    fn begin_logprobs(&mut self, kind: ArrayKind) {
        if kind == ArrayKind::Ndarray {
            let c = self.consts;
            enable_logprobs_pool(c.logprobs_lists.as_ptr().cast(), c.numpy.array_type());
            self.lists = Some(PendingLists {
                next: 0,
                reuse: pop_logprobs(self.py),
            });
        }
    }

    fn logprobs(
        &mut self,
        kind: ArrayKind,
        fields: &mut [Option<Obj<'py>>],
    ) -> DecodeResult<Obj<'py>> {
        let py = self.py;
        let c = self.consts;
        if fields.len() < 4 {
            return Err(missing_field());
        }
        let (ids, lps, ranks) = (fields[0].take(), fields[1].take(), fields[2].take());
        let cu_num_generated_tokens = fields[3].take();
        // A later version's element (LogprobsTensors' fifth; LogprobsLists has four).
        debug_assert!(fields.len() <= 5);
        let later = fields.get_mut(4).and_then(Option::take);
        let (Some(ids), Some(lps), Some(ranks)) = (ids, lps, ranks) else {
            return Err(missing_field());
        };
        let arrays = [ids, lps, ranks];
        if kind == ArrayKind::Tensor && self.five_element_tensors {
            // A later version's LogprobsTensors: its own named tuple, every element.
            let cu = self.opt(cu_num_generated_tokens).into_bound(py);
            let [ids, lps, ranks] = arrays;
            let later = self.opt(later).into_bound(py);
            let r = PyTuple::new(py, [ids, lps, ranks, cu, later]).and_then(|items| {
                c.tuple_new
                    .bind(py)
                    .call1((c.logprobs_tensors_0_33_0.bind(py), items))
            });
            return self.check(r);
        }
        let cls = match kind {
            ArrayKind::Ndarray => c.logprobs_lists.bind(py),
            ArrayKind::Tensor => c.logprobs_tensors.bind(py),
        };
        if let Some(reuse) = self.lists.take().and_then(|l| l.reuse) {
            return Ok(self.refilled_lists(reuse, arrays, cu_num_generated_tokens));
        }
        let untrack = kind == ArrayKind::Ndarray && cu_num_generated_tokens.is_none();
        let [ids, lps, ranks] = arrays;
        let cu = self.opt(cu_num_generated_tokens).into_bound(py);
        // tuple.__new__(cls, items): the named tuple without its Python-level __new__.
        let r = PyTuple::new(py, [ids, lps, ranks, cu])
            .and_then(|items| c.tuple_new.bind(py).call1((cls, items)));
        let t = self.check(r)?;
        if untrack {
            // Three ndarrays (not GC objects) and None: the tuple cannot be part of a
            // cycle, so the collector need not see it (CPython untracks exact tuples of
            // such items itself; a tuple subclass it leaves tracked).
            // SAFETY: a live GC object, tracked by tuple.__new__.
            unsafe { ffi::PyObject_GC_UnTrack(t.as_ptr().cast()) };
        }
        Ok(t)
    }

    fn sampling_mask(&mut self, fields: &mut MaskSlots<Obj<'py>>) -> DecodeResult<Obj<'py>> {
        let py = self.py;
        let c = self.consts;
        let items = fields.each_mut().map(|v| self.opt(v.take()));
        let r = PyTuple::new(py, items).and_then(|items| {
            c.tuple_new
                .bind(py)
                .call1((c.sampling_mask_lists.bind(py), items))
        });
        self.check(r)
    }

    fn request_error(&mut self, map: Obj<'py>) -> DecodeResult<Obj<'py>> {
        let r = self.consts.request_error.bind(self.py).call1((map,));
        self.check(r)
    }

    fn utility_result(&mut self, value: Obj<'py>) -> DecodeResult<Obj<'py>> {
        let r = self.consts.utility_result.bind(self.py).call1((value,));
        self.check(r)
    }

    fn utility_output(&mut self, fields: &mut UtilitySlots<Obj<'py>>) -> DecodeResult<Obj<'py>> {
        let py = self.py;
        // The struct's fields, positionally in slot order (its field order).
        let args = fields.each_mut().map(|v| self.opt(v.take()));
        let r =
            PyTuple::new(py, args).and_then(|args| self.consts.utility_output.bind(py).call1(args));
        self.check(r)
    }

    #[inline]
    fn token_ids(&mut self, ids: &[i128]) -> DecodeResult<Obj<'py>> {
        let r = token_list(self.py, ids);
        self.check(r)
    }

    #[inline]
    fn finish_reason(&mut self, code: u8) -> DecodeResult<Obj<'py>> {
        Ok(self.consts.finish_reasons[code as usize]
            .bind(self.py)
            .clone())
    }

    /// The map itself, or what the caller's converter makes of it (a converter's
    /// exception rejects the frame like any bad field).
    fn stats(&mut self, kind: StatsKind, map: Obj<'py>) -> DecodeResult<Obj<'py>> {
        let convert = match kind {
            StatsKind::Prefill => &self.stats_types.prefill,
            StatsKind::Scheduler => &self.stats_types.scheduler,
        };
        match convert {
            Some(convert) => {
                let r = convert.bind(self.py).call1((map,));
                self.check(r)
            }
            None => Ok(map),
        }
    }

    // Always inlined: the hot path of both versions' walks (two callers would let the
    // optimiser keep it out of line).
    #[inline(always)]
    fn output(&mut self, fields: &mut OutputSlots<Obj<'py>>) -> DecodeResult<Obj<'py>> {
        let r = new_output(self.py, fields);
        self.check(r)
    }

    fn message(&mut self, fields: &mut MessageSlots<Obj<'py>>) -> DecodeResult<Obj<'py>> {
        let r = new_message(self.py, fields);
        self.check(r)
    }
}

/// A struct without a field the walk guarantees (a layout that lacks it).
#[cold]
fn missing_field() -> DecodeError {
    DecodeError::new(ErrorKind::Rejected(
        "internal error: a required field is missing from the layout".into(),
    ))
}
