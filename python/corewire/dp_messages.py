"""The messages of corewire's DP coordinator, each a named type (``docs/protocol.md`` §8.2).

Every message between the coordinator (:mod:`corewire.coordinator`), the DP engines
(:mod:`corewire.engine.dp`) and the DP clients is declared here once, with its encoding
and its checked decoding; nothing else builds or indexes these lists. The named tuples
encode as msgpack arrays, the same bytes as the plain lists the protocol page shows:

=====================  =====================================  ============================
message                on the wire                            direction
=====================  =====================================  ============================
:class:`DPState`       ``[counts, current_wave, running]``    coordinator -> front-ends
:class:`FirstRequest`  ``[engine_index, wave]``               front-end -> coordinator
:class:`ScaleNotice`   ``["scale", new_size]``                front-end -> coordinator
:class:`LostNotice`    ``["lost", engine_index]``             front-end -> coordinator
:class:`EngineReport`  an ``EngineCoreOutputs``               engine -> coordinator
:class:`StartWave`     ``[b"\\x02", [wave, exclude]]``        coordinator -> engines
:class:`WaveComplete`  ``[b"\\x10", [finished_wave]]``        coordinator -> engines
=====================  =====================================  ============================

:class:`StartWave` is also START_DP_WAVE on an engine's request link (§4.7), and what
vLLM's own coordinator publishes to engines (§8.1, where ``exclude`` may be nil).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from corewire.errors import ProtocolError
from corewire.protocol import READY_STATUS, REQUEST_START_DP_WAVE, EngineCoreOutputs

__all__ = [
    "COORDINATOR_READY",
    "WAVE_COMPLETE",
    "XPUB_SUBSCRIBE",
    "XPUB_UNSUBSCRIBE",
    "CoordinatorLinks",
    "DPState",
    "EngineReport",
    "FirstRequest",
    "LostNotice",
    "ScaleNotice",
    "StartWave",
    "WaveComplete",
    "WaveMessage",
    "decode_front_message",
    "decode_wave_message",
]

#: What a subscriber sends an XPUB to subscribe to everything (ZeroMQ's framing; the
#: coordinators' publishers are XPUBs that act on each subscription).
XPUB_SUBSCRIBE = b"\x01"
#: What an XPUB passes on when a subscriber leaves.
XPUB_UNSUBSCRIBE = b"\x00"
#: Type byte of :class:`WaveComplete`: corewire's own, only on the coordinator's wave
#: socket (never on a front-end's request link).
WAVE_COMPLETE = b"\x10"
#: What vLLM's coordinator sends an engine once the whole group subscribed (and again
#: when an engine re-subscribes): the ready status as bytes.
COORDINATOR_READY = READY_STATUS.encode("ascii")
# The tag of a ScaleNotice (vLLM's coordinator uses "SCALE_ELASTIC_EP" instead).
_SCALE_TAG = "scale"
# The tag of a LostNotice.
_LOST_TAG = "lost"

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def _is_int(value: object) -> bool:
    return type(value) is int  # not bool: True is no engine index


class StartWave(NamedTuple):
    """START_DP_WAVE: run wave ``wave``; every engine but ``exclude_engine_index`` (which
    already has a request of that wave; -1 excludes none) starts stepping."""

    wave: int
    exclude_engine_index: int = -1

    def to_frames(self) -> list[bytes]:
        """The message as the coordinator publishes it: ``[type byte, payload]``."""
        return [REQUEST_START_DP_WAVE, _encode(self)]

    @classmethod
    def from_payload(cls, value: object, *, nil_excludes_none: bool = False) -> StartWave:
        """Checks a decoded payload: ``[int, int]`` (later elements are ignored); with
        ``nil_excludes_none`` (vLLM's coordinator) a nil ``exclude`` means -1."""
        if isinstance(value, (list, tuple)) and len(value) >= 2:
            wave, exclude = value[0], value[1]
            if nil_excludes_none and exclude is None:
                exclude = -1
            if _is_int(wave) and _is_int(exclude):
                return cls(wave, exclude)
        nil = "|nil" if nil_excludes_none else ""
        raise ProtocolError(f"START_DP_WAVE payload must be [wave int, exclude int{nil}]")


class WaveComplete(NamedTuple):
    """WAVE_COMPLETE: the coordinator ended wave ``wave``; the engines pause."""

    wave: int

    def to_frames(self) -> list[bytes]:
        """The message as the coordinator publishes it: ``[type byte, payload]``."""
        return [WAVE_COMPLETE, _encode(self)]

    @classmethod
    def from_payload(cls, value: object) -> WaveComplete:
        """Checks a decoded payload: ``[int]`` (later elements are ignored)."""
        if isinstance(value, (list, tuple)) and value and _is_int(value[0]):
            return cls(value[0])
        raise ProtocolError("WAVE_COMPLETE payload must be [finished_wave int]")


#: A message from the coordinator to the engines.
WaveMessage = StartWave | WaveComplete


def decode_wave_message(frames: Sequence[bytes | memoryview]) -> WaveMessage:
    """Decodes what an engine receives on the coordinator's wave socket; raises
    :class:`~corewire.errors.ProtocolError` for anything else."""
    if len(frames) < 2:
        raise ProtocolError(f"a wave message has 2 frames, got {len(frames)}")
    kind = bytes(frames[0])
    try:
        payload = _decode(frames[1])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"wave message payload: {exc}") from exc
    if kind == REQUEST_START_DP_WAVE:
        return StartWave.from_payload(payload)
    if kind == WAVE_COMPLETE:
        return WaveComplete.from_payload(payload)
    raise ProtocolError(f"unknown wave message type {kind[:8]!r}")


class DPState(NamedTuple):
    """The coordinator's publication to the front-ends: one ``[waiting, running]`` pair
    per engine in rank order (vLLM 0.33.0: ``[waiting, running, kv_cache_usage]``, the
    third a float), the current wave, and whether it runs."""

    #: nil only from vLLM's coordinator, when only the wave state changed.
    counts: list[list[int | float]] | None
    current_wave: int
    engines_running: bool

    def encode(self) -> bytes:
        """The publication's single frame."""
        return _encode(self)

    @classmethod
    def decode(cls, frame: bytes | memoryview) -> DPState:
        """Decodes and checks a publication."""
        try:
            return _decode(frame, type=DPState)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"DP coordinator publication: {exc}") from exc


class FirstRequest(NamedTuple):
    """A front-end put a request on ``engine_index`` while it saw the engines paused at
    ``wave``: the coordinator wakes the others."""

    engine_index: int
    wave: int

    def encode(self) -> bytes:
        """The notice's single frame."""
        return _encode(self)


class ScaleNotice(NamedTuple):
    """A front-end resized the group to ``new_size`` engines (elastic scaling)."""

    new_size: int

    def encode(self) -> bytes:
        """The notice's single frame: ``["scale", new_size]``."""
        return _encode([_SCALE_TAG, self.new_size])


class LostNotice(NamedTuple):
    """A front-end lost engine ``engine_index`` (its process died; the group serves on):
    its last counts no longer stand, so the coordinator counts it idle until it reports
    again (a replacement). corewire's coordinator only: vLLM's has no such message."""

    engine_index: int

    def encode(self) -> bytes:
        """The notice's single frame: ``["lost", engine_index]``."""
        return _encode([_LOST_TAG, self.engine_index])


def decode_front_message(frame: bytes | memoryview) -> FirstRequest | ScaleNotice | LostNotice:
    """Decodes a front-end's notice to the coordinator; raises
    :class:`~corewire.errors.ProtocolError` for anything else."""
    try:
        msg = _decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"front-end message: {exc}") from exc
    if isinstance(msg, list) and len(msg) == 2:
        if msg[0] == _SCALE_TAG and _is_int(msg[1]):
            return ScaleNotice(msg[1])
        if msg[0] == _LOST_TAG and _is_int(msg[1]):
            return LostNotice(msg[1])
        if _is_int(msg[0]) and _is_int(msg[1]):
            return FirstRequest(msg[0], msg[1])
    raise ProtocolError(f"unknown front-end message {msg!r:.100}")


# The fields of EngineCoreOutputs the coordinator reads, with their types and defaults;
# every other field stays undecoded (its outputs are what the coordinator must not pay for).
_REPORT_READS: dict[str, tuple[Any, Any]] = {
    "engine_index": (int, 0),
    "scheduler_stats": (dict[str, Any] | None, None),
    "wave_complete": (int | None, None),
    "start_wave": (int | None, None),
}


def _unread_field(field: msgspec.structs.FieldInfo) -> tuple[str, Any, Any]:
    default = (
        field.default if field.default_factory is msgspec.NODEFAULT else field.default_factory()
    )
    return (field.name, msgspec.Raw, msgspec.Raw(_encode(default)))


#: What the coordinator reads of an engine's ``EngineCoreOutputs``: a struct made from
#: :class:`~corewire.protocol.EngineCoreOutputs`' own field list (same names, same
#: positions), the fields it does not read kept as raw msgpack.
EngineReport: Any = msgspec.defstruct(
    "EngineReport",
    [
        (f.name, *_REPORT_READS[f.name]) if f.name in _REPORT_READS else _unread_field(f)
        for f in msgspec.structs.fields(EngineCoreOutputs)
    ],
    array_like=True,
    module=__name__,
    namespace={"__doc__": "What the coordinator reads of an engine's EngineCoreOutputs."},
)


class CoordinatorLinks(NamedTuple):
    """The coordinator addresses a DP engine needs (its ``coordinator_addresses``
    option): the front-ends' publisher (reported in the ready response), the stats PULL
    it pushes to, and the wave publisher it subscribes to."""

    front_publish: str
    engine_stats: str
    engine_publish: str
