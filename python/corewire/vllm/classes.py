"""corewire's client classes inside vLLM's ``AsyncLLM``: one per release and kind, each
composed here from the same parts.

``AsyncLLM`` asks its client factory for one of three kinds of client: ``"plain"`` (one
engine), ``"dp"`` (a data-parallel group, external load balancing) and ``"dplb"``
(internal load balancing). Each is corewire's client of that kind (``AsyncMPClient``,
``DPAsyncMPClient``, ``DPLBAsyncMPClient``), with the DP construction under vLLM's
coordinator (:class:`~corewire.vllm.dp_client.VllmDPMixin`) for the DP kinds, and, in
front, the members the release's ``AsyncLLM`` calls: the class its release object names
(:meth:`corewire.releases.Release.vllm_client_members`). So a release whose front-end
calls something new adds one members class, never a row of client classes; and every
class knows the release it serves (its ``release``), the installed one included when that
is newer than every tested release and behaves as its class's.
"""

from __future__ import annotations

import functools

from corewire.client.async_client import AsyncMPClient
from corewire.client.dp import DPAsyncMPClient, DPLBAsyncMPClient
from corewire.releases import Release
from corewire.releases import get as get_release
from corewire.vllm.dp_client import VllmDPMixin

__all__ = ["KINDS", "client_class", "client_classes"]

#: Each kind of client ``AsyncLLM`` asks for -> the end of its class name and the bases
#: that follow the release's members.
_KINDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "plain": ("AsyncMPClient", (AsyncMPClient,)),
    "dp": ("DPAsyncMPClient", (VllmDPMixin, DPAsyncMPClient)),
    "dplb": ("DPLBAsyncMPClient", (VllmDPMixin, DPLBAsyncMPClient)),
}
#: The kinds, as ``AsyncLLM``'s factory chooses among them.
KINDS = tuple(_KINDS)


@functools.cache
def client_class(release: Release, kind: str) -> type:
    """corewire's client of ``kind`` for vLLM ``release``'s ``AsyncLLM`` (one class per
    pair, made once)."""
    suffix, rest = _KINDS[kind]
    members = release.vllm_client_members()
    # The base members (0.25.1's) are VllmDPMixin's own base: listed before it they would
    # leave the class without a method order.
    bases = rest if any(issubclass(b, members) for b in rest) else (members, *rest)
    corewire_class = rest[-1]
    return type(
        f"Vllm{release.name.replace('.', '')}{suffix}",
        bases,
        {
            "__module__": __name__,
            "__doc__": (
                f"corewire's :class:`corewire.{corewire_class.__name__}` inside vLLM "
                f"{release.name}'s ``AsyncLLM`` (the members of "
                f":class:`{members.__module__}.{members.__name__}`)."
            ),
            "release": release,
        },
    )


def client_classes(protocol: str) -> dict[str, type]:
    """corewire's client classes for the ``AsyncLLM`` of vLLM release ``protocol``, by
    kind: ``"plain"``, ``"dp"`` (external load balancing) and ``"dplb"`` (internal)."""
    release = get_release(protocol)
    return {kind: client_class(release, kind) for kind in KINDS}
