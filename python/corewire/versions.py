"""The vLLM wire versions corewire speaks, and how one is chosen.

corewire speaks the engine-core protocol of two vLLM releases, byte for byte each:
``"0.25.1"`` (:data:`DEFAULT`) and ``"0.33.0"``. They differ in a few struct layouts
(docs/protocol.md, "Versions"); a peer's version cannot be read off its frames, so it is
named: ``protocol="0.33.0"`` on a decoder or encoder, or :func:`protocol_for_vllm` from
an installed vLLM's version string.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT",
    "SUPPORTED",
    "V0_25_1",
    "V0_33_0",
    "Behaviour",
    "UnsupportedProtocolError",
    "behaviour",
    "check_protocol",
    "protocol_for_vllm",
    "unsupported_protocol",
]

#: vLLM 0.25.1's wire.
V0_25_1 = "0.25.1"
#: vLLM 0.33.0's wire.
V0_33_0 = "0.33.0"
#: Every version corewire speaks, oldest first (the Rust decoder's
#: ``_native.wire_versions()``; a test ties the two).
SUPPORTED: tuple[str, ...] = (V0_25_1, V0_33_0)
#: The version of anything not told one.
DEFAULT = V0_25_1


class UnsupportedProtocolError(ValueError):
    """A protocol (or installed vLLM) version corewire does not speak."""

    def __init__(self, message: str, version: str) -> None:
        super().__init__(message)
        self.version = version


def unsupported_protocol(version: object, what: str = "protocol") -> UnsupportedProtocolError:
    """The error for an unsupported ``version``, naming the supported ones."""
    supported = ", ".join(repr(v) for v in SUPPORTED)
    return UnsupportedProtocolError(
        f"unsupported {what} {version!r}: corewire speaks vLLM {supported}", str(version)
    )


@dataclass(frozen=True)
class Behaviour:
    """What one release's engines and front-ends do beyond their struct layouts
    (docs/protocol.md §11). Every version-dependent branch outside the layout tables
    (``corewire.layouts``, ``corewire.ready_layouts``) reads one of these flags, so a
    further release is one more row, not a hunt through ``if`` statements."""

    #: DP counts are ``[waiting, running, kv_cache_usage]`` (else ``[waiting, running]``),
    #: and engines report the KV cache's use to the coordinator.
    counts_carry_kv_usage: bool
    #: Front-ends send no first-request notices: an idle engine that takes a request
    #: starts the wave itself (else the front-end's notice starts it).
    engine_led_waves: bool
    #: Engines answer ``pause_generation`` (refusing new work with ``RequestError``),
    #: weight versions, ``release_kv_cache_memory``, ``compute_weight_checksums``.
    generation_pause_utilities: bool
    #: Internal load balancing adds the KV-pressure term to an engine's waiting count.
    kv_pressure_routing: bool
    #: Internal load balancing keeps a streaming-input session on its engine and aborts
    #: an open session on every engine.
    session_affinity: bool


_BEHAVIOUR = {
    V0_25_1: Behaviour(
        counts_carry_kv_usage=False,
        engine_led_waves=False,
        generation_pause_utilities=False,
        kv_pressure_routing=False,
        session_affinity=False,
    ),
    V0_33_0: Behaviour(
        counts_carry_kv_usage=True,
        engine_led_waves=True,
        generation_pause_utilities=True,
        kv_pressure_routing=True,
        session_affinity=True,
    ),
}


def behaviour(protocol: str | None) -> Behaviour:
    """The :class:`Behaviour` of ``protocol`` (``None``: :data:`DEFAULT`)."""
    return _BEHAVIOUR[check_protocol(protocol)]


def check_protocol(protocol: str | None) -> str:
    """``protocol`` if supported (``None``: :data:`DEFAULT`), else raise."""
    if protocol is None:
        return DEFAULT
    if protocol not in SUPPORTED:
        raise unsupported_protocol(protocol)
    return protocol


def protocol_for_vllm(version: str) -> str:
    """The protocol of an installed vLLM whose ``vllm.__version__`` is ``version``.

    Exact releases only: a patch or development release may change the wire (0.33.0 moved
    fields that 0.25.1 had), and nothing here has checked any other release, so it is
    refused with :class:`UnsupportedProtocolError` rather than decoded wrongly. A local
    version label (``0.33.0+cpu``) names the same release and is accepted.
    """
    release = version.strip().split("+", 1)[0]
    if release in SUPPORTED:
        return release
    raise unsupported_protocol(version, "vLLM version")
