"""Wire types of the engine-core protocol (vLLM 0.25.1 layout, byte for byte).

Every struct here mirrors one message of ``docs/protocol.md`` (requests §4, outputs §5). Positional
(``array_like``) structs keep vLLM's field order exactly: the index of a field is
part of the wire format, so never reorder, only append.

Array-like structs are encoded with every field, as vLLM's are: vLLM declares some
with ``omit_defaults=True``, but msgspec ignores that option on array-like structs.
Decoders accept shorter arrays (missing trailing fields take their defaults) and
longer ones (unknown trailing fields are ignored).
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Collection
from typing import Any, NamedTuple

import msgspec
import numpy as np


class _TensorType(type):
    """``isinstance(x, Tensor)`` holds for every ``torch.Tensor`` (msgspec checks the
    decoded value against the annotation this way); false for all while torch is not
    imported, since no tensor can exist then."""

    def __instancecheck__(cls, obj: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(obj, torch.Tensor)


class Tensor(metaclass=_TensorType):
    """Stands for ``torch.Tensor`` in the structs' annotations.

    torch is optional, and importing it takes seconds (1.7 s on an idle 2-core machine),
    which every client and every engine process paid at import time, tensors or not.
    msgspec hands a field so annotated to the codec's hooks, which build real
    ``torch.Tensor`` objects, importing torch on the first tensor that arrives. The
    values are always real tensors; this class only names the type.
    """


__all__ = [
    "EEP_NOTIFICATION_CALL_ID",
    "ENGINE_CORE_DEAD",
    "READY_STATUS",
    "REQUEST_ABORT",
    "REQUEST_ADD",
    "REQUEST_START_DP_WAVE",
    "REQUEST_UTILITY",
    "EEPNotificationType",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "FinishReason",
    "LogprobsLists",
    "LogprobsTensors",
    "PoolingParams",
    "SamplingParams",
    "UtilityCall",
    "UtilityOutput",
    "UtilityResult",
    "engine_identity",
    "engine_index_of",
    "failed_method",
    "field_position",
    "finished_outputs",
    "utility_failure_text",
    "utility_result_wire",
]

#: The single frame an engine sends on its output socket before it dies.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class EngineCoreRequestType(enum.Enum):
    """First frame of every front-end -> engine message (one byte)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Engine-internal, never sent on the wire.
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


# The request types' bytes as plain module constants, for the hot paths (one lookup per
# message sent or received): a module global is one dict lookup, where
# ``EngineCoreRequestType.ADD.value`` goes through the enum's metaclass twice.
REQUEST_ADD: bytes = EngineCoreRequestType.ADD.value
REQUEST_ABORT: bytes = EngineCoreRequestType.ABORT.value
REQUEST_START_DP_WAVE: bytes = EngineCoreRequestType.START_DP_WAVE.value
REQUEST_UTILITY: bytes = EngineCoreRequestType.UTILITY.value

#: ``status`` of the ready response an engine sends on its handshake / input socket
#: (docs/protocol.md §3.1, §3.2); the DP coordinator also answers a subscription with these bytes.
READY_STATUS = "READY"


def engine_identity(engine_index: int) -> bytes:
    """An engine's ZeroMQ identity on the front-end's ROUTER: its index as 2 bytes,
    little-endian (docs/protocol.md §2). Raises ``OverflowError`` past 65535."""
    return engine_index.to_bytes(2, "little")


def engine_index_of(identity: bytes) -> int:
    """The engine index an identity from :func:`engine_identity` stands for."""
    return int.from_bytes(identity, "little")


class UtilityCall(NamedTuple):
    """A UTILITY message's payload, in its wire order
    ``[client_index, call_id, method, args]`` (docs/protocol.md §4.6)."""

    client_index: int
    call_id: int
    method: str
    args: Any


# The text of a failed utility call's ``failure_message`` (docs/protocol.md §5.6; vLLM's
# wording, which its front-end shows as is); :func:`failed_method` reads the method back out of it.
_UTILITY_FAILURE_PREFIX = "Call to "
_UTILITY_FAILURE_MIDDLE = " method failed"


def utility_failure_text(method: str, error: object) -> str:
    """The ``failure_message`` of a utility call to ``method`` that failed with ``error``:
    ``Call to <method> method failed: <error>``."""
    return f"{_UTILITY_FAILURE_PREFIX}{method}{_UTILITY_FAILURE_MIDDLE}: {error}"


def failed_method(message: str) -> str | None:
    """The method named by a :func:`utility_failure_text` message (None if the text
    has another form)."""
    prefix, _, rest = message.partition(_UTILITY_FAILURE_PREFIX)
    if prefix or not rest:
        return None
    method, sep, _ = rest.partition(_UTILITY_FAILURE_MIDDLE)
    return method if sep else None


def field_position(struct: type, name: str) -> int:
    """The index of field ``name`` in an array-like struct's wire array (for code that
    reads a payload that did not decode into the struct)."""
    return struct.__struct_fields__.index(name)  # type: ignore[attr-defined]


#: ``call_id`` of an elastic-scaling notification: a UtilityOutput that answers no call,
#: whose result is ``[EEPNotificationType value, engine_rank]``.
EEP_NOTIFICATION_CALL_ID = -1


class EEPNotificationType(str, enum.Enum):
    """Kinds of elastic-scaling notification (the first element of its result)."""

    NEW_CORE_ENGINES_INIT_READY = "NEW_CORE_ENGINES_INIT_READY"
    NEW_CORE_ENGINES_WEIGHTS_INIT_READY = "NEW_CORE_ENGINES_WEIGHTS_INIT_READY"
    #: An engine applied a new DP group size.
    RECONFIGURE_FINISHED = "RECONFIGURE_FINISHED"
    #: An engine removed by a scale-down aborted its requests and is stopping.
    SHUTDOWN_COMPLETE = "SHUTDOWN_COMPLETE"


class FinishReason(enum.IntEnum):
    """Why a request finished; encoded as its integer value."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """Kinds of per-request scheduling events."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


# Sampling defaults shared by the field declarations and ``__post_init__``: msgspec's
# ``omit_defaults`` omits a float only when it IS the default object, so a value reset to
# its default must be that very object to be omitted (as vLLM's are).
_ZERO = 0.0
_ONE = 1.0
# vLLM 0.25.1's thresholds: temperatures under _SAMPLING_EPS mean greedy sampling, and
# positive temperatures under _MIN_TEMPERATURE are raised to it.
_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True, kw_only=True):  # type: ignore[call-arg]
    """Sampling parameters; a msgpack MAP keyed by field name, defaults omitted.

    The fields, their order and their wire names are vLLM 0.25.1's ``SamplingParams``,
    so the map is byte for byte the one vLLM writes. ``__post_init__`` applies vLLM's
    normalisations that change what is written (it runs on decode too, as vLLM's does):
    ``stop``, ``stop_token_ids`` and ``bad_words`` become lists (``[]`` when unset, and
    so always written), ``seed=-1`` and ``thinking_token_budget=-1`` mean unset, greedy
    sampling resets ``top_p``/``top_k``/``min_p``, ``stop_token_ids`` join
    ``all_stop_token_ids``. vLLM's value checks are not repeated here.

    ``eos_token_id``, ``all_stop_token_ids`` and ``bad_words_token_ids`` travel as vLLM's
    private keys ``_eos_token_id``, ``_all_stop_token_ids`` and ``_bad_words_token_ids``;
    a vLLM front-end fills them from the tokenizer and generation config, and vLLM's
    engine stops on ``eos_token_id`` (nil with ``ignore_eos``). Unknown keys sent by newer
    front-ends are ignored on decode.
    """

    n: int = 1
    presence_penalty: float = _ZERO
    frequency_penalty: float = _ZERO
    repetition_penalty: float = _ONE
    temperature: float = _ONE
    top_p: float = _ONE
    top_k: int = 0
    min_p: float = _ZERO
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: vLLM's ``RequestOutputKind``: 0 cumulative, 1 delta, 2 final only.
    output_kind: int = 0
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    eos_token_id: int | None = msgspec.field(default=None, name="_eos_token_id")
    all_stop_token_ids: set[int] = msgspec.field(default_factory=set, name="_all_stop_token_ids")
    #: vLLM's ``StructuredOutputsParams`` (a dataclass: a map of all its fields).
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = msgspec.field(
        default=None, name="_bad_words_token_ids"
    )
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    #: vLLM's ``RepetitionDetectionParams`` (a dataclass: a map of all its fields).
    repetition_detection: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Same order as vLLM 0.25.1's SamplingParams.__post_init__.
        if 0 < self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        if self.temperature < _SAMPLING_EPS:
            self.top_p = _ONE
            self.top_k = 0
            self.min_p = _ZERO
        self.all_stop_token_ids.update(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """Pooling (embedding) parameters; a positional array, as vLLM 0.25.1's.

    Every field is written (msgspec ignores ``omit_defaults`` on array-like structs).
    ``normalize`` is vLLM's ``use_activation`` (position 0; for embeddings it switches
    normalisation); ``output_kind`` defaults to 2, vLLM's ``FINAL_ONLY``.
    """

    normalize: bool | None = msgspec.field(default=None, name="use_activation")
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    #: vLLM's ``LateInteractionParams`` (an array-like struct).
    late_interaction_params: Any = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: int = 2

    @property
    def use_activation(self) -> bool | None:
        """vLLM's name for :attr:`normalize`."""
        return self.normalize


class EngineCoreRequest(msgspec.Struct, array_like=True, kw_only=True, gc=False):  # type: ignore[call-arg]
    """A request to add; mirrors vLLM's ``EngineCoreRequest`` (positional)."""

    request_id: str
    prompt_token_ids: list[int] | None = None
    mm_features: list[Any] | None = None
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    arrival_time: float = 0.0
    lora_request: Any = None
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    prompt_embeds: Tensor | None = None
    prompt_is_token_ids: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: Any = None
    reasoning_parser_kwargs: Any = None
    abort_immediately: bool = False


class EngineCoreEvent(msgspec.Struct, gc=False):  # type: ignore[call-arg]
    """A timestamped scheduling event; a msgpack map ``{"type", "timestamp"}``."""

    type: EngineCoreEventType
    timestamp: float


class LogprobsLists(NamedTuple):
    """Sampled-token logprobs as numpy arrays (a named tuple: an array on the wire)."""

    #: [num_tokens, k + 1] token ids of the top-k plus the sampled token
    logprob_token_ids: np.ndarray
    #: [num_tokens, k + 1] their logprobs
    logprobs: np.ndarray
    #: [num_tokens] rank of the sampled token
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int) -> LogprobsLists:
        """``num_positions`` rows from request ``req_idx``'s first one (row ``req_idx``
        when ``cu_num_generated_tokens`` is None, else the row it names), as views, without
        per-request offsets: vLLM's ``LogprobsLists.slice_request``, which vLLM's output
        processor calls on a decoded output (0.32.0 on, where a stop string drops a step's
        surplus tokens)."""
        offsets = self.cu_num_generated_tokens
        first = req_idx if offsets is None else offsets[req_idx]
        rows = slice(first, first + num_positions)
        return type(self)(
            self.logprob_token_ids[rows], self.logprobs[rows], self.sampled_token_ranks[rows]
        )


class LogprobsTensors(NamedTuple):
    """Prompt logprobs as torch tensors (same layout as :class:`LogprobsLists`)."""

    logprob_token_ids: Tensor
    logprobs: Tensor
    selected_token_ranks: Tensor
    cu_num_generated_tokens: list[int] | None = None


class UtilityResult:
    """Result of a utility call; the value is in ``.result``.

    On the wire it is ``[type_info, value]``; ``type_info`` is nil for plain msgpack
    values. corewire never sends type information (it would need pickle or imports
    named by the peer) and hands any received value back as plain msgpack data.
    """

    __slots__ = ("result",)

    def __init__(self, result: Any = None) -> None:
        self.result = result

    def __repr__(self) -> str:
        return f"UtilityResult({self.result!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UtilityResult) and other.result == self.result

    __hash__ = None  # type: ignore[assignment]


def utility_result_wire(result: UtilityResult) -> list[Any]:
    """A :class:`UtilityResult` as it is written: ``[None, value]``, no type information
    (docs/protocol.md §5.6)."""
    return [None, result.result]


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Reply to a utility call; ``call_id`` -1 marks an elastic-scaling notification."""

    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """New tokens (and more) for one request; mirrors vLLM's ``EngineCoreOutput``."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Tensor | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: dict[str, Any] | None = None
    routed_experts: np.ndarray | None = None
    num_nans_in_logits: int = 0

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """One message on the output link; mirrors vLLM's ``EngineCoreOutputs``."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: dict[str, Any] | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None


def finished_outputs(
    request_ids: Collection[str], reason: FinishReason, *, engine_index: int = 0
) -> EngineCoreOutputs:
    """Outputs a client makes itself for requests no engine will finish (a removed
    engine's leftovers, a frame that broke the protocol): each request finishes with
    ``reason`` and no tokens, stamped now (``time.monotonic()``, the engines' clock) and
    listed in ``finished_requests``, as an engine's abort would be."""
    return EngineCoreOutputs(
        engine_index=engine_index,
        outputs=[EngineCoreOutput(rid, [], finish_reason=reason) for rid in request_ids],
        timestamp=time.monotonic(),
        finished_requests=set(request_ids),
    )
