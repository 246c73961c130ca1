"""vLLM 0.25.1: the release whose wire ``corewire.protocol`` declares (docs/protocol.md
§3-§9), and the behaviour every later release is described against."""

from __future__ import annotations

from corewire.releases.base import Release

__all__ = ["Release0251"]


class Release0251(Release):
    """vLLM 0.25.1: ``get_engine_zmq_addresses``, a 4-tuple from ``launch_core_engines``,
    the 10-key ready response; the default behaviour of :class:`Release`."""

    __slots__ = ()
    NAME = "0.25.1"
    # 0.26.0 changed nothing its front-end helpers, client members, DP coordinator or
    # ready response do (docs/protocol.md §11.3); checked live against this class.
    LIVE_CHECKED = ("0.25.1", "0.26.0")

    NATIVE_OUTPUT = True
    VLLM_CLIENT = True
