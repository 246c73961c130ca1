"""corewire's client classes inside vLLM's ``AsyncLLM``, and the factory that chooses
among them.

``AsyncLLM`` asks its client factory for one of three kinds of client: ``"plain"`` (one
engine), ``"dp"`` (a data-parallel group, external load balancing) and ``"dplb"``
(internal load balancing). Each class here is corewire's client of that kind
(``AsyncMPClient``, ``DPAsyncMPClient``, ``DPLBAsyncMPClient``), with the DP construction
under vLLM's coordinator (:class:`~corewire.vllm.adapters.dp_client.VllmDPMixin`) for the DP kinds,
and, in front, the members a release's ``AsyncLLM`` calls: 0.25.1's
(:class:`~corewire.vllm.adapters.client.VllmClientMixin`), 0.33.0's
(:class:`~corewire.vllm.adapters.v0_33_0.Members0330`, which 0.27.0 to 0.33.0 call) or 0.34.0's
(:class:`~corewire.vllm.adapters.v0_34_0.Members0340`). :data:`CLASSES` says which a release takes:
a release whose front-end calls something new adds one members class and one row here.
Each client knows the release it serves (its ``release``), the installed one included
when that is newer than every tested release and behaves as its class's.

:func:`make_async_mp_client` stands in for vLLM's ``EngineCoreClient.make_async_mp_client``
(installed by ``corewire.vllm.plugin``) and chooses among them as vLLM chooses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from corewire.client.async_client import AsyncMPClient
from corewire.client.dp import DPAsyncMPClient, DPLBAsyncMPClient
from corewire.releases import get as get_release
from corewire.vllm.adapters.client import INSTALLED_RELEASE, VllmClientMixin
from corewire.vllm.adapters.dp_client import VllmDPMixin
from corewire.vllm.adapters.v0_33_0 import Members0330
from corewire.vllm.adapters.v0_34_0 import Members0340

__all__ = [
    "CLASSES",
    "KINDS",
    "Vllm0330AsyncMPClient",
    "Vllm0330DPAsyncMPClient",
    "Vllm0330DPLBAsyncMPClient",
    "Vllm0340AsyncMPClient",
    "Vllm0340DPAsyncMPClient",
    "Vllm0340DPLBAsyncMPClient",
    "VllmAsyncMPClient",
    "VllmDPAsyncMPClient",
    "VllmDPLBAsyncMPClient",
    "client_classes",
    "declined_reason",
    "make_async_mp_client",
]

logger = logging.getLogger("vllm.corewire")


class VllmAsyncMPClient(VllmClientMixin, AsyncMPClient):
    """corewire's :class:`~corewire.AsyncMPClient` inside vLLM 0.25.1's (and 0.26.0's)
    ``AsyncLLM``: one engine."""


class VllmDPAsyncMPClient(VllmDPMixin, DPAsyncMPClient):
    """corewire's :class:`~corewire.DPAsyncMPClient` inside vLLM 0.25.1's ``AsyncLLM``:
    a DP group behind external load balancing."""


class VllmDPLBAsyncMPClient(VllmDPMixin, DPLBAsyncMPClient):
    """corewire's :class:`~corewire.DPLBAsyncMPClient` inside vLLM 0.25.1's ``AsyncLLM``:
    a DP group it balances itself."""


class Vllm0330AsyncMPClient(Members0330, AsyncMPClient):
    """The plain client with the members vLLM 0.27.0 to 0.33.0's ``AsyncLLM`` call."""


class Vllm0330DPAsyncMPClient(Members0330, VllmDPMixin, DPAsyncMPClient):
    """The external-LB DP client with the members of vLLM 0.27.0 to 0.33.0."""


class Vllm0330DPLBAsyncMPClient(Members0330, VllmDPMixin, DPLBAsyncMPClient):
    """The internal-LB DP client with the members of vLLM 0.27.0 to 0.33.0."""


class Vllm0340AsyncMPClient(Members0340, AsyncMPClient):
    """The plain client with the members vLLM 0.34.0's ``AsyncLLM`` calls."""


class Vllm0340DPAsyncMPClient(Members0340, VllmDPMixin, DPAsyncMPClient):
    """The external-LB DP client with the members of vLLM 0.34.0."""


class Vllm0340DPLBAsyncMPClient(Members0340, VllmDPMixin, DPLBAsyncMPClient):
    """The internal-LB DP client with the members of vLLM 0.34.0."""


#: Each release's client classes by kind, by the release they were written for
#: (``Release.choose``). 0.27.0's front-end calls a subset of 0.33.0's members, with the
#: same arguments (handle_fault, get_status, weight versions, prepare/commit elastic EP;
#: profile with two of its five); the all-engine and consensus answers of
#: reset_prefix_cache, wake_up, is_sleeping and is_scheduler_paused are 0.32.0's, and
#: before it a DP group answered with its first engine's, the same whenever the engines
#: agree (they take every such call together).
CLASSES: dict[str, dict[str, type]] = {
    "0.25.1": {
        "plain": VllmAsyncMPClient,
        "dp": VllmDPAsyncMPClient,
        "dplb": VllmDPLBAsyncMPClient,
    },
    "0.27.0": {
        "plain": Vllm0330AsyncMPClient,
        "dp": Vllm0330DPAsyncMPClient,
        "dplb": Vllm0330DPLBAsyncMPClient,
    },
    "0.34.0": {
        "plain": Vllm0340AsyncMPClient,
        "dp": Vllm0340DPAsyncMPClient,
        "dplb": Vllm0340DPLBAsyncMPClient,
    },
}
#: The kinds, as ``AsyncLLM``'s factory chooses among them.
KINDS = ("plain", "dp", "dplb")


def client_classes(release: str) -> dict[str, type]:
    """corewire's client classes for the ``AsyncLLM`` of vLLM release ``release``, by
    kind: ``"plain"``, ``"dp"`` (external load balancing) and ``"dplb"`` (internal)."""
    return dict(get_release(release).choose(CLASSES))


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
    client = classes[kind](*args, renderer=renderer, release=INSTALLED_RELEASE)
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
