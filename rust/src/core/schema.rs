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
//! defaults, extra trailing fields are skipped.

use super::error::{ArrayKind, DecodeError, DecodeResult, ErrorKind, Kind};
use super::msgpack::{check_utf8, Item, Reader, RAW_VIEW_EXT};

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

/// The fields of one `EngineCoreOutput` (protocol.EngineCoreOutput, positional:
/// request_id, new_token_ids, new_logprobs, new_prompt_logprobs_tensors,
/// pooling_output, finish_reason, stop_reason, events, kv_transfer_params,
/// trace_headers, prefill_stats, routed_experts, num_nans_in_logits).
/// `None` stands for nil.
pub struct OutputParts<'s, O> {
    pub request_id: O,
    /// Token ids (any msgpack integer), valid until the builder returns.
    pub new_token_ids: &'s [i128],
    pub new_logprobs: Option<O>,
    pub new_prompt_logprobs_tensors: Option<O>,
    pub pooling_output: Option<O>,
    /// 0 stop, 1 length, 2 abort, 3 error, 4 repetition (checked).
    pub finish_reason: Option<u8>,
    pub stop_reason: Option<O>,
    pub events: Option<O>,
    pub kv_transfer_params: Option<O>,
    pub trace_headers: Option<O>,
    pub prefill_stats: Option<O>,
    pub routed_experts: Option<O>,
    pub num_nans_in_logits: i128,
}

/// The fields of one `EngineCoreOutputs` (protocol.EngineCoreOutputs, positional:
/// engine_index, outputs, scheduler_stats, timestamp, utility_output,
/// finished_requests, wave_complete, start_wave).
pub struct MessageParts<O> {
    pub engine_index: i128,
    /// A list built with [`Builder::list`] of [`Builder::output`] values.
    pub outputs: O,
    pub scheduler_stats: Option<O>,
    pub timestamp: f64,
    pub utility_output: Option<O>,
    /// A set built with [`Builder::set`] of [`Builder::request_id`] values.
    pub finished_requests: Option<O>,
    pub wave_complete: Option<i128>,
    pub start_wave: Option<i128>,
}

/// Makes the values of a decoded message. Every method may fail; an error of kind
/// [`ErrorKind::Foreign`] means the builder keeps the real error itself.
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
    /// An `EngineCoreEvent`; `kind` is 1 queued, 2 scheduled, 3 preempted (checked).
    fn event(&mut self, kind: u8, timestamp: f64) -> DecodeResult<Self::Obj>;
    /// Bytes per element of `dtype`, or an [`ErrorKind::UnknownDtype`] error.
    fn dtype_itemsize(&mut self, kind: ArrayKind, dtype: &str) -> DecodeResult<usize>;
    /// An ndarray or tensor over the checked bytes `array.data`.
    fn array(&mut self, array: &ArrayRef<'_>) -> DecodeResult<Self::Obj>;
    /// Called before the three arrays of a `LogprobsLists` / `LogprobsTensors`: the next
    /// three [`Builder::array`] calls are that tuple's, in order, and [`Builder::logprobs`]
    /// follows them unless the walk fails (a builder may reuse storage for them).
    fn begin_logprobs(&mut self, _kind: ArrayKind) {}
    /// `LogprobsLists` (ndarrays) or `LogprobsTensors` (tensors).
    fn logprobs(
        &mut self,
        kind: ArrayKind,
        arrays: [Self::Obj; 3],
        cu_num_generated_tokens: Option<Self::Obj>,
    ) -> DecodeResult<Self::Obj>;
    /// `UtilityResult(value)`.
    fn utility_result(&mut self, value: Self::Obj) -> DecodeResult<Self::Obj>;
    /// `UtilityOutput(call_id, failure_message, result)`.
    fn utility_output(
        &mut self,
        call_id: i128,
        failure_message: Option<Self::Obj>,
        result: Option<Self::Obj>,
    ) -> DecodeResult<Self::Obj>;
    /// One `EngineCoreOutput`.
    fn output(&mut self, parts: OutputParts<'_, Self::Obj>) -> DecodeResult<Self::Obj>;
    /// The whole `EngineCoreOutputs`.
    fn message(&mut self, parts: MessageParts<Self::Obj>) -> DecodeResult<Self::Obj>;
}

/// Buffers reused from message to message, so steady-state decoding allocates nothing
/// on the Rust side.
#[derive(Default, Debug)]
pub struct Scratch {
    tokens: Vec<i128>,
    shape: Vec<usize>,
}

/// Decodes one `EngineCoreOutputs` message: `frames[0]` is the msgpack payload,
/// `frames[i]` aux frame `i`. Fails on trailing bytes after the message.
pub fn decode_outputs<B: Builder>(
    frames: &[&[u8]],
    builder: &mut B,
    scratch: &mut Scratch,
) -> DecodeResult<B::Obj> {
    let Some(payload) = frames.first() else {
        return Err(DecodeError::new(ErrorKind::EmptyMessage));
    };
    let mut walk = Walk {
        r: Reader::new(payload),
        frames,
        payload_start: payload.as_ptr() as usize,
        b: builder,
        scratch,
        open: Vec::new(),
    };
    let message = walk.message()?;
    walk.r.finish()?;
    Ok(message)
}

/// Wraps an error with a field name (kept out of line: errors are cold).
macro_rules! field {
    ($name:literal, $e:expr) => {
        $e.map_err(|e: DecodeError| e.at_field($name))
    };
}

struct Walk<'a, 'b, B: Builder> {
    r: Reader<'a>,
    frames: &'b [&'a [u8]],
    payload_start: usize,
    b: &'b mut B,
    scratch: &'b mut Scratch,
    /// The open containers of the free-form value being read, outermost first (empty
    /// between values; allocated on the first nested container of a message).
    open: Vec<Open<'a, B::Obj>>,
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

impl<'a, B: Builder> Walk<'a, '_, B> {
    fn message(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array (EngineCoreOutputs)")?;
        let mut engine_index = 0;
        let mut outputs = None;
        let mut scheduler_stats = None;
        let mut timestamp = 0.0;
        let mut utility_output = None;
        let mut finished_requests = None;
        let mut wave_complete = None;
        let mut start_wave = None;
        if n > 0 {
            engine_index = field!("engine_index", self.r.int())?;
        }
        if n > 1 {
            self.b.begin_outputs(engine_index);
            outputs = Some(field!("outputs", self.outputs())?);
        }
        if n > 2 && !self.r.take_nil() {
            scheduler_stats = Some(field!("scheduler_stats", self.str_dict(false))?);
        }
        if n > 3 {
            timestamp = field!("timestamp", self.r.float())?;
        }
        if n > 4 && !self.r.take_nil() {
            utility_output = Some(field!("utility_output", self.utility_output())?);
        }
        if n > 5 && !self.r.take_nil() {
            finished_requests = Some(field!("finished_requests", self.str_set())?);
        }
        if n > 6 {
            wave_complete = field!("wave_complete", self.opt_int())?;
        }
        if n > 7 {
            start_wave = field!("start_wave", self.opt_int())?;
        }
        self.skip_extra(n, 8)?;
        let outputs = match outputs {
            Some(list) => list,
            None => self.b.list(0)?,
        };
        self.b.message(MessageParts {
            engine_index,
            outputs,
            scheduler_stats,
            timestamp,
            utility_output,
            finished_requests,
            wave_complete,
            start_wave,
        })
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
        if n < 2 {
            return Err(DecodeError::new(ErrorKind::TooShort { min: 2, got: n }));
        }
        let raw_id = field!("request_id", self.r.str_bytes())?;
        let request_id = field!("request_id", self.b.request_id(raw_id))?;
        field!("new_token_ids", self.token_ids())?;

        let mut new_logprobs = None;
        let mut new_prompt_logprobs_tensors = None;
        let mut pooling_output = None;
        let mut finish_reason = None;
        let mut stop_reason = None;
        let mut events = None;
        let mut kv_transfer_params = None;
        let mut trace_headers = None;
        let mut prefill_stats = None;
        let mut routed_experts = None;
        let mut num_nans_in_logits = 0;
        // Fields 2.. are nil in the common case: one byte compare each.
        if n > 2 && !self.r.take_nil() {
            new_logprobs = Some(field!("new_logprobs", self.logprobs(ArrayKind::Ndarray))?);
        }
        if n > 3 && !self.r.take_nil() {
            new_prompt_logprobs_tensors = Some(field!(
                "new_prompt_logprobs_tensors",
                self.logprobs(ArrayKind::Tensor)
            )?);
        }
        if n > 4 && !self.r.take_nil() {
            pooling_output = Some(field!("pooling_output", self.array(ArrayKind::Tensor))?);
        }
        if n > 5 && !self.r.take_nil() {
            finish_reason = Some(field!("finish_reason", self.finish_reason())?);
        }
        if n > 6 && !self.r.take_nil() {
            stop_reason = Some(field!("stop_reason", self.stop_reason())?);
        }
        if n > 7 && !self.r.take_nil() {
            events = Some(field!("events", self.events())?);
        }
        if n > 8 && !self.r.take_nil() {
            kv_transfer_params = Some(field!("kv_transfer_params", self.str_dict(false))?);
        }
        if n > 9 && !self.r.take_nil() {
            trace_headers = Some(field!("trace_headers", self.str_dict(true))?);
        }
        if n > 10 && !self.r.take_nil() {
            prefill_stats = Some(field!("prefill_stats", self.str_dict(false))?);
        }
        if n > 11 && !self.r.take_nil() {
            routed_experts = Some(field!("routed_experts", self.array(ArrayKind::Ndarray))?);
        }
        if n > 12 {
            num_nans_in_logits = field!("num_nans_in_logits", self.r.int())?;
        }
        self.skip_extra(n, 13)?;
        self.b.output(OutputParts {
            request_id,
            new_token_ids: &self.scratch.tokens,
            new_logprobs,
            new_prompt_logprobs_tensors,
            pooling_output,
            finish_reason,
            stop_reason,
            events,
            kv_transfer_params,
            trace_headers,
            prefill_stats,
            routed_experts,
            num_nans_in_logits,
        })
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

    #[inline]
    fn opt_int(&mut self) -> DecodeResult<Option<i128>> {
        if self.r.take_nil() {
            return Ok(None);
        }
        self.r.int().map(Some).map_err(|e| match e.kind() {
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

    /// An `EngineCoreEvent`: a map `{"type": int, "timestamp": float}`; other keys are
    /// ignored, a later duplicate wins.
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
            match key {
                b"type" => {
                    let v = self.r.int().map_err(|e| e.at_field("type"))?;
                    match u8::try_from(v) {
                        Ok(k @ 1..=3) => kind = Some(k),
                        _ => {
                            return Err(DecodeError::new(ErrorKind::InvalidEnum {
                                what: "EngineCoreEventType",
                                value: v,
                            })
                            .at_field("type"))
                        }
                    }
                }
                b"timestamp" => {
                    timestamp = Some(self.r.float().map_err(|e| e.at_field("timestamp"))?);
                }
                _ => self.r.skip().map_err(|e| e.at_index(i))?,
            }
        }
        let Some(kind) = kind else {
            return Err(DecodeError::new(ErrorKind::MissingKey { key: "type" }));
        };
        let Some(timestamp) = timestamp else {
            return Err(DecodeError::new(ErrorKind::MissingKey { key: "timestamp" }));
        };
        self.b.event(kind, timestamp)
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

    /// `UtilityOutput`: `[call_id, failure_message, result]` (nil handled by the caller).
    fn utility_output(&mut self) -> DecodeResult<B::Obj> {
        let n = self.r.array_len("array (UtilityOutput) | nil")?;
        if n < 1 {
            return Err(DecodeError::new(ErrorKind::TooShort { min: 1, got: n }));
        }
        let call_id = field!("call_id", self.r.int())?;
        let mut failure_message = None;
        let mut result = None;
        if n > 1 && !self.r.take_nil() {
            let s = field!("failure_message", self.r.str())?;
            failure_message = Some(field!("failure_message", self.b.str(s))?);
        }
        if n > 2 && !self.r.take_nil() {
            result = Some(field!("result", self.utility_result())?);
        }
        self.skip_extra(n, 3)?;
        self.b.utility_output(call_id, failure_message, result)
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
    /// `cu_num_generated_tokens: list[int] | nil`.
    fn logprobs(&mut self, kind: ArrayKind) -> DecodeResult<B::Obj> {
        let what = match kind {
            ArrayKind::Ndarray => "array (LogprobsLists) | nil",
            ArrayKind::Tensor => "array (LogprobsTensors) | nil",
        };
        let n = self.r.array_len(what)?;
        if n < 3 {
            return Err(DecodeError::new(ErrorKind::TooShort { min: 3, got: n }));
        }
        self.b.begin_logprobs(kind);
        let ids = field!("logprob_token_ids", self.array(kind))?;
        let lps = field!("logprobs", self.array(kind))?;
        let ranks = match kind {
            ArrayKind::Ndarray => field!("sampled_token_ranks", self.array(kind))?,
            ArrayKind::Tensor => field!("selected_token_ranks", self.array(kind))?,
        };
        let mut cu = None;
        if n > 3 && !self.r.take_nil() {
            cu = Some(field!("cu_num_generated_tokens", self.int_list())?);
        }
        self.skip_extra(n, 4)?;
        self.b.logprobs(kind, [ids, lps, ranks], cu)
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
