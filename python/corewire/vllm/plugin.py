"""The ``vllm.general_plugins`` entry point: corewire's client inside vLLM's ``AsyncLLM``.

``pip install corewire`` registers :func:`register` with vLLM, which calls it in each of
its processes. It does nothing unless ``COREWIRE_VLLM_CLIENT=1`` is set; then it replaces
``EngineCoreClient.make_async_mp_client``, the factory through which vLLM's ``AsyncLLM``
builds its engine-core client, with :func:`corewire.vllm.client.make_async_mp_client`.
vLLM looks the factory up when ``AsyncLLM`` starts, after the plugins ran. The clients
speak the installed vLLM's release (0.25.1 or 0.33.0; another is refused by name). Engine-core and
worker processes never call that factory, so nothing changes for them, and vLLM's
synchronous ``LLM`` class keeps its own client.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from corewire.versions import SUPPORTED

__all__ = ["ENV_SWITCH", "PLUGIN_VLLM_VERSIONS", "check_vllm_version", "enabled", "register"]

# Under vLLM's logger namespace: its handlers (and level) show this in the server's log.
logger = logging.getLogger("vllm.corewire")

#: The switch: "1" (or "true", "yes", "on") makes vLLM use corewire's client.
ENV_SWITCH = "COREWIRE_VLLM_CLIENT"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def enabled() -> bool:
    """Whether ``COREWIRE_VLLM_CLIENT`` asks for corewire's client.

    Raises ``ValueError`` for a value that is neither on nor off, rather than guessing.
    """
    raw = os.environ.get(ENV_SWITCH, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{ENV_SWITCH} must be 1 or 0, got {os.environ[ENV_SWITCH]!r}")


#: The vLLM releases whose ``AsyncLLM`` the plugin's client is built and tested for (each
#: with its own client classes: ``corewire.vllm.client.client_classes``): every release
#: corewire speaks.
PLUGIN_VLLM_VERSIONS = SUPPORTED


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` naming the supported releases unless the plugin's client
    supports vLLM ``version`` (a local label such as ``+cpu`` is ignored)."""
    if version.split("+", 1)[0] not in PLUGIN_VLLM_VERSIONS:
        supported = ", ".join(PLUGIN_VLLM_VERSIONS)
        raise RuntimeError(
            f"{ENV_SWITCH}=1: corewire's client inside vLLM supports vLLM {supported}, "
            f"not the installed {version}; unset {ENV_SWITCH} to keep vLLM's own client"
        )


def register() -> None:
    """Entry point run by vLLM: install corewire's client factory when switched on."""
    if not enabled():
        return
    import vllm

    # Before importing the adapter: under another vLLM it would fail on a moved name,
    # or worse, run and decode wrongly.
    check_vllm_version(vllm.__version__)
    from vllm.v1.engine.core_client import EngineCoreClient

    from corewire.vllm.client import make_async_mp_client

    current: Any = EngineCoreClient.__dict__.get("make_async_mp_client")
    if getattr(current, "__func__", None) is make_async_mp_client:
        return  # vLLM loads plugins more than once per process
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]
    logger.info("corewire: vLLM's AsyncLLM uses corewire's engine-core client")
