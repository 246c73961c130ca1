//! The wire schema of engine -> front-end messages, walked over a [`Reader`].
//!
//! [`decode_outputs`] reads one `EngineCoreOutputs` message (docs/protocol.md §5-§6;
//! mirrored by `corewire.protocol`) and drives a [`Builder`] that makes the values: the
//! Python binding's builder makes Python objects, [`super::tree::TreeBuilder`] makes
//! plain Rust values for tests and fuzzing. The walk checks every type, length, index
//! and byte count itself, so any builder sees only well-formed input; it stops at the
//! first error, and the builder's values built so far are dropped with it.
//!
//! Struct-like arrays follow the protocol's rule: missing trailing fields take their
//! defaults, extra trailing fields are skipped. Which field sits at which position is
//! not written here but read from a version's [`super::wire::Layout`]; the walk only
//! knows how to read each [`FieldType`].

use super::error::{ArrayKind, DecodeError, DecodeResult, ErrorKind, Kind};
use super::msgpack::{check_utf8, Item, Reader, RAW_VIEW_EXT};
use super::wire::{
    Compiled, Current, EventField, FieldType, LayoutRef, LayoutSource, ListsField, MaskField,
    MessageField, OutputField, Protocol, Runtime, StatsKind, StructLayout, TensorsField,
    UtilityField, Version, WireStruct, V0_25_1, V0_33_0, V0_34_0,
};

/// Deepest nesting of containers inside a free-form (`Any`) field: the containers a
/// field's value may hold one inside the other.
///
/// vLLM 0.25.1's decoder (msgspec) stops where Python's recursion limit (1000 by
/// default) runs out, counted from the top of the frame and including its caller's
/// Python frames: it reads `kv_transfer_params` values up to about 994 levels deep, a
/// utility result up to about 995, fewer from a deeper call stack. 1000 levels read
/// every such frame. The walk keeps open containers on a stack on the heap, so the
/// bound is about the values it hands over, not about the decoder's own stack: walking
/// at the bound uses no more of the thread's stack than walking a scalar.
pub const MAX_DEPTH: usize = 1000;
/// Most dimensions an array may have (numpy 1.x's limit; torch allows more).
pub const MAX_DIMS: usize = 32;

/// Where the bytes of an array live: frame 0 is the payload (inline extension data),
/// frame `i >= 1` is aux frame `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataRef {
    pub frame: usize,
    pub offset: usize,
    pub len: usize,
}

/// A checked `[dtype, shape, data]` triple: `len == product(shape) * itemsize`.
#[derive(Debug)]
pub struct ArrayRef<'s> {
    pub kind: ArrayKind,
    pub dtype: &'s str,
    pub shape: &'s [usize],
    pub itemsize: usize,
    pub data: DataRef,
}

impl ArrayRef<'_> {
    /// Number of elements.
    pub fn count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Makes the values of a decoded message. Every method may fail; an error of kind
/// [`ErrorKind::Foreign`] means the builder keeps the real error itself.
///
/// A struct arrives as its fields by slot ([`WireStruct::slot`], the order of the
/// struct's table in [`super::wire`]), whatever their wire positions: `None` stands for
/// nil or absent, and for 0 in a [`FieldType::Count`] field; the walk has made every
/// other default (0, 0.0, an empty list) itself. The builder takes every value out of
/// the slots, even when it fails (they are lent, not moved, so that the walk's array is
/// not copied on the hot path; the walk does not drop them again).
pub trait Builder {
    /// Any built value.
    type Obj;

    /// nil.
    fn none(&mut self) -> Self::Obj;
    /// A bool.
    fn bool(&mut self, v: bool) -> Self::Obj;
    /// An integer in [-2**63, 2**64).
    fn int(&mut self, v: i128) -> DecodeResult<Self::Obj>;
    /// A float.
    fn float(&mut self, v: f64) -> DecodeResult<Self::Obj>;
    /// A string value.
    fn str(&mut self, v: &str) -> DecodeResult<Self::Obj>;
    /// A string used as a map key (may be cached: keys repeat from frame to frame).
    fn key_str(&mut self, v: &str) -> DecodeResult<Self::Obj> {
        self.str(v)
    }
    /// A binary (also extension type 3 outside array positions).
    fn bytes(&mut self, v: &[u8]) -> DecodeResult<Self::Obj>;
    /// A list of `len` elements, each set exactly once with [`Builder::list_set`].
    fn list(&mut self, len: usize) -> DecodeResult<Self::Obj>;
    /// Sets element `index` of a list made by [`Builder::list`].
    fn list_set(&mut self, list: &mut Self::Obj, index: usize, item: Self::Obj);
    /// The tuple with the elements of a complete list (arrays used as map keys).
    fn tuple_from_list(&mut self, list: Self::Obj) -> DecodeResult<Self::Obj>;
    /// An empty dict.
    fn dict(&mut self) -> DecodeResult<Self::Obj>;
    /// `dict[key] = value` (a later duplicate key wins).
    fn dict_set(
        &mut self,
        dict: &mut Self::Obj,
        key: Self::Obj,
        value: Self::Obj,
    ) -> DecodeResult<()>;
    /// An empty set.
    fn set(&mut self) -> DecodeResult<Self::Obj>;
    /// Adds to a set made by [`Builder::set`].
    fn set_add(&mut self, set: &mut Self::Obj, item: Self::Obj) -> DecodeResult<()>;

    /// Called once per message, before its outputs, with the sending engine's index
    /// (outputs of one engine come in a stable order from message to message).
    fn begin_outputs(&mut self, _engine_index: i128) {}
    /// The request id of an output, from its raw bytes (not yet checked for UTF-8: the
    /// builder checks, e.g. with [`check_utf8`], only when it does not know them).
    fn request_id(&mut self, raw: &[u8]) -> DecodeResult<Self::Obj>;
    /// A request id in `finished_requests` (same contract as [`Builder::request_id`]).
    fn finished_request_id(&mut self, raw: &[u8]) -> DecodeResult<Self::Obj> {
        self.request_id(raw)
    }
    /// An output's token ids (any msgpack integer; the slice is valid for this call).
    fn token_ids(&mut self, ids: &[i128]) -> DecodeResult<Self::Obj>;
    /// A `FinishReason`: 0 stop, 1 length, 2 abort, 3 error, 4 repetition (checked).
    fn finish_reason(&mut self, code: u8) -> DecodeResult<Self::Obj>;
    /// A decoded stats map, as the caller wants it (by default the map itself).
    fn stats(&mut self, _kind: StatsKind, map: Self::Obj) -> DecodeResult<Self::Obj> {
        Ok(map)
    }
    /// An `EngineCoreEvent`; `kind` is 1 queued, 2 scheduled, 3 preempted (checked).
    fn event(&mut self, kind: u8, timestamp: f64) -> DecodeResult<Self::Obj>;
    /// Bytes per element of `dtype`, or an [`ErrorKind::UnknownDtype`] error.
    fn dtype_itemsize(&mut self, kind: ArrayKind, dtype: &str) -> DecodeResult<usize>;
    /// An ndarray or tensor over the checked bytes `array.data`.
    fn array(&mut self, array: &ArrayRef<'_>) -> DecodeResult<Self::Obj>;
    /// Called before the arrays of a `LogprobsLists` / `LogprobsTensors`: the next three
    /// [`Builder::array`] calls are that tuple's, in its slot order, and
    /// [`Builder::logprobs`] follows them unless the walk fails (a builder may reuse
    /// storage for them).
    fn begin_logprobs(&mut self, _kind: ArrayKind) {}
    /// `LogprobsLists` (ndarrays, [`ListsSlots`]) or `LogprobsTensors` (tensors,
    /// [`TensorsSlots`]), by slot: the three arrays are always there, the slots after
    /// the fourth (`cu_num_generated_tokens`) are those of later versions.
    fn logprobs(
        &mut self,
        kind: ArrayKind,
        fields: &mut [Option<Self::Obj>],
    ) -> DecodeResult<Self::Obj>;
    /// `SamplingMaskLists`, by [`MaskField`] slot (token ids always there); by default
    /// a tuple of the three.
    fn sampling_mask(&mut self, fields: &mut MaskSlots<Self::Obj>) -> DecodeResult<Self::Obj> {
        let mut list = self.list(fields.len())?;
        for (i, v) in fields.iter_mut().enumerate() {
            let v = match v.take() {
                Some(v) => v,
                None => self.none(),
            };
            self.list_set(&mut list, i, v);
        }
        self.tuple_from_list(list)
    }
    /// A `RequestError` from its map (checked to hold a str `code` and `message`); by
    /// default the map itself.
    fn request_error(&mut self, map: Self::Obj) -> DecodeResult<Self::Obj> {
        Ok(map)
    }
    /// `UtilityResult(value)`.
    fn utility_result(&mut self, value: Self::Obj) -> DecodeResult<Self::Obj>;
    /// `UtilityOutput`, by [`UtilityField`] slot (the call id is always there).
    fn utility_output(&mut self, fields: &mut UtilitySlots<Self::Obj>) -> DecodeResult<Self::Obj>;
    /// One `EngineCoreOutput`, by [`OutputField`] slot (request id and token ids are
    /// always there).
    fn output(&mut self, fields: &mut OutputSlots<Self::Obj>) -> DecodeResult<Self::Obj>;
    /// The whole `EngineCoreOutputs`, by [`MessageField`] slot (engine index, outputs
    /// and timestamp are always there; `outputs` is a [`Builder::list`] of
    /// [`Builder::output`] values).
    fn message(&mut self, fields: &mut MessageSlots<Self::Obj>) -> DecodeResult<Self::Obj>;
}

/// The fields of an `EngineCoreOutputs`, by slot.
pub type MessageSlots<O> = [Option<O>; MessageField::COUNT];
/// The fields of an `EngineCoreOutput`, by slot.
pub type OutputSlots<O> = [Option<O>; OutputField::COUNT];
/// The fields of a `UtilityOutput`, by slot.
pub type UtilitySlots<O> = [Option<O>; UtilityField::COUNT];
/// The fields of a `LogprobsLists`, by slot.
pub type ListsSlots<O> = [Option<O>; ListsField::COUNT];
/// The fields of a `LogprobsTensors`, by slot (those of `LogprobsLists`, then more).
pub type TensorsSlots<O> = [Option<O>; TensorsField::COUNT];
/// The fields of a `SamplingMaskLists`, by slot.
pub type MaskSlots<O> = [Option<O>; MaskField::COUNT];

const _: () = assert!(ListsField::COUNT <= TensorsField::COUNT);

/// Buffers reused from message to message, so steady-state decoding allocates nothing
/// on the Rust side.
#[derive(Default, Debug)]
pub struct Scratch {
    tokens: Vec<i128>,
    shape: Vec<usize>,
}

/// Decodes one `EngineCoreOutputs` message of the protocol version corewire speaks
/// ([`super::wire::CURRENT`]): `frames[0]` is the msgpack payload, `frames[i]` aux frame
/// `i`. Fails on trailing bytes after the message.
pub fn decode_outputs<B: Builder>(
    frames: &[&[u8]],
    builder: &mut B,
    scratch: &mut Scratch,
) -> DecodeResult<B::Obj> {
    decode_outputs_as::<Current, B>(frames, builder, scratch)
}

/// [`decode_outputs`] for the wire `layout`, chosen at run time: one branch per message,
/// then the walk compiled for that version, or the walk over a layout made at run time.
pub fn decode_outputs_for<B: Builder>(
    layout: impl Into<LayoutRef>,
    frames: &[&[u8]],
    builder: &mut B,
    scratch: &mut Scratch,
) -> DecodeResult<B::Obj> {
    match layout.into() {
        LayoutRef::Builtin(Protocol::V0_25_1) => {
            decode_outputs_as::<V0_25_1, B>(frames, builder, scratch)
        }
        LayoutRef::Builtin(Protocol::V0_33_0) => {
            decode_outputs_as::<V0_33_0, B>(frames, builder, scratch)
        }
        LayoutRef::Builtin(Protocol::V0_34_0) => {
            decode_outputs_as::<V0_34_0, B>(frames, builder, scratch)
        }
        LayoutRef::Dynamic(layout) => decode_outputs_in(Runtime(layout), frames, builder, scratch),
    }
}

/// [`decode_outputs`] for the wire of protocol version `V`.
// Never inlined: each version's walk is one function of its own, which the optimiser
// treats as it treated the only one (inlining the builder's hot calls into it).
#[inline(never)]
pub fn decode_outputs_as<V: Version, B: Builder>(
    frames: &[&[u8]],
    builder: &mut B,
    scratch: &mut Scratch,
) -> DecodeResult<B::Obj> {
    decode_outputs_in(Compiled::<V>::new(), frames, builder, scratch)
}

/// [`decode_outputs`] for the wire `src` lays out.
#[cfg_attr(not(debug_assertions), inline(always))]
fn decode_outputs_in<L: LayoutSource, B: Builder>(
    src: L,
    frames: &[&[u8]],
    builder: &mut B,
    scratch: &mut Scratch,
) -> DecodeResult<B::Obj> {
    let Some(payload) = frames.first() else {
        return Err(DecodeError::new(ErrorKind::EmptyMessage));
    };
    let mut walk = Walk::<B, L> {
        r: Reader::new(payload),
        frames,
        payload_start: payload.as_ptr() as usize,
        b: builder,
        scratch,
        open: Vec::new(),
        engine_index: 0,
        src,
    };
    let message = walk.message()?;
    walk.r.finish()?;
    Ok(message)
}

/// Forgets a struct's slots once the builder took every value (a drop would test each
/// slot again).
#[inline(always)]
fn taken<O, const N: usize>(fields: [Option<O>; N]) {
    debug_assert!(fields.iter().all(Option::is_none), "a builder left a value");
    std::mem::forget(fields);
}

/// A value read, as a field's value.
#[inline(always)]
fn some<O>(r: DecodeResult<O>) -> DecodeResult<Option<O>> {
    r.map(Some)
}

/// Wraps an error with a field name (kept out of line: errors are cold).
macro_rules! field {
    ($name:literal, $e:expr) => {
        $e.map_err(|e: DecodeError| e.at_field($name))
    };
}

/// Reads the fields at every wire position a struct may have (up to
/// [`super::wire::MAX_FIELDS`]),
/// each through [`Walk::field_at`] with its position as a constant.
macro_rules! each_position {
    ($walk:ident, $layout:expr, $n:expr, $out:ident; $($pos:literal)*) => {
        $( $walk.field_at::<_, $pos, _>($layout, $n, $out)?; )*
    };
}

struct Walk<'a, 'b, B: Builder, L: LayoutSource> {
    r: Reader<'a>,
    frames: &'b [&'a [u8]],
    payload_start: usize,
    b: &'b mut B,
    scratch: &'b mut Scratch,
    /// The open containers of the free-form value being read, outermost first (empty
    /// between values; allocated on the first nested container of a message).
    open: Vec<Open<'a, B::Obj>>,
    /// The message's engine index, once read (for [`Builder::begin_outputs`]).
    engine_index: i128,
    /// Where the positions of every struct are read from.
    src: L,
}

/// A container of a free-form value whose elements are still being read.
enum Open<'a, O> {
    /// A list of `len` elements, `next` of them set; `as_key`: a map key's array, whose
    /// elements are keys too and which becomes a tuple when complete.
    List {
        obj: O,
        len: usize,
        next: usize,
        as_key: bool,
    },
    /// A dict of `len` entries, `next` of them set; `key`: the key of entry `next` once
    /// read (its value is read next), which starts at `key_at` (to name it in errors).
    Dict {
        obj: O,
        len: usize,
        next: usize,
        key: Option<O>,
        key_at: Reader<'a>,
    },
}

impl<'a, B: Builder, L: LayoutSource> Walk<'a, '_, B, L> {
    fn message(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array (EngineCoreOutputs)")?;
        let mut fields = [const { None }; MessageField::COUNT];
        self.struct_fields(&self.src.get().message, n, &mut fields)?;
        let built = self.b.message(&mut fields);
        taken(fields);
        built
    }

    /// The fields of a struct array of `n` elements laid out as `layout`, by slot:
    /// checks the length, reads every known position, skips the rest, makes defaults.
    ///
    /// Every position is its own inlined step. For a compiled version the field and its
    /// type are known at compile time (its layout is a constant), so the walk is the
    /// straight-line code a hand-written reader of that version would be: no table
    /// lookup at run time. A layout made at run time is read position by position.
    // Inlined where it is used in optimised builds, where the steps fold to straight-line
    // code; not in debug builds, whose unmerged stack slots would make deep values
    // overflow small stacks.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn struct_fields<F: WireStruct, const N: usize>(
        &mut self,
        layout: &StructLayout<F>,
        n: usize,
        out: &mut [Option<B::Obj>; N],
    ) -> DecodeResult<()> {
        if n < layout.min_len {
            return Err(DecodeError::new(ErrorKind::TooShort {
                min: layout.min_len,
                got: n,
            }));
        }
        const { assert!(N == F::ALL.len()) };
        const { assert!(super::wire::MAX_FIELDS == 24) };
        each_position!(self, layout, n, out;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23);
        self.skip_extra(n, layout.fields.len())?;
        if F::HAS_VALUE_DEFAULTS {
            self.defaults::<F, N>(out)?;
        }
        Ok(())
    }

    /// Reads the field at wire position `POS` into its slot, if the array and the
    /// layout have that position.
    // Inlined where it is used in optimised builds, where the steps fold to straight-line
    // code; not in debug builds, whose unmerged stack slots would make deep values
    // overflow small stacks.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn field_at<F: WireStruct, const POS: usize, const N: usize>(
        &mut self,
        layout: &StructLayout<F>,
        n: usize,
        out: &mut [Option<B::Obj>; N],
    ) -> DecodeResult<()> {
        if POS >= layout.fields.len() || POS >= n {
            return Ok(());
        }
        let Some(field) = layout.fields[POS] else {
            return self.r.skip().map_err(|e| e.at_index(POS));
        };
        let info = field.info();
        // Nullable fields are nil in the common case: one byte compare each.
        if info.ty.nullable() && self.r.take_nil() {
            return Ok(());
        }
        match self.value_of(info.ty) {
            Ok(v) => {
                out[field.slot()] = v;
                Ok(())
            }
            Err(e) => Err(e.at_field(info.name)),
        }
    }

    /// The default of every absent field that has one besides "no value".
    #[cold]
    fn defaults<F: WireStruct, const N: usize>(
        &mut self,
        out: &mut [Option<B::Obj>; N],
    ) -> DecodeResult<()> {
        for &field in F::ALL {
            if out[field.slot()].is_some() {
                continue;
            }
            out[field.slot()] = match field.info().ty {
                FieldType::EngineIndex => Some(self.b.int(0)?),
                FieldType::Float => Some(self.b.float(0.0)?),
                FieldType::Outputs => Some(self.b.list(0)?),
                _ => None,
            };
        }
        Ok(())
    }

    /// A non-nil value of type `ty` (`None`: no value, see [`FieldType::Count`]).
    ///
    /// (Every arm is one call whose result is returned as it is: a debug build then
    /// keeps no temporaries of all the arms in this frame.)
    // Inlined where it is used in optimised builds, where the steps fold to straight-line
    // code; not in debug builds, whose unmerged stack slots would make deep values
    // overflow small stacks.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn value_of(&mut self, ty: FieldType) -> DecodeResult<Option<B::Obj>> {
        match ty {
            FieldType::RequestId => self.request_id(),
            FieldType::TokenIds => self.token_id_list(),
            FieldType::EngineIndex => self.engine_index(),
            FieldType::Count => self.count(),
            FieldType::Int => self.int(),
            FieldType::OptInt => self.nullable_int(),
            FieldType::Float => self.float(),
            FieldType::OptStr => self.string(),
            FieldType::OptBool => self.boolean(),
            FieldType::Outputs => {
                self.b.begin_outputs(self.engine_index);
                some(self.outputs())
            }
            FieldType::Logprobs(kind) => some(self.logprobs(kind)),
            FieldType::Array(kind) | FieldType::OptArray(kind) => some(self.array(kind)),
            FieldType::FinishReason => self.finish_reason_value(),
            FieldType::StopReason => some(self.stop_reason()),
            FieldType::Events => some(self.events()),
            FieldType::AnyDict => some(self.str_dict(false)),
            FieldType::StrDict => some(self.str_dict(true)),
            FieldType::Stats(kind) => self.stats(kind),
            FieldType::UtilityOutput => some(self.utility_output()),
            FieldType::UtilityResult => some(self.utility_result()),
            FieldType::RequestIdSet => some(self.str_set()),
            FieldType::IntList => some(self.int_list()),
            FieldType::EventType => self.event_type_value(),
            FieldType::StrList => some(self.str_list()),
            FieldType::SamplingMask => some(self.sampling_mask()),
            FieldType::RequestError => some(self.request_error()),
        }
    }

    #[inline]
    fn request_id(&mut self) -> DecodeResult<Option<B::Obj>> {
        let raw = self.r.str_bytes()?;
        self.b.request_id(raw).map(Some)
    }

    #[inline]
    fn token_id_list(&mut self) -> DecodeResult<Option<B::Obj>> {
        self.token_ids()?;
        self.b.token_ids(&self.scratch.tokens).map(Some)
    }

    fn engine_index(&mut self) -> DecodeResult<Option<B::Obj>> {
        let v = self.r.int()?;
        self.engine_index = v;
        self.b.int(v).map(Some)
    }

    #[cfg_attr(not(debug_assertions), inline(always))]
    fn count(&mut self) -> DecodeResult<Option<B::Obj>> {
        match self.r.int()? {
            0 => Ok(None),
            v => self.b.int(v).map(Some),
        }
    }

    fn int(&mut self) -> DecodeResult<Option<B::Obj>> {
        let v = self.r.int()?;
        self.b.int(v).map(Some)
    }

    fn nullable_int(&mut self) -> DecodeResult<Option<B::Obj>> {
        let v = self.opt_int()?;
        self.b.int(v).map(Some)
    }

    fn float(&mut self) -> DecodeResult<Option<B::Obj>> {
        let v = self.r.float()?;
        self.b.float(v).map(Some)
    }

    fn boolean(&mut self) -> DecodeResult<Option<B::Obj>> {
        let v = self.r.bool()?;
        Ok(Some(self.b.bool(v)))
    }

    fn string(&mut self) -> DecodeResult<Option<B::Obj>> {
        let s = self.r.str()?;
        self.b.str(s).map(Some)
    }

    #[inline]
    fn finish_reason_value(&mut self) -> DecodeResult<Option<B::Obj>> {
        let code = self.finish_reason()?;
        self.b.finish_reason(code).map(Some)
    }

    fn stats(&mut self, kind: StatsKind) -> DecodeResult<Option<B::Obj>> {
        let map = self.str_dict(false)?;
        self.b.stats(kind, map).map(Some)
    }

    fn event_type_value(&mut self) -> DecodeResult<Option<B::Obj>> {
        let kind = self.event_type()?;
        self.b.int(kind.into()).map(Some)
    }

    /// Skips the fields of a `len`-element struct array past the `known` ones.
    #[inline]
    fn skip_extra(&mut self, len: usize, known: usize) -> DecodeResult<()> {
        for i in known..len {
            self.r.skip().map_err(|e| e.at_index(i))?;
        }
        Ok(())
    }

    fn outputs(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array")?;
        let mut list = self.b.list(n)?;
        for i in 0..n {
            let item = self.output().map_err(|e| e.at_index(i))?;
            self.b.list_set(&mut list, i, item);
        }
        Ok(list)
    }

    #[inline]
    fn output(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array (EngineCoreOutput)")?;
        let mut fields = [const { None }; OutputField::COUNT];
        self.struct_fields(&self.src.get().output, n, &mut fields)?;
        let built = self.b.output(&mut fields);
        taken(fields);
        built
    }

    #[inline]
    fn token_ids(&mut self) -> DecodeResult<()> {
        let n = self.r.array_len("array")?;
        self.scratch.tokens.clear();
        for i in 0..n {
            let id = self.r.uint32_or_int().map_err(|e| e.at_index(i))?;
            self.scratch.tokens.push(id);
        }
        Ok(())
    }

    fn finish_reason(&mut self) -> DecodeResult<u8> {
        let v = self.r.int()?;
        match u8::try_from(v) {
            Ok(code @ 0..=4) => Ok(code),
            _ => Err(DecodeError::new(ErrorKind::InvalidEnum {
                what: "FinishReason",
                value: v,
            })),
        }
    }

    /// `int | str` (nil handled by the caller).
    fn stop_reason(&mut self) -> DecodeResult<B::Obj> {
        let save = self.r.clone();
        match self.r.next_item()? {
            Item::Int(v) => self.b.int(v),
            Item::Str(raw) => {
                let s = check_utf8(raw)?;
                self.b.str(s)
            }
            other => {
                self.r = save;
                Err(DecodeError::new(ErrorKind::Type {
                    expected: "int | str | nil",
                    got: other.kind(),
                }))
            }
        }
    }

    /// The int of an `int | nil` field (nil handled by the caller).
    #[inline]
    fn opt_int(&mut self) -> DecodeResult<i128> {
        self.r.int().map_err(|e| match e.kind() {
            ErrorKind::Type { got, .. } => DecodeError::new(ErrorKind::Type {
                expected: "int | nil",
                got: *got,
            }),
            _ => e,
        })
    }

    /// `array of EngineCoreEvent` (nil handled by the caller).
    fn events(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array")?;
        let mut list = self.b.list(n)?;
        for i in 0..n {
            let event = self.event().map_err(|e| e.at_index(i))?;
            self.b.list_set(&mut list, i, event);
        }
        Ok(list)
    }

    /// An `EngineCoreEvent`: a map of [`EventField`] keys; other keys are ignored, a
    /// later duplicate wins.
    fn event(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.map_len("map (EngineCoreEvent)")?;
        let mut kind = None;
        let mut timestamp = None;
        for i in 0..n {
            let save = self.r.clone();
            let key = match self.r.next_item().map_err(|e| e.at_key_of(i))? {
                Item::Str(raw) => raw,
                other => {
                    self.r = save;
                    return Err(
                        DecodeError::new(ErrorKind::NonStrKey { got: other.kind() }).at_key_of(i)
                    );
                }
            };
            let field = EventField::ALL
                .iter()
                .find(|f| f.info().name.as_bytes() == key);
            match field {
                Some(&f @ EventField::Type) => {
                    kind = Some(self.event_type().map_err(|e| e.at_field(f.info().name))?);
                }
                Some(&f @ EventField::Timestamp) => {
                    let v = self.r.float().map_err(|e| e.at_field(f.info().name))?;
                    timestamp = Some(v);
                }
                None => self.r.skip().map_err(|e| e.at_index(i))?,
            }
        }
        let missing =
            |f: EventField| DecodeError::new(ErrorKind::MissingKey { key: f.info().name });
        let Some(kind) = kind else {
            return Err(missing(EventField::Type));
        };
        let Some(timestamp) = timestamp else {
            return Err(missing(EventField::Timestamp));
        };
        self.b.event(kind, timestamp)
    }

    /// An `EngineCoreEventType` value: 1 queued, 2 scheduled, 3 preempted.
    fn event_type(&mut self) -> DecodeResult<u8> {
        let v = self.r.int()?;
        match u8::try_from(v) {
            Ok(k @ 1..=3) => Ok(k),
            _ => Err(DecodeError::new(ErrorKind::InvalidEnum {
                what: "EngineCoreEventType",
                value: v,
            })),
        }
    }

    /// `set[str]` from an array of str (nil handled by the caller).
    fn str_set(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array | nil")?;
        let mut set = self.b.set()?;
        for i in 0..n {
            let raw = self.r.str_bytes().map_err(|e| e.at_index(i))?;
            let item = self.b.finished_request_id(raw).map_err(|e| e.at_index(i))?;
            self.b.set_add(&mut set, item).map_err(|e| e.at_index(i))?;
        }
        Ok(set)
    }

    /// `dict[str, Any]`, or `dict[str, str]` when `str_values` (nil handled by the caller).
    fn str_dict(&mut self, str_values: bool) -> DecodeResult<B::Obj> {
        let n = self.r.map_len("map | nil")?;
        let mut dict = self.b.dict()?;
        for i in 0..n {
            let key_raw = self.r.str_bytes().map_err(|e| e.at_key_of(i))?;
            let key_str = check_utf8(key_raw).map_err(|e| e.at_key_of(i))?;
            let key = self.b.key_str(key_str).map_err(|e| e.at_key_of(i))?;
            let value = if str_values {
                self.r
                    .str()
                    .and_then(|s| self.b.str(s))
                    .map_err(|e| e.at_key(key_str))?
            } else {
                self.value(1).map_err(|e| e.at_key(key_str))?
            };
            self.b
                .dict_set(&mut dict, key, value)
                .map_err(|e| e.at_key(key_str))?;
        }
        Ok(dict)
    }

    /// `UtilityOutput` (nil handled by the caller).
    fn utility_output(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array (UtilityOutput) | nil")?;
        let mut fields = [const { None }; UtilityField::COUNT];
        self.struct_fields(&self.src.get().utility_output, n, &mut fields)?;
        let built = self.b.utility_output(&mut fields);
        taken(fields);
        built
    }

    /// `[type_info, value]`; type_info is checked like any value, then dropped
    /// (corewire never sends one and never imports types a peer names).
    fn utility_result(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array ([type_info, value]) | nil")?;
        if n != 2 {
            return Err(DecodeError::new(ErrorKind::WrongLength {
                expected: 2,
                got: n,
            }));
        }
        drop(self.value(1).map_err(|e| e.at_index(0))?);
        let value = self.value(1).map_err(|e| e.at_index(1))?;
        self.b.utility_result(value)
    }

    /// `LogprobsLists` / `LogprobsTensors`: three arrays, then
    /// `cu_num_generated_tokens: list[int] | nil` (nil handled by the caller).
    fn logprobs(&mut self, kind: ArrayKind) -> DecodeResult<B::Obj> {
        let what = match kind {
            ArrayKind::Ndarray => "array (LogprobsLists) | nil",
            ArrayKind::Tensor => "array (LogprobsTensors) | nil",
        };
        let n = self.r.array_len(what)?;
        self.b.begin_logprobs(kind);
        match kind {
            ArrayKind::Ndarray => {
                let mut fields = [const { None }; ListsField::COUNT];
                self.struct_fields(&self.src.get().logprobs_lists, n, &mut fields)?;
                let built = self.b.logprobs(kind, &mut fields);
                taken(fields);
                built
            }
            ArrayKind::Tensor => {
                let mut fields = [const { None }; TensorsField::COUNT];
                self.struct_fields(&self.src.get().logprobs_tensors, n, &mut fields)?;
                let built = self.b.logprobs(kind, &mut fields);
                taken(fields);
                built
            }
        }
    }

    /// `SamplingMaskLists` (nil handled by the caller).
    #[inline(never)]
    fn sampling_mask(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array (SamplingMaskLists) | nil")?;
        let Some(layout) = &self.src.get().sampling_mask else {
            // Only a layout with a SamplingMask position gets here.
            return Err(DecodeError::new(ErrorKind::Rejected(
                "internal error: a layout without SamplingMaskLists reads one".into(),
            )));
        };
        let mut fields = [const { None }; MaskField::COUNT];
        self.struct_fields(layout, n, &mut fields)?;
        let built = self.b.sampling_mask(&mut fields);
        taken(fields);
        built
    }

    /// `RequestError`: a map with str `code` and `message` (and a bool `retryable`),
    /// handed to the builder (nil handled by the caller).
    #[inline(never)]
    fn request_error(&mut self) -> DecodeResult<B::Obj> {
        let start = self.r.clone();
        let n = self.r.map_len("map (RequestError) | nil")?;
        // Check the keys' types first, on a copy of the reader: the map is then read as
        // a dict like any other.
        let (mut code, mut message) = (false, false);
        for i in 0..n {
            let key = self.r.str_bytes().map_err(|e| e.at_key_of(i))?;
            let at = |e: DecodeError| e.at_key(&String::from_utf8_lossy(key));
            match key {
                b"code" | b"message" => {
                    self.r.str().map_err(at)?;
                    if key == b"code" {
                        code = true;
                    } else {
                        message = true;
                    }
                }
                b"retryable" => match self.r.next_item().map_err(at)? {
                    Item::Bool(_) => {}
                    other => {
                        return Err(at(DecodeError::new(ErrorKind::Type {
                            expected: "bool",
                            got: other.kind(),
                        })))
                    }
                },
                _ => self.r.skip().map_err(at)?,
            }
        }
        for (present, key) in [(code, "code"), (message, "message")] {
            if !present {
                return Err(DecodeError::new(ErrorKind::MissingKey { key }));
            }
        }
        self.r = start;
        let map = self.str_dict(false)?;
        self.b.request_error(map)
    }

    /// `list[str]` (nil handled by the caller).
    fn str_list(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array | nil")?;
        let mut list = self.b.list(n)?;
        for i in 0..n {
            let v = self.r.str().and_then(|s| self.b.str(s));
            let v = v.map_err(|e| e.at_index(i))?;
            self.b.list_set(&mut list, i, v);
        }
        Ok(list)
    }

    fn int_list(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array | nil")?;
        let mut list = self.b.list(n)?;
        for i in 0..n {
            let v = self.r.int().and_then(|v| self.b.int(v));
            let v = v.map_err(|e| e.at_index(i))?;
            self.b.list_set(&mut list, i, v);
        }
        Ok(list)
    }

    /// `[dtype, shape, data]` with data inline (extension type 3) or in an aux frame.
    fn array(&mut self, kind: ArrayKind) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array ([dtype, shape, data])")?;
        if n != 3 {
            return Err(DecodeError::new(ErrorKind::WrongLength {
                expected: 3,
                got: n,
            }));
        }
        let dtype = field!("dtype", self.r.str())?;
        field!("shape", self.shape())?;
        let data = field!("data", self.data_ref())?;
        let itemsize = field!("dtype", self.b.dtype_itemsize(kind, dtype))?;
        // Like numpy: zero dimensions make an empty array whatever the others are, but
        // the product of the non-zero ones must still fit in the address space.
        let mut nonzero: u128 = itemsize as u128;
        let mut total: u128 = itemsize as u128;
        for &d in &self.scratch.shape {
            if d != 0 {
                nonzero = nonzero.saturating_mul(d as u128);
            }
            total = total.saturating_mul(d as u128);
        }
        if nonzero > isize::MAX as u128 {
            return Err(DecodeError::new(ErrorKind::ShapeOverflow).at_field("shape"));
        }
        if total != data.len as u128 {
            return Err(DecodeError::new(ErrorKind::ByteLength {
                needed: total,
                got: data.len,
            }));
        }
        self.b.array(&ArrayRef {
            kind,
            dtype,
            shape: &self.scratch.shape,
            itemsize,
            data,
        })
    }

    fn shape(&mut self) -> DecodeResult<()> {
        let n = self.r.array_len("array")?;
        if n > MAX_DIMS {
            return Err(DecodeError::new(ErrorKind::TooManyDims {
                ndim: n,
                limit: MAX_DIMS,
            }));
        }
        self.scratch.shape.clear();
        for i in 0..n {
            let d = self.r.int().map_err(|e| e.at_index(i))?;
            if d < 0 {
                return Err(DecodeError::new(ErrorKind::NegativeDim { dim: d }).at_index(i));
            }
            if d > i64::MAX as i128 {
                return Err(DecodeError::new(ErrorKind::IntOutOfRange {
                    value: d,
                    min: 0,
                    max: i64::MAX as i128,
                })
                .at_index(i));
            }
            self.scratch.shape.push(d as usize);
        }
        Ok(())
    }

    fn data_ref(&mut self) -> DecodeResult<DataRef> {
        if let Some(bytes) = self.r.small_raw_view() {
            return Ok(DataRef {
                frame: 0,
                offset: bytes.as_ptr() as usize - self.payload_start,
                len: bytes.len(),
            });
        }
        let save = self.r.clone();
        match self.r.next_item()? {
            Item::Ext(RAW_VIEW_EXT, bytes) => Ok(DataRef {
                frame: 0,
                offset: bytes.as_ptr() as usize - self.payload_start,
                len: bytes.len(),
            }),
            Item::Ext(code, _) => Err(DecodeError::new(ErrorKind::UnknownExt { code })),
            Item::Int(index) => {
                let aux_frames = self.frames.len() - 1;
                if index < 1 || index > aux_frames as i128 {
                    return Err(DecodeError::new(ErrorKind::AuxIndexOutOfRange {
                        index,
                        aux_frames,
                    }));
                }
                let frame = index as usize;
                Ok(DataRef {
                    frame,
                    offset: 0,
                    len: self.frames[frame].len(),
                })
            }
            other => {
                self.r = save;
                Err(DecodeError::new(ErrorKind::BadArrayData {
                    got: other.kind(),
                }))
            }
        }
    }

    /// A free-form (`Any`) value; `depth` counts the free-form containers around it
    /// (the field's own map or array).
    ///
    /// Scalars return at once; containers are read by [`Walk::nested`] without recursion.
    /// (Out of line: free-form fields are rare and kept off the hot output path.)
    #[inline(never)]
    fn value(&mut self, depth: usize) -> DecodeResult<B::Obj> {
        let item = self.r.next_item()?;
        match item {
            Item::Array(_) | Item::Map(_) => self.nested(depth, item),
            _ => self.scalar(item),
        }
    }

    /// A value that is not a container.
    #[inline]
    fn scalar(&mut self, item: Item<'a>) -> DecodeResult<B::Obj> {
        match item {
            Item::Nil => Ok(self.b.none()),
            Item::Bool(v) => Ok(self.b.bool(v)),
            Item::Int(v) => self.b.int(v),
            Item::Float(v) => self.b.float(v),
            Item::Str(raw) => {
                let s = check_utf8(raw)?;
                self.b.str(s)
            }
            Item::Bin(v) => self.b.bytes(v),
            Item::Ext(RAW_VIEW_EXT, v) => self.b.bytes(v),
            Item::Ext(code, _) => Err(DecodeError::new(ErrorKind::UnknownExt { code })),
            Item::Array(_) | Item::Map(_) => unreachable!("containers are read by nested()"),
        }
    }

    /// The container that starts with `first` (its header, already read) and all it
    /// holds, read with an explicit stack of open containers (`self.open`) instead of
    /// recursion: the decoder's stack use does not grow with the nesting. `depth`
    /// counts the containers around `first`.
    ///
    /// Map keys are read like values, except that arrays become tuples and maps are
    /// unhashable (as in Python, and msgspec).
    #[inline(never)]
    fn nested(&mut self, depth: usize, first: Item<'a>) -> DecodeResult<B::Obj> {
        debug_assert!(self.open.is_empty());
        let r = self.nested_inner(depth, first);
        if r.is_err() {
            // Whatever failed, no container stays open for the next value.
            self.open.clear();
        }
        r
    }

    fn nested_inner(&mut self, depth: usize, first: Item<'a>) -> DecodeResult<B::Obj> {
        let mut item = first;
        let mut item_as_key = false;
        loop {
            // Read `item`: a complete value, or a container opened (then its first element
            // is read next).
            let mut done = match item {
                Item::Array(n) => {
                    self.check_depth(depth)?;
                    let list = self.b.list(n).map_err(|e| self.unwind(e))?;
                    if n == 0 {
                        self.complete_list(list, item_as_key)?
                    } else {
                        self.open.push(Open::List {
                            obj: list,
                            len: n,
                            next: 0,
                            as_key: item_as_key,
                        });
                        (item, item_as_key) = self.next_element()?;
                        continue;
                    }
                }
                Item::Map(n) => {
                    self.check_depth(depth)?;
                    let dict = self.b.dict().map_err(|e| self.unwind(e))?;
                    if n == 0 {
                        dict
                    } else {
                        self.open.push(Open::Dict {
                            obj: dict,
                            len: n,
                            next: 0,
                            key: None,
                            key_at: self.r.clone(),
                        });
                        (item, item_as_key) = self.next_element()?;
                        continue;
                    }
                }
                Item::Str(raw) if item_as_key => {
                    let r = check_utf8(raw).and_then(|s| self.b.key_str(s));
                    r.map_err(|e| self.unwind(e))?
                }
                other => self.scalar(other).map_err(|e| self.unwind(e))?,
            };
            // Hand the complete value to its container, closing every container that it
            // completes, until one still wants elements (or the outermost is done).
            loop {
                match self.open.last_mut() {
                    None => return Ok(done),
                    Some(Open::List { obj, len, next, .. }) => {
                        self.b.list_set(obj, *next, done);
                        *next += 1;
                        if *next < *len {
                            break;
                        }
                        let Some(Open::List { obj, as_key, .. }) = self.open.pop() else {
                            unreachable!("the innermost open container is this list")
                        };
                        done = self.complete_list(obj, as_key)?;
                    }
                    Some(Open::Dict {
                        obj,
                        len,
                        next,
                        key,
                        key_at,
                    }) => match key.take() {
                        None => {
                            *key = Some(done);
                            break;
                        }
                        Some(k) => {
                            if let Err(e) = self.b.dict_set(obj, k, done) {
                                let e = at_map_value(e, key_at.clone(), *next);
                                self.open.pop();
                                return Err(self.unwind(e));
                            }
                            *next += 1;
                            if *next < *len {
                                *key_at = self.r.clone();
                                break;
                            }
                            let Some(Open::Dict { obj, .. }) = self.open.pop() else {
                                unreachable!("the innermost open container is this dict")
                            };
                            done = obj;
                        }
                    },
                }
            }
            (item, item_as_key) = self.next_element()?;
        }
    }

    /// A list whose elements are all set: the list, or the tuple made of it for a key.
    #[inline]
    fn complete_list(&mut self, list: B::Obj, as_key: bool) -> DecodeResult<B::Obj> {
        if as_key {
            let r = self.b.tuple_from_list(list);
            return r.map_err(|e| self.unwind(e));
        }
        Ok(list)
    }

    /// Reads the header of the next element of the innermost open container (a key
    /// of a dict whose `key` is unset, else a value), and says whether it is a key.
    #[inline]
    fn next_element(&mut self) -> DecodeResult<(Item<'a>, bool)> {
        let as_key = match self.open.last() {
            Some(Open::List { as_key, .. }) => *as_key,
            Some(Open::Dict { key, .. }) => key.is_none(),
            None => false,
        };
        if as_key && self.r.peek_kind() == Kind::Map {
            return Err(self.unwind(DecodeError::new(ErrorKind::UnhashableKey)));
        }
        match self.r.next_item() {
            Ok(item) => Ok((item, as_key)),
            Err(e) => Err(self.unwind(e)),
        }
    }

    /// Fails if a container opened now would be nested deeper than [`MAX_DEPTH`];
    /// `depth` counts the containers around the outermost open one.
    #[inline]
    fn check_depth(&mut self, depth: usize) -> DecodeResult<()> {
        let level = depth + self.open.len();
        if level > MAX_DEPTH {
            let e = DecodeError::new(ErrorKind::TooDeep {
                depth: level,
                limit: MAX_DEPTH,
            });
            return Err(self.unwind(e));
        }
        Ok(())
    }

    /// Closes every open container, adding to `e` the path from the outermost to the
    /// failing value (innermost segment first, as an error bubbling up would).
    #[cold]
    #[inline(never)]
    fn unwind(&mut self, mut e: DecodeError) -> DecodeError {
        while let Some(open) = self.open.pop() {
            e = match open {
                Open::List { next, .. } => e.at_index(next),
                Open::Dict {
                    next, key: None, ..
                } => e.at_key_of(next),
                Open::Dict { next, key_at, .. } => at_map_value(e, key_at, next),
            };
        }
        e
    }
}

/// Adds the key of map entry `entry` (re-read from `key_at`) to an error's path.
#[cold]
#[inline(never)]
fn at_map_value(e: DecodeError, mut key_at: Reader<'_>, entry: usize) -> DecodeError {
    match key_at.next_item() {
        Ok(Item::Str(raw)) => e.at_key(&String::from_utf8_lossy(raw)),
        Ok(Item::Int(v)) => e.at_key(&v.to_string()),
        _ => e.at_index(entry),
    }
}
