"""Type stub of the Rust extension ``corewire._native`` (hand-written, checked by stubtest).

Public names are re-exported from ``corewire`` and ``corewire.codec``; import them there.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeAlias, final

import numpy as np

from corewire.protocol import (
    EngineCoreEvent,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    UtilityOutput,
)
from corewire.wire.layouts import RequestError, SamplingMaskLists

__all__ = [
    "TOKENIZERS_VERSION",
    "CallRegistry",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "FrameBuffer",
    "NativeDecoder",
    "OutputCore",
    "ProtocolError",
    "RequestText",
    "Router",
    "SendTracker",
    "fold_observations",
    "wire_fields",
    "wire_structs",
    "wire_version",
    "wire_versions",
]

# --------------------------------------------------------------------------- decoder

#: A frame: ``bytes``, ``bytearray``, ``memoryview``, ``zmq.Frame`` or any object with
#: the buffer protocol (or a ``.buffer`` attribute that has it).
_Frame: TypeAlias = bytes | bytearray | memoryview | Any

class ProtocolError(ValueError):
    """A frame that does not follow the engine-core wire protocol."""

@final
class NativeDecoder:
    """Decodes ``EngineCoreOutputs`` frames (``[payload, aux_1, ...]``) into Python objects.

    Arrays and tensors are zero-copy views of the frames and keep them alive; request ids
    are interned (bounded by ``intern_capacity``); malformed frames raise
    :class:`ProtocolError`. One decoder serves one receiving thread; it is not re-entrant.

    ``prefill_stats`` and ``scheduler_stats``, when given, are called with each decoded
    stats map and their result takes its place (vLLM's front-end reads stats by attribute);
    an exception they raise rejects the frame as a :class:`ProtocolError`.

    ``release`` is the vLLM release whose wire the frames follow (``protocol``: its
    deprecated name, which warns): any release of
    ``corewire.releases`` (default: ``corewire.releases.DEFAULT``, the installed vLLM's
    release, else the newest). ``layout`` maps each struct's name
    (``EngineCoreOutputs``, ``EngineCoreOutput``, ``UtilityOutput``, ``LogprobsLists``,
    ``LogprobsTensors``, and ``SamplingMaskLists`` where the release has it) to its field
    names in wire order, as the release's own structs give them: any release whose fields
    the decoder knows is then read (a field it does not know raises ``ValueError``), by a
    compiled walk where the positions are one of its own. Without ``layout`` the release
    is laid out as ``corewire.releases`` has it (an unknown one raises
    ``corewire.releases.UnsupportedProtocolError``). The decoded objects
    carry every version's fields (one the version lacks is None, or 0 for a count).
    """

    def __new__(
        cls,
        intern_capacity: int = 16384,
        *,
        prefill_stats: Callable[[dict[str, Any]], Any] | None = None,
        scheduler_stats: Callable[[dict[str, Any]], Any] | None = None,
        release: str | None = None,
        layout: Mapping[str, Sequence[str] | None] | None = None,
        protocol: str | None = None,
    ) -> NativeDecoder: ...
    def decode(self, frames: Sequence[_Frame] | _Frame) -> EngineCoreOutputs:
        """Decodes one message; a single buffer is taken as the payload alone."""
    @property
    def interned(self) -> int:
        """Number of request ids held by the intern cache now."""
    @property
    def intern_capacity(self) -> int:
        """Most request ids the intern cache holds."""
    @property
    def release(self) -> str:
        """The vLLM release whose wire this decoder reads."""
    @property
    def protocol(self) -> str:
        """Deprecated name of :attr:`release`."""
    @property
    def compiled_layout(self) -> bool:
        """Whether the walk is one compiled into this build for these positions."""

@final
class EngineCoreOutputs:
    """One message from an engine: the fields of ``corewire.protocol.EngineCoreOutputs``."""

    __struct_fields__: ClassVar[tuple[str, ...]]
    @property
    def engine_index(self) -> int: ...
    @property
    def outputs(self) -> list[EngineCoreOutput]: ...
    @property
    def scheduler_stats(self) -> Any: ...
    @property
    def timestamp(self) -> float: ...
    @property
    def utility_output(self) -> UtilityOutput | None: ...
    @property
    def finished_requests(self) -> set[str] | None: ...
    @property
    def wave_complete(self) -> int | None: ...
    @property
    def start_wave(self) -> int | None: ...
    @property
    def weight_version(self) -> str | None:
        """vLLM 0.33.0 on; None under 0.25.1."""

@final
class EngineCoreOutput:
    """One request's new output: the fields of ``corewire.protocol.EngineCoreOutput``."""

    __struct_fields__: ClassVar[tuple[str, ...]]
    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> list[int]: ...
    @property
    def new_logprobs(self) -> LogprobsLists | None: ...
    @property
    def new_prompt_logprobs_tensors(self) -> LogprobsTensors | None: ...
    @property
    def pooling_output(self) -> Any: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...
    @property
    def stop_reason(self) -> int | str | None: ...
    @property
    def events(self) -> list[EngineCoreEvent] | None: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def trace_headers(self) -> dict[str, str] | None: ...
    @property
    def prefill_stats(self) -> Any: ...
    @property
    def routed_experts(self) -> np.ndarray | None: ...
    @property
    def num_nans_in_logits(self) -> int: ...
    # vLLM 0.33.0 on (None under 0.25.1):
    @property
    def ec_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def mm_cache_miss_hashes(self) -> list[str] | None: ...
    @property
    def new_sampling_mask(self) -> SamplingMaskLists | None: ...
    @property
    def spec_decode_metrics(self) -> dict[str, Any] | None: ...
    @property
    def prompt_token_id_logprobs(self) -> Any: ...
    @property
    def error(self) -> RequestError | None: ...
    # vLLM 0.34.0 on (None before):
    @property
    def watermarking(self) -> bool | None: ...
    @property
    def finished(self) -> bool:
        """Whether this is the request's last output (``finish_reason is not None``)."""

def fold_observations(
    values: list[float], sum: float, bounds: list[float]
) -> tuple[float, list[int]]:
    """What observing each of ``values`` in order with ``prometheus_client``'s
    ``Histogram.observe`` does to a histogram whose sum is ``sum`` and whose buckets have
    the upper bounds ``bounds``: the new sum (the same additions in order, so the same
    bits) and how many values each bucket gained. ``TypeError`` for a value that is not a
    number, with nothing computed.
    """

def wire_fields(name: str, protocol: str | None = None) -> tuple[str, ...]:
    """The field names of struct ``name`` in the wire order the decoder reads for
    ``protocol`` (default: 0.25.1, whose wire ``corewire.protocol`` declares; the map
    keys of ``EngineCoreEvent``).

    Raises ``KeyError`` for a struct the decoder has no table for in that version;
    ``wire_structs(protocol)`` names those it has.
    """

def wire_structs(protocol: str | None = None) -> tuple[str, ...]:
    """The names of the structs ``wire_fields`` knows for ``protocol``."""

def wire_version() -> str:
    """The vLLM version whose wire ``corewire.protocol``'s structs declare (the decoder's
    first compiled walk; a decoder's own default is ``corewire.releases.DEFAULT``)."""

def wire_versions() -> tuple[str, ...]:
    """Every vLLM version the decoder has a compiled walk for, oldest first (it reads the
    other releases through ``layout``)."""

@final
class FrameBuffer:
    """Keeps a received frame alive for the arrays that view it (their ``.base``)."""

    def __len__(self) -> int: ...
    @property
    def obj(self) -> Any:
        """The object whose memory this is (a ``zmq.Frame``, ``memoryview`` ...)."""

# --------------------------------------------------------------------------- registry, tracker (H4)

@final
class CallRegistry:
    """Maps the call id of each utility call in flight to the future its caller awaits.

    Ids are unsigned 64-bit integers from a random start (ids above 2**63 are normal). A
    reply whose id is unknown gets ``None`` from :meth:`pop` and changes nothing.
    """

    def __new__(cls, start: int | None = None) -> CallRegistry: ...
    def register(self, future: Any) -> int:
        """Stores ``future`` under a fresh call id and returns the id; raises
        ``EngineDeadError`` once :meth:`drain` has closed the registry."""
    def pop(self, call_id: object) -> Any | None:
        """Removes and returns the future of ``call_id``; ``None`` when it is not pending."""
    def discard(self, call_id: object) -> bool:
        """Forgets ``call_id`` (its caller gave up); returns whether it was pending."""
    def drain(self, *, close: bool = False) -> list[Any]:
        """Removes and returns every pending future; ``close`` refuses later calls."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`drain` closed the registry."""
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...

@final
class SendTracker:
    """Keeps the objects behind zero-copy frames alive until ZeroMQ has sent them."""

    def __new__(cls) -> SendTracker: ...
    def track(self, tracker: Any, objects: Any) -> None:
        """Keeps ``objects`` alive until ``tracker.done``; first releases finished sends."""
    def reap(self) -> int:
        """Releases the oldest sends that ZeroMQ has finished; returns how many."""
    def clear(self) -> int:
        """Forgets every entry; returns how many there were."""
    def __len__(self) -> int: ...

# ----------------------------------------------------------------------- end registry, tracker (H4)

# --------------------------------------------------------------------------- router (H5)

@final
class Router:
    """Chooses the engine for each request of a data-parallel front-end.

    Load per engine is ``max(waiting + running + clients * sent_since_update,
    clients * in_flight)``: the coordinator's last counts plus what this client sent
    since, floored by this client's requests in flight, this client's counts scaled by
    the number of front-ends routing over the same engines (``client_count``, vLLM's API
    servers). The least loaded engine wins; ties go to fewer waiting requests, then to a
    start position that rotates on every decision and begins at this client's share of
    the engines (``num_engines * client_index // client_count``).
    """

    def __new__(cls, num_engines: int, client_index: int = 0, client_count: int = 1) -> Router: ...
    @property
    def num_engines(self) -> int:
        """Number of engines routed over."""
    @property
    def client_count(self) -> int:
        """Front-ends routing over the same engines."""
    def choose(self) -> int:
        """The least-loaded engine index; notes one request sent to it."""
    def route(self, rank: int | None) -> int:
        """``rank`` when not None (checked), else ``choose()``; notes one request sent."""
    def note_sent(self, engine: int, count: int = 1) -> None:
        """Notes ``count`` requests sent to ``engine`` without a routing decision."""
    def note_finished(self, engine: int, count: int = 1) -> None:
        """Notes ``count`` of this client's requests on ``engine`` finished."""
    def update_counts(self, counts: Sequence[Sequence[int]]) -> None:
        """Replaces the coordinator's counts: one ``[waiting, running]`` pair per engine."""
    def set_out(self, engine: int, out: bool) -> None:
        """Take ``engine`` out of routing (a lost engine) or put it back (its replacement)."""
    def out_engines(self) -> list[int]:
        """The engines out of routing, in index order."""
    def resize(self, num_engines: int) -> None:
        """Grows (new engines idle) or shrinks (their state dropped) to ``num_engines``."""
    def in_flight(self) -> list[int]:
        """This client's in-flight request count per engine."""
    def loads(self) -> list[int]:
        """The load each routing decision compares, per engine."""
    def counts(self) -> list[tuple[int, int]]:
        """The coordinator's last ``(waiting, running)`` counts per engine."""

# ------------------------------------------------------------------------- end router (H5)

# ----------------------------------------------------------- native output processing

#: The ``tokenizers`` crate release (major.minor) the native output path decodes with.
TOKENIZERS_VERSION: str

@final
class RequestText:
    """One request's text, token ids, sample and prompt logprobs on the native output path; also
    its detokenizer and logprobs processor for vLLM's own loop
    (``corewire.vllm.output.processor``)."""

    def attach_stream(
        self,
        cycle: Any,
        head: bytes,
        mid: bytes,
        tail: bytes,
        logprobs_limit: int | None = None,
        text_offset: int = 0,
        skip_empty: bool = False,
        release_ids: list[int] = ...,
        chat_logprobs: bool = False,
        ids_mid: bytes | None = None,
        usage: tuple[bytes, bytes, int, int] | None = None,
    ) -> None:
        """Puts the request on ``vllm serve``'s fast path: its plain outputs are written to
        ``cycle`` (uvicorn's request-response cycle of its streaming response) as SSE frames
        (``head``, the text's literal, ``mid``, the logprobs object or ``null``, ``tail``),
        not sent to its collector. ``logprobs_limit``: with, and only with, sample
        logprobs, the candidates a chunk shows per position (-1: all); ``text_offset``:
        where the next chunk's first token starts; ``skip_empty``: an output with no new
        text gets no frame (with logprobs it is Python's to render); ``release_ids``: an
        output with one of these token ids is Python's to render; ``chat_logprobs``: the
        logprobs object is a chat chunk's (``content``), not a completions chunk's;
        ``ids_mid``: for chunks that carry their token ids (``return_token_ids``), the
        bytes between the logprobs and the ids, which each frame then writes before
        ``tail`` (an output without text is then Python's to render where ``skip_empty``);
        ``usage``, for chunks that carry their running usage (``continuous_usage_stats``):
        the bytes before its total and before its completion tokens, the prompt's tokens
        and the sample's output tokens so far, both counts then written after the
        logprobs or ids.
        ``ValueError`` for a request whose chunks carry more (not ``DELTA``); a request
        with prompt logprobs streams too, an output that carries them going to Python
        with the stream released first; one of n > 1 samples streams its own choice."""
    def detach_stream(self, flush: bool = False) -> None:
        """Takes the request off the fast path: what waits written first with ``flush``,
        dropped without (its response is over)."""
    @property
    def stream_attached(self) -> bool:
        """Whether the request's plain outputs go to its connection."""
    @property
    def streamed_tokens(self) -> int:
        """The output token ids carried by the fast path's frames, over the request's life."""
    @property
    def stream_text_offset(self) -> int:
        """Where the next chunk's first token starts in the stream's text (completions
        logprobs' ``text_offset``), shared by the fast path's chunks and Python's."""
    @stream_text_offset.setter
    def stream_text_offset(self, offset: int) -> None: ...
    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Takes new token ids; returns the stop string that ended the text, if any."""
    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The next output's text: all of it, or with ``delta`` what is new; the stop
        strings' hold-back kept back while unfinished."""
    @property
    def output_token_ids(self) -> list[int]:
        """Every output token id so far (the same list each time)."""
    def num_output_tokens(self) -> int:
        """How many output token ids so far."""
    @property
    def output_text(self) -> str:
        """The output text so far."""
    def update_from_output(self, output: Any) -> None:
        """Takes an output's sample logprobs (``new_logprobs``), then its prompt logprobs
        (``new_prompt_logprobs_tensors``) and (0.34.0) fixed-id prompt scores."""
    @property
    def logprobs(self) -> list[dict[int, Any]] | None:
        """Sample logprobs so far (vLLM's ``Logprob`` objects), or None."""
    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs, or None without logprobs."""
    @property
    def prompt_logprobs(self) -> Any | None:
        """The prompt logprobs not handed out yet (vLLM's container: a list of position
        dicts or a ``FlatLogprobs``), or None when the request asked for none."""
    def pop_prompt_logprobs(self) -> Any | None:
        """The prompt logprobs not handed out yet, forgotten once they have positions
        (vLLM's ``pop_prompt_logprobs``); None when the request asked for none."""
    @property
    def prompt_token_id_logprobs(self) -> Any | None:
        """vLLM 0.34.0's fixed-id prompt scores (an ndarray) not handed out yet."""
    def pop_prompt_token_id_logprobs(self) -> Any | None:
        """The fixed-id prompt scores not handed out yet, forgotten."""

@final
class OutputCore:
    """The native half of ``corewire.vllm.output.processor.NativeOutputProcessor``."""

    def __new__(
        cls,
        tokenizer_json: str,
        added: dict[int, str],
        single_string: Any,
        python_decode: Any | None,
        warn: Any,
        classes: tuple[Any, Any, Any, Any],
        request_states: dict[str, Any],
        layouts: tuple[Sequence[str], Sequence[str]],
        slow_fields: Sequence[str],
        earliest_stop: bool = False,
        empty_delta_slice: bool = False,
    ) -> OutputCore: ...
    def request(
        self,
        request_id: str,
        external_req_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        lora_request: Any,
        request_index: int,
        output_kind: int,
        stream_interval: int,
        queue: Any,
        plain_collector: bool,
        stats: Any | None,
        detokenize: bool,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        stop: Sequence[str],
        min_tokens: int,
        include_stop_str_in_output: bool,
        num_logprobs: int | None,
        flat_logprobs: Any | None = None,
        num_prompt_logprobs: int | None = None,
        prompt_logprobs: Any | None = None,
        parent: Any | None = None,
    ) -> RequestText:
        """The native state of a new request."""
    def process(
        self,
        outputs: Sequence[Any],
        timestamp: float | None,
        iteration_stats: Any,
        nans: bool,
        finish: Callable[[str], None],
        weight_version: str | None = None,
    ) -> list[Any]:
        """Handles the plain outputs of native requests; returns the outputs left for
        vLLM's loop. ``finish(req_id)`` is called for a request a stop string finished
        here, right after its output went to its collector."""
    @property
    def byte_table(self) -> bool:
        """Whether decodes go through the per-id byte table."""
    @property
    def counts(self) -> dict[str, int]:
        """Outputs by path: ``fast``, ``slow``, ``fallback``."""
