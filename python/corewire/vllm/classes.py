"""corewire's client classes inside vLLM's ``AsyncLLM``, one per release and kind, each
composed here from the same parts, and the factory that chooses among them.

``AsyncLLM`` asks its client factory for one of three kinds of client: ``"plain"`` (one
engine), ``"dp"`` (a data-parallel group, external load balancing) and ``"dplb"``
(internal load balancing). Each is corewire's client of that kind (``AsyncMPClient``,
``DPAsyncMPClient``, ``DPLBAsyncMPClient``), with the DP construction under vLLM's
coordinator (:class:`~corewire.vllm.dp_client.VllmDPMixin`) for the DP kinds, and, in
front, the members the release's ``AsyncLLM`` calls: its entry of :data:`MEMBERS`. So a
release whose front-end calls something new adds one members class, never a row of
client classes; and every
class knows the release it serves (its ``release``), the installed one included when that
is newer than every tested release and behaves as its class's.

:func:`make_async_mp_client` stands in for vLLM's ``EngineCoreClient.make_async_mp_client``
(installed by ``corewire.vllm.plugin``) and chooses among them as vLLM chooses.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from corewire.client.async_client import AsyncMPClient
from corewire.client.dp import DPAsyncMPClient, DPLBAsyncMPClient
from corewire.releases import Release
from corewire.releases import get as get_release
from corewire.vllm.client import INSTALLED_RELEASE, VllmClientMixin
from corewire.vllm.dp_client import VllmDPMixin
from corewire.vllm.v0_33_0 import Members0330
from corewire.vllm.v0_34_0 import Members0340

__all__ = [
    "KINDS",
    "MEMBERS",
    "client_class",
    "client_classes",
    "declined_reason",
    "make_async_mp_client",
]

logger = logging.getLogger("vllm.corewire")

#: The members each release's ``AsyncLLM`` calls on its engine-core client, by the
#: release each was written for (``Release.choose``). 0.27.0's front-end calls a subset of
#: 0.33.0's, with the same arguments (handle_fault, get_status, weight versions,
#: prepare/commit elastic EP; profile with two of its five); the all-engine and consensus
#: answers of reset_prefix_cache, wake_up, is_sleeping and is_scheduler_paused are
#: 0.32.0's, and before it a DP group answered with its first engine's, the same whenever
#: the engines agree (they take every such call together).
MEMBERS: dict[str, type] = {
    "0.25.1": VllmClientMixin,
    "0.27.0": Members0330,
    "0.34.0": Members0340,
}

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
    members = release.choose(MEMBERS)
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


def client_classes(release: str) -> dict[str, type]:
    """corewire's client classes for the ``AsyncLLM`` of vLLM release ``release``, by
    kind: ``"plain"``, ``"dp"`` (external load balancing) and ``"dplb"`` (internal)."""
    release = get_release(release)
    return {kind: client_class(release, kind) for kind in KINDS}


def make_async_mp_client(
    vllm_config: Any,
    executor_class: Any,
    log_stats: bool,
    client_addresses: dict[str, Any] | None = None,
    client_count: int = 1,
    client_index: int = 0,
    renderer: Any = None,
) -> Any:
    """vLLM's ``EngineCoreClient.make_async_mp_client`` with corewire's clients.

    Chooses as vLLM chooses: a data-parallel group gets the DP client with external or
    internal load balancing, anything else the plain client; each of the installed
    vLLM's release (:func:`client_classes`). ``renderer`` is vLLM 0.33.0's (None before).
    """
    # vLLM's factory arguments, in vLLM's order (its clients and corewire's take them so).
    args = (vllm_config, executor_class, log_stats, client_addresses, client_count, client_index)
    declined = declined_reason(vllm_config)
    if declined is not None and vllm_factory is not None:
        # One line, at start: the server runs as it would without corewire.
        logger.warning("corewire: %s; vLLM's own engine-core client serves this server", declined)
        return vllm_factory(*args, **({} if renderer is None else {"renderer": renderer}))
    if declined is not None:
        raise ValueError(f"corewire's engine-core client cannot serve here: {declined}")
    classes = client_classes(INSTALLED_RELEASE)
    parallel_config = vllm_config.parallel_config
    if parallel_config.data_parallel_size > 1:
        kind = "dp" if parallel_config.data_parallel_external_lb else "dplb"
    else:
        kind = "plain"
    client = classes[kind](*args, renderer=renderer)
    # Said here too, not only when the plugin is installed: vLLM 0.33.0 configures its
    # logging after the plugins ran, so that earlier line is lost there.
    logger.info(
        "corewire: vLLM's AsyncLLM uses corewire's engine-core client %s (vLLM %s)",
        type(client).__name__,
        INSTALLED_RELEASE,
    )
    return client


#: vLLM's own client factory, kept by the plugin when it installs
#: :func:`make_async_mp_client` in its place: the servers corewire declines use it.
vllm_factory: Callable[..., Any] | None = None


def declined_reason(vllm_config: Any) -> str | None:
    """Why corewire's client must not serve ``vllm_config``'s server, or None.

    Elastic expert parallelism: vLLM's client hands a dead rank's ROUTER identity to its
    replacement and scales the group through its coordinator mid-flight, which
    corewire's client inside vLLM does not do (its calls would fail mid-flight instead).
    """
    if getattr(vllm_config.parallel_config, "enable_elastic_ep", False):
        return "elastic expert parallelism (--enable-elastic-ep) is not supported"
    return None
