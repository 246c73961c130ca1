//! The wire schema of engine -> front-end messages, as data: one table per struct.
//!
//! Each struct the decoder reads has one field enum, declared once with [`wire_struct!`]:
//! a row per field gives its Rust variant, its Python name, how its value is read
//! ([`FieldType`]) and the doc of the attribute that holds it. The enum's order is the
//! order of the decoded object's slots (its attributes); everything else reads the
//! table: the schema walk ([`super::schema`]), the binding's member tables, repr and
//! `__struct_fields__`, and the test builder ([`super::tree`]).
//!
//! Which field sits at which wire position is a separate, per-version table: a
//! [`Layout`] lists, for each struct, the fields in wire order. A later vLLM that inserts
//! or appends fields is supported by adding its variants to the enum (the attribute set
//! is the union over versions; a field a version lacks takes its default) and a
//! `Layout` of its positions; the walk has no per-version code. The walk is compiled for
//! [`V0_25_1`] (docs/protocol.md §5), [`V0_33_0`] and [`V0_34_0`] (docs/protocol.md
//! "Versions"); a decoder picks one at run time ([`Protocol`]) and runs the walk compiled
//! for it, or reads any other release through a layout made from its field names
//! ([`layout_from_names`]).

use std::ffi::CStr;

use super::error::ArrayKind;

/// How a field's value is read, and what it is when nil or absent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldType {
    /// A request id (str), handed to [`super::schema::Builder::request_id`]. Required.
    RequestId,
    /// `list[int]` of token ids (any msgpack integer). Required.
    TokenIds,
    /// An int, 0 when absent; the sending engine's index, announced to the builder
    /// before the outputs that follow it.
    EngineIndex,
    /// An int, 0 when absent; the walk hands 0 over as no value (`None`) so that a
    /// builder can share one zero object.
    Count,
    /// An int. Required.
    Int,
    /// `int | nil`.
    OptInt,
    /// A float (ints widen), 0.0 when absent.
    Float,
    /// `str | nil`.
    OptStr,
    /// `bool | nil`.
    OptBool,
    /// `list[EngineCoreOutput]`, empty when absent.
    Outputs,
    /// `LogprobsLists` (ndarrays) or `LogprobsTensors` (tensors), or nil.
    Logprobs(ArrayKind),
    /// `[dtype, shape, data]` as an ndarray or tensor. Required.
    Array(ArrayKind),
    /// [`FieldType::Array`] or nil.
    OptArray(ArrayKind),
    /// `FinishReason` (an int 0-4), or nil.
    FinishReason,
    /// `int | str | nil`.
    StopReason,
    /// `list[EngineCoreEvent] | nil`.
    Events,
    /// `dict[str, Any] | nil`.
    AnyDict,
    /// `dict[str, str] | nil`.
    StrDict,
    /// A stats map (`dict[str, Any] | nil`) that the builder may convert
    /// ([`super::schema::Builder::stats`]).
    Stats(StatsKind),
    /// `UtilityOutput | nil`.
    UtilityOutput,
    /// `[type_info, value] | nil`: a utility call's result.
    UtilityResult,
    /// `set[str] | nil` of request ids.
    RequestIdSet,
    /// `list[int] | nil`.
    IntList,
    /// `EngineCoreEventType` (an int 1-3). Required.
    EventType,
    /// `list[str] | nil`.
    StrList,
    /// `SamplingMaskLists | nil` (a struct array, [`MaskField`]).
    SamplingMask,
    /// `RequestError | nil`: a map (`{code, message, retryable}`) that the builder turns
    /// into the caller's object ([`super::schema::Builder::request_error`]).
    RequestError,
}

impl FieldType {
    /// Whether the field must be present (a struct array shorter than its last required
    /// field is malformed).
    pub const fn required(self) -> bool {
        matches!(
            self,
            FieldType::RequestId
                | FieldType::TokenIds
                | FieldType::Int
                | FieldType::EventType
                | FieldType::Array(_)
        )
    }

    /// Whether an absent field defaults to a value other than "no value" (see
    /// [`FieldType::Count`] for 0 in a count).
    pub const fn has_value_default(self) -> bool {
        matches!(
            self,
            FieldType::EngineIndex | FieldType::Float | FieldType::Outputs
        )
    }

    /// Whether nil is a value of the field (read as "no value", its default).
    #[inline]
    pub const fn nullable(self) -> bool {
        !matches!(
            self,
            FieldType::RequestId
                | FieldType::TokenIds
                | FieldType::EngineIndex
                | FieldType::Count
                | FieldType::Int
                | FieldType::Float
                | FieldType::Outputs
                | FieldType::EventType
                | FieldType::Array(_)
        )
    }
}

/// Which stats map a [`FieldType::Stats`] field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsKind {
    Prefill,
    Scheduler,
}

/// One row of a struct's table.
#[derive(Debug)]
pub struct FieldInfo {
    /// The Python attribute (and msgspec field) name.
    pub name: &'static str,
    /// `name` as a C string, for the binding's member tables.
    pub c_name: &'static CStr,
    pub ty: FieldType,
    /// What the attribute holds, for its docstring.
    pub doc: &'static CStr,
}

/// A struct's field enum, made by [`wire_struct!`].
pub trait WireStruct: Copy + Eq + std::fmt::Debug + 'static {
    /// The struct's name in `corewire.protocol`.
    const STRUCT: &'static str;
    /// Every field, in slot order.
    const ALL: &'static [Self];
    /// The table row of this field.
    fn info(self) -> &'static FieldInfo;
    /// This field's slot in a decoded object (its index in [`WireStruct::ALL`]).
    fn slot(self) -> usize;
    /// Whether an absent field of this struct defaults to a value other than "no value"
    /// (0, 0.0, an empty list), which the walk then makes.
    const HAS_VALUE_DEFAULTS: bool;
    /// Bit `slot` set for each [`FieldType::Count`] field.
    const COUNT_MASK: u64;
}

/// `s` (which ends with NUL) as a C string, at compile time.
pub const fn cstr(s: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(s.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("a wire table name or doc holds a NUL byte"),
    }
}

/// Declares a struct's field enum and its table: one row per field,
/// `Variant = python_name: FieldType, "doc";`, in slot order.
macro_rules! wire_struct {
    (
        $(#[$meta:meta])*
        pub enum $enum:ident for $struct:literal {
            $( $variant:ident = $name:ident : $ty:expr, $doc:literal; )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(u8)]
        pub enum $enum {
            $( #[doc = $doc] $variant, )*
        }

        impl $enum {
            /// Number of fields (slots).
            pub const COUNT: usize = [$(stringify!($name)),*].len();
            /// Number of leading fields that are required (slots `0..REQUIRED`).
            pub const REQUIRED: usize = {
                let mut i = 0;
                while i < Self::COUNT && Self::INFO[i].ty.required() {
                    i += 1;
                }
                i
            };
            /// The table: one row per field, by slot.
            pub const INFO: [FieldInfo; Self::COUNT] = [$(
                FieldInfo {
                    name: stringify!($name),
                    c_name: cstr(concat!(stringify!($name), "\0")),
                    ty: $ty,
                    doc: cstr(concat!($doc, "\0")),
                },
            )*];
        }

        impl WireStruct for $enum {
            const STRUCT: &'static str = $struct;
            const COUNT_MASK: u64 = {
                assert!(Self::COUNT <= 64);
                let mut mask = 0;
                let mut i = 0;
                while i < Self::COUNT {
                    if matches!(Self::INFO[i].ty, FieldType::Count) {
                        mask |= 1 << i;
                    }
                    i += 1;
                }
                mask
            };
            const HAS_VALUE_DEFAULTS: bool = {
                let mut any = false;
                let mut i = 0;
                while i < Self::COUNT {
                    any |= Self::INFO[i].ty.has_value_default();
                    i += 1;
                }
                any
            };
            const ALL: &'static [Self] = &[$($enum::$variant),*];
            #[inline(always)]
            fn info(self) -> &'static FieldInfo {
                &Self::INFO[self as usize]
            }
            #[inline(always)]
            fn slot(self) -> usize {
                self as usize
            }
        }
    };
}

wire_struct! {
    /// The fields of `EngineCoreOutputs`: one message from an engine.
    pub enum MessageField for "EngineCoreOutputs" {
        EngineIndex = engine_index: FieldType::EngineIndex,
            "Index of the engine that sent the message.";
        Outputs = outputs: FieldType::Outputs, "A list of EngineCoreOutput.";
        SchedulerStats = scheduler_stats: FieldType::Stats(StatsKind::Scheduler),
            "A dict (or what the decoder's scheduler_stats converter made of it), or None.";
        Timestamp = timestamp: FieldType::Float,
            "The engine's monotonic clock, in seconds (float).";
        UtilityOutput = utility_output: FieldType::UtilityOutput,
            "A corewire.protocol.UtilityOutput, or None.";
        FinishedRequests = finished_requests: FieldType::RequestIdSet,
            "A set of request ids, or None.";
        WaveComplete = wave_complete: FieldType::OptInt, "An int, or None.";
        StartWave = start_wave: FieldType::OptInt, "An int, or None.";
        // vLLM 0.33.0 on (None under 0.25.1):
        WeightVersion = weight_version: FieldType::OptStr,
            "The engine's weight version (str; vLLM 0.33.0 on), or None.";
    }
}

wire_struct! {
    /// The fields of `EngineCoreOutput`: one request's new output. The required fields
    /// come first (the binding relies on it).
    pub enum OutputField for "EngineCoreOutput" {
        RequestId = request_id: FieldType::RequestId,
            "The request id (the same str object every time it decodes).";
        NewTokenIds = new_token_ids: FieldType::TokenIds, "The new token ids (list of int).";
        NewLogprobs = new_logprobs: FieldType::Logprobs(ArrayKind::Ndarray),
            "LogprobsLists of numpy arrays, or None.";
        NewPromptLogprobsTensors = new_prompt_logprobs_tensors:
            FieldType::Logprobs(ArrayKind::Tensor), "LogprobsTensors of torch tensors, or None.";
        PoolingOutput = pooling_output: FieldType::OptArray(ArrayKind::Tensor),
            "A torch tensor, or None.";
        FinishReason = finish_reason: FieldType::FinishReason, "A FinishReason member, or None.";
        StopReason = stop_reason: FieldType::StopReason, "int, str or None.";
        Events = events: FieldType::Events, "A list of EngineCoreEvent, or None.";
        KvTransferParams = kv_transfer_params: FieldType::AnyDict, "A dict, or None.";
        TraceHeaders = trace_headers: FieldType::StrDict, "A dict of str, or None.";
        PrefillStats = prefill_stats: FieldType::Stats(StatsKind::Prefill),
            "A dict (or what the decoder's prefill_stats converter made of it), or None.";
        RoutedExperts = routed_experts: FieldType::OptArray(ArrayKind::Ndarray),
            "A numpy array, or None.";
        NumNansInLogits = num_nans_in_logits: FieldType::Count,
            "Number of NaNs in the logits (int).";
        // vLLM 0.33.0 on (None under 0.25.1):
        EcTransferParams = ec_transfer_params: FieldType::AnyDict,
            "Encoder-cache transfer parameters (a dict; vLLM 0.33.0 on), or None.";
        MmCacheMissHashes = mm_cache_miss_hashes: FieldType::StrList,
            "Multimodal cache keys the engine missed (list of str; vLLM 0.33.0 on), or None.";
        NewSamplingMask = new_sampling_mask: FieldType::SamplingMask,
            "A corewire.wire.layouts.SamplingMaskLists of numpy arrays (vLLM 0.33.0 on), or None.";
        SpecDecodeMetrics = spec_decode_metrics: FieldType::AnyDict,
            "The request's speculative-decoding metrics (a dict of vLLM's RequestSpecDecodeMetrics fields; vLLM 0.33.0 on), or None.";
        PromptTokenIdLogprobs = prompt_token_id_logprobs: FieldType::OptArray(ArrayKind::Tensor),
            "A torch tensor [num_scored_rows, num_token_ids] (vLLM 0.33.0 on), or None.";
        Error = error: FieldType::RequestError,
            "A corewire.wire.layouts.RequestError (code, message, retryable; vLLM 0.33.0 on), or None.";
        // vLLM 0.34.0 on:
        Watermarking = watermarking: FieldType::OptBool,
            "Whether the engine watermarked the request's output (bool; vLLM 0.34.0 on), or None.";
    }
}

wire_struct! {
    /// The fields of `UtilityOutput`: the reply to a utility call.
    pub enum UtilityField for "UtilityOutput" {
        CallId = call_id: FieldType::Int, "The call id of the request.";
        FailureMessage = failure_message: FieldType::OptStr, "Why the call failed, or None.";
        Result = result: FieldType::UtilityResult, "A UtilityResult, or None.";
    }
}

wire_struct! {
    /// The fields of `LogprobsLists` (sample logprobs, numpy arrays).
    pub enum ListsField for "LogprobsLists" {
        LogprobTokenIds = logprob_token_ids: FieldType::Array(ArrayKind::Ndarray),
            "Token ids of the logprobs.";
        Logprobs = logprobs: FieldType::Array(ArrayKind::Ndarray), "The logprobs.";
        SampledTokenRanks = sampled_token_ranks: FieldType::Array(ArrayKind::Ndarray),
            "Rank of each sampled token.";
        CuNumGeneratedTokens = cu_num_generated_tokens: FieldType::IntList,
            "Cumulative generated token counts, or None.";
    }
}

wire_struct! {
    /// The fields of `LogprobsTensors` (prompt logprobs, torch tensors).
    pub enum TensorsField for "LogprobsTensors" {
        LogprobTokenIds = logprob_token_ids: FieldType::Array(ArrayKind::Tensor),
            "Token ids of the logprobs.";
        Logprobs = logprobs: FieldType::Array(ArrayKind::Tensor), "The logprobs.";
        SelectedTokenRanks = selected_token_ranks: FieldType::Array(ArrayKind::Tensor),
            "Rank of each selected token.";
        CuNumGeneratedTokens = cu_num_generated_tokens: FieldType::IntList,
            "Cumulative generated token counts, or None.";
        // vLLM 0.33.0 on:
        CuNumGeneratedTokensTensor = cu_num_generated_tokens_tensor:
            FieldType::OptArray(ArrayKind::Tensor),
            "Cumulative generated token counts as a tensor, or None.";
    }
}

wire_struct! {
    /// The fields of `SamplingMaskLists` (vLLM 0.33.0 on; numpy arrays).
    pub enum MaskField for "SamplingMaskLists" {
        TokenIds = token_ids: FieldType::Array(ArrayKind::Ndarray), "The allowed token ids.";
        Offsets = offsets: FieldType::OptArray(ArrayKind::Ndarray),
            "Offsets of each position's ids in token_ids, or None.";
        CuNumGeneratedTokens = cu_num_generated_tokens: FieldType::IntList,
            "Cumulative generated token counts, or None.";
    }
}

wire_struct! {
    /// The keys of an `EngineCoreEvent` map (a map, not an array: read by name).
    pub enum EventField for "EngineCoreEvent" {
        Type = type: FieldType::EventType, "An EngineCoreEventType member.";
        Timestamp = timestamp: FieldType::Float, "When it happened (engine clock, seconds).";
    }
}

/// Most wire positions a struct layout may name (the walk has a step per position).
pub const MAX_FIELDS: usize = 24;

/// One struct's wire positions in one protocol version: `fields[i]` is at position `i`;
/// `None` is a position this build reads past (checked as msgpack, its value dropped):
/// a field of a later version that corewire does not surface (yet).
#[derive(Debug, PartialEq, Eq)]
pub struct StructLayout<F: 'static> {
    pub fields: &'static [Option<F>],
    /// Shortest valid array: one past the last required field.
    pub min_len: usize,
}

impl<F> StructLayout<F> {
    /// The layout of `fields` (wire order), whose types say which are `required`.
    pub const fn new(fields: &'static [Option<F>], required: &[bool]) -> Self {
        assert!(
            fields.len() <= MAX_FIELDS,
            "a struct layout longer than MAX_FIELDS"
        );
        assert!(fields.len() == required.len());
        let mut min_len = 0;
        let mut i = 0;
        while i < required.len() {
            if required[i] {
                min_len = i + 1;
            }
            i += 1;
        }
        StructLayout { fields, min_len }
    }
}

/// Builds a [`StructLayout`] from its fields in wire order (`Skip`: a position read
/// past).
macro_rules! layout {
    ($enum:ident [$($variant:ident),* $(,)?]) => {
        StructLayout::new(
            &[$(layout!(@field $enum $variant)),*],
            &[$(layout!(@required $enum $variant)),*],
        )
    };
    (@field $enum:ident Skip) => { None };
    (@field $enum:ident $variant:ident) => { Some($enum::$variant) };
    (@required $enum:ident Skip) => { false };
    (@required $enum:ident $variant:ident) => {
        $enum::INFO[$enum::$variant as usize].ty.required()
    };
}
#[cfg(test)]
pub(crate) use layout;

/// The wire positions of every struct in one protocol version.
#[derive(Debug, PartialEq, Eq)]
pub struct Layout {
    /// The vLLM version whose wire this is.
    pub version: &'static str,
    pub message: StructLayout<MessageField>,
    pub output: StructLayout<OutputField>,
    pub utility_output: StructLayout<UtilityField>,
    pub logprobs_lists: StructLayout<ListsField>,
    pub logprobs_tensors: StructLayout<TensorsField>,
    /// `None` in a version without the struct (no position of its layout reads one).
    pub sampling_mask: Option<StructLayout<MaskField>>,
}

/// A protocol version the schema walk is compiled for: its [`Layout`] as a constant, so
/// the field and type at each wire position are known at compile time.
pub trait Version {
    const LAYOUT: &'static Layout;
}

/// vLLM 0.25.1's wire.
#[allow(non_camel_case_types)]
pub enum V0_25_1 {}

impl Version for V0_25_1 {
    const LAYOUT: &'static Layout = &LAYOUT_0_25_1;
}

/// vLLM 0.33.0's wire.
#[allow(non_camel_case_types)]
pub enum V0_33_0 {}

impl Version for V0_33_0 {
    const LAYOUT: &'static Layout = &LAYOUT_0_33_0;
}

/// vLLM 0.34.0's wire.
#[allow(non_camel_case_types)]
pub enum V0_34_0 {}

impl Version for V0_34_0 {
    const LAYOUT: &'static Layout = &LAYOUT_0_34_0;
}

/// The version a decoder speaks unless told otherwise.
pub type Current = V0_25_1;

/// Where a walk finds its layout: a compiled version's constant ([`Compiled`], a value of
/// no size whose positions fold into the walk's code) or a layout made at run time
/// ([`Runtime`], read position by position).
pub trait LayoutSource: Copy {
    fn get(self) -> &'static Layout;
}

/// The layout of compiled version `V`.
pub struct Compiled<V>(std::marker::PhantomData<fn() -> V>);

impl<V> Compiled<V> {
    pub const fn new() -> Self {
        Compiled(std::marker::PhantomData)
    }
}

impl<V> Default for Compiled<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> Clone for Compiled<V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Compiled<V> {}

impl<V: Version> LayoutSource for Compiled<V> {
    #[inline(always)]
    fn get(self) -> &'static Layout {
        V::LAYOUT
    }
}

/// A layout made at run time.
#[derive(Clone, Copy, Debug)]
pub struct Runtime(pub &'static Layout);

impl LayoutSource for Runtime {
    #[inline(always)]
    fn get(self) -> &'static Layout {
        self.0
    }
}

/// vLLM 0.25.1's wire (docs/protocol.md §5).
pub const LAYOUT_0_25_1: Layout = Layout {
    version: "0.25.1",
    message: layout!(MessageField[
        EngineIndex, Outputs, SchedulerStats, Timestamp, UtilityOutput, FinishedRequests,
        WaveComplete, StartWave,
    ]),
    output: layout!(OutputField[
        RequestId, NewTokenIds, NewLogprobs, NewPromptLogprobsTensors, PoolingOutput,
        FinishReason, StopReason, Events, KvTransferParams, TraceHeaders, PrefillStats,
        RoutedExperts, NumNansInLogits,
    ]),
    utility_output: layout!(UtilityField[CallId, FailureMessage, Result]),
    logprobs_lists: layout!(ListsField[
        LogprobTokenIds, Logprobs, SampledTokenRanks, CuNumGeneratedTokens,
    ]),
    logprobs_tensors: layout!(TensorsField[
        LogprobTokenIds, Logprobs, SelectedTokenRanks, CuNumGeneratedTokens,
    ]),
    sampling_mask: None,
};

/// vLLM 0.33.0's wire (docs/protocol.md "Versions", docs/vllm-0.33.0-notes.md §2):
/// `ec_transfer_params` inserted at 9 of `EngineCoreOutput`, five output fields,
/// `weight_version` and a fifth `LogprobsTensors` element appended.
pub const LAYOUT_0_33_0: Layout = Layout {
    version: "0.33.0",
    message: layout!(MessageField[
        EngineIndex, Outputs, SchedulerStats, Timestamp, UtilityOutput, FinishedRequests,
        WaveComplete, StartWave, WeightVersion,
    ]),
    output: layout!(OutputField[
        RequestId, NewTokenIds, NewLogprobs, NewPromptLogprobsTensors, PoolingOutput,
        FinishReason, StopReason, Events, KvTransferParams, EcTransferParams, TraceHeaders,
        PrefillStats, RoutedExperts, NumNansInLogits, MmCacheMissHashes, NewSamplingMask,
        SpecDecodeMetrics, PromptTokenIdLogprobs, Error,
    ]),
    utility_output: layout!(UtilityField[CallId, FailureMessage, Result]),
    logprobs_lists: layout!(ListsField[
        LogprobTokenIds, Logprobs, SampledTokenRanks, CuNumGeneratedTokens,
    ]),
    logprobs_tensors: layout!(TensorsField[
        LogprobTokenIds, Logprobs, SelectedTokenRanks, CuNumGeneratedTokens,
        CuNumGeneratedTokensTensor,
    ]),
    sampling_mask: Some(layout!(MaskField[TokenIds, Offsets, CuNumGeneratedTokens])),
};

/// vLLM 0.34.0's wire: 0.33.0's with `watermarking` appended to `EngineCoreOutput`.
/// Compiled, although a layout made at run time reads it too (`layout_from_names`),
/// because it is the newest release: the compiled walk is about a quarter faster.
pub const LAYOUT_0_34_0: Layout = Layout {
    version: "0.34.0",
    output: layout!(OutputField[
        RequestId, NewTokenIds, NewLogprobs, NewPromptLogprobsTensors, PoolingOutput,
        FinishReason, StopReason, Events, KvTransferParams, EcTransferParams, TraceHeaders,
        PrefillStats, RoutedExperts, NumNansInLogits, MmCacheMissHashes, NewSamplingMask,
        SpecDecodeMetrics, PromptTokenIdLogprobs, Error, Watermarking,
    ]),
    ..LAYOUT_0_33_0
};

/// A protocol version chosen at run time (a decoder's `protocol=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    V0_25_1,
    V0_33_0,
    V0_34_0,
}

impl Protocol {
    /// Every version with a compiled walk, oldest first.
    pub const ALL: [Protocol; 3] = [Protocol::V0_25_1, Protocol::V0_33_0, Protocol::V0_34_0];
    /// The version `corewire.protocol`'s structs declare: the core's default table
    /// (the Python decoder's own default is `corewire.releases.DEFAULT`).
    pub const DEFAULT: Protocol = Protocol::V0_25_1;

    /// This version's wire positions.
    pub const fn layout(self) -> &'static Layout {
        match self {
            Protocol::V0_25_1 => V0_25_1::LAYOUT,
            Protocol::V0_33_0 => V0_33_0::LAYOUT,
            Protocol::V0_34_0 => V0_34_0::LAYOUT,
        }
    }

    /// The vLLM version string (`"0.25.1"`).
    pub const fn name(self) -> &'static str {
        self.layout().version
    }

    /// The version named `name` exactly, if supported.
    pub fn from_name(name: &str) -> Option<Protocol> {
        Protocol::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// The layout the decoder speaks by default.
pub const CURRENT: &Layout = Current::LAYOUT;

/// How [`wire_fields`] names a position read past.
pub const SKIPPED: &str = "<skipped>";

/// The field names of `name` (a `corewire.protocol` struct) in `layout`'s wire order
/// (the keys, for the map-encoded `EngineCoreEvent`), or `None` for a struct without a
/// table.
pub fn wire_fields(layout: &Layout, name: &str) -> Option<Vec<&'static str>> {
    fn names<F: WireStruct>(l: &StructLayout<F>) -> Vec<&'static str> {
        l.fields
            .iter()
            .map(|f| f.map_or(SKIPPED, |f| f.info().name))
            .collect()
    }
    Some(match name {
        MessageField::STRUCT => names(&layout.message),
        OutputField::STRUCT => names(&layout.output),
        UtilityField::STRUCT => names(&layout.utility_output),
        ListsField::STRUCT => names(&layout.logprobs_lists),
        TensorsField::STRUCT => names(&layout.logprobs_tensors),
        MaskField::STRUCT => names(layout.sampling_mask.as_ref()?),
        EventField::STRUCT => EventField::ALL.iter().map(|f| f.info().name).collect(),
        _ => return None,
    })
}

/// The structs [`wire_fields`] may know (each layout has a table for those it has).
pub const STRUCTS: [&str; 7] = [
    MessageField::STRUCT,
    OutputField::STRUCT,
    UtilityField::STRUCT,
    ListsField::STRUCT,
    TensorsField::STRUCT,
    MaskField::STRUCT,
    EventField::STRUCT,
];

/// The structs `layout` has a table for.
pub fn structs(layout: &Layout) -> Vec<&'static str> {
    STRUCTS
        .into_iter()
        .filter(|name| wire_fields(layout, name).is_some())
        .collect()
}

/// The layout a decoder walks: one compiled into this build (its positions are constants
/// the walk folds into straight-line code), or one made at run time from field names
/// ([`layout_from_names`]), which the same walk reads position by position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutRef {
    Builtin(Protocol),
    Dynamic(&'static Layout),
}

impl LayoutRef {
    /// The positions themselves.
    pub fn layout(self) -> &'static Layout {
        match self {
            LayoutRef::Builtin(p) => p.layout(),
            LayoutRef::Dynamic(l) => l,
        }
    }
}

/// Why field names do not make a layout this build can walk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// A field the decoder has no table row for (it could not surface its value).
    UnknownField {
        strukt: &'static str,
        name: String,
        position: usize,
    },
    /// A field named twice.
    Duplicate { strukt: &'static str, name: String },
    /// More positions than the walk has steps for.
    TooLong { strukt: &'static str, len: usize },
    /// A field the decoder requires that the layout lacks.
    MissingRequired {
        strukt: &'static str,
        name: &'static str,
    },
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutError::UnknownField {
                strukt,
                name,
                position,
            } => write!(
                f,
                "{strukt} field {name:?} (position {position}) is not one the native decoder reads"
            ),
            LayoutError::Duplicate { strukt, name } => {
                write!(f, "{strukt} names field {name:?} twice")
            }
            LayoutError::TooLong { strukt, len } => write!(
                f,
                "{strukt} has {len} fields; the native decoder reads at most {MAX_FIELDS}"
            ),
            LayoutError::MissingRequired { strukt, name } => {
                write!(f, "{strukt} lacks the required field {name:?}")
            }
        }
    }
}

impl std::error::Error for LayoutError {}

/// Field names in wire order for each struct a layout has (see [`layout_from_names`]).
#[derive(Clone, Copy, Debug)]
pub struct LayoutNames<'a> {
    pub message: &'a [&'a str],
    pub output: &'a [&'a str],
    pub utility_output: &'a [&'a str],
    pub logprobs_lists: &'a [&'a str],
    pub logprobs_tensors: &'a [&'a str],
    /// `None` for a version without `SamplingMaskLists`.
    pub sampling_mask: Option<&'a [&'a str]>,
}

/// A struct's positions before they are kept ([`StructLayout`] holds a `'static` slice,
/// which is only made for a layout not seen before).
#[derive(Debug)]
struct Positions<F: 'static> {
    fields: Vec<Option<F>>,
    min_len: usize,
}

impl<F: WireStruct> Positions<F> {
    fn matches(&self, layout: &StructLayout<F>) -> bool {
        self.min_len == layout.min_len && self.fields == layout.fields
    }

    fn keep(self) -> StructLayout<F> {
        StructLayout {
            fields: Box::leak(self.fields.into_boxed_slice()),
            min_len: self.min_len,
        }
    }
}

fn positions<F: WireStruct>(names: &[&str]) -> Result<Positions<F>, LayoutError> {
    if names.len() > MAX_FIELDS {
        return Err(LayoutError::TooLong {
            strukt: F::STRUCT,
            len: names.len(),
        });
    }
    let mut fields = Vec::with_capacity(names.len());
    let mut min_len = 0;
    for (position, name) in names.iter().enumerate() {
        let Some(&field) = F::ALL.iter().find(|f| f.info().name == *name) else {
            return Err(LayoutError::UnknownField {
                strukt: F::STRUCT,
                name: (*name).to_owned(),
                position,
            });
        };
        if fields.contains(&Some(field)) {
            return Err(LayoutError::Duplicate {
                strukt: F::STRUCT,
                name: (*name).to_owned(),
            });
        }
        fields.push(Some(field));
        if field.info().ty.required() {
            min_len = position + 1;
        }
    }
    // The builder relies on every required field having a position (request id and
    // token ids of an output, a call id, the arrays of logprobs).
    for &field in F::ALL {
        if field.info().ty.required() && !fields.contains(&Some(field)) {
            return Err(LayoutError::MissingRequired {
                strukt: F::STRUCT,
                name: field.info().name,
            });
        }
    }
    Ok(Positions { fields, min_len })
}

/// Layouts made at run time, kept for the life of the process: a layout is made once per
/// distinct set of positions however many decoders ask for it, so what is kept is bounded
/// by the releases a process speaks.
static DYNAMIC_LAYOUTS: std::sync::Mutex<Vec<&'static Layout>> = std::sync::Mutex::new(Vec::new());

/// The layout whose structs have `names`' fields in `names`' order (the wire order of the
/// release named `version`), derived from that release's own struct declarations rather
/// than from a table of this build: one compiled into this build when its positions are
/// the same (the version name aside), else one made now (or earlier, for the same
/// positions).
///
/// Every name must be a field the decoder has a table row for (it could not hand the
/// value of any other to its caller), and every required field must have a position.
pub fn layout_from_names(version: &str, names: LayoutNames<'_>) -> Result<LayoutRef, LayoutError> {
    let message = positions::<MessageField>(names.message)?;
    let output = positions::<OutputField>(names.output)?;
    let utility_output = positions::<UtilityField>(names.utility_output)?;
    let logprobs_lists = positions::<ListsField>(names.logprobs_lists)?;
    let logprobs_tensors = positions::<TensorsField>(names.logprobs_tensors)?;
    let sampling_mask = match names.sampling_mask {
        Some(mask) => Some(positions::<MaskField>(mask)?),
        None => None,
    };
    let same = |l: &Layout| {
        message.matches(&l.message)
            && output.matches(&l.output)
            && utility_output.matches(&l.utility_output)
            && logprobs_lists.matches(&l.logprobs_lists)
            && logprobs_tensors.matches(&l.logprobs_tensors)
            && match (&sampling_mask, &l.sampling_mask) {
                (None, None) => true,
                (Some(a), Some(b)) => a.matches(b),
                _ => false,
            }
    };
    if let Some(p) = Protocol::ALL.into_iter().find(|p| same(p.layout())) {
        return Ok(LayoutRef::Builtin(p));
    }
    let mut known = DYNAMIC_LAYOUTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&l) = known.iter().find(|l| same(l)) {
        return Ok(LayoutRef::Dynamic(l));
    }
    let layout: &'static Layout = Box::leak(Box::new(Layout {
        version: Box::leak(version.to_owned().into_boxed_str()),
        message: message.keep(),
        output: output.keep(),
        utility_output: utility_output.keep(),
        logprobs_lists: logprobs_lists.keep(),
        logprobs_tensors: logprobs_tensors.keep(),
        sampling_mask: sampling_mask.map(Positions::keep),
    }));
    known.push(layout);
    Ok(LayoutRef::Dynamic(layout))
}

impl From<Protocol> for LayoutRef {
    fn from(p: Protocol) -> Self {
        LayoutRef::Builtin(p)
    }
}
