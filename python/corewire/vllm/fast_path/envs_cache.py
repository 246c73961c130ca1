"""vLLM's environment variables read once in the API server, as vLLM reads them in its
engine processes.

``vllm.envs`` resolves each variable on every access (a module ``__getattr__``, a lambda,
``os.getenv`` and its parsing), and vLLM's serving code reads several per request:
validating a completion request, checking its model, its sampling parameters, its request
id. In a loaded profile of the fast path (256 streams, 32 tokens) those reads were 3% of
the API server's CPU. vLLM's own ``enable_envs_cache`` memoizes them; vLLM calls it in its
engine cores and workers once they are initialized and documents that variables must not
change after that. Here it is called once the server's app is built: its engines are up by
then (vLLM builds the app after its engine client) and the process starts serving.

``COREWIRE_VLLM_ENVS_CACHE=0`` leaves the variables read on every access (for a deployment
that changes them in the running server); the fast path's switch turns this off with the
rest.
"""

from __future__ import annotations

from corewire.vllm.fast_path.shared import logger
from corewire.vllm.fast_path.switches import switched_off

#: Off (``0``) keeps vLLM reading its environment variables on every access.
SWITCH = "COREWIRE_VLLM_ENVS_CACHE"
#: Said in the API server's log when the variables are read once.
CACHED_LOG_LINE = "vLLM's environment variables are read once, from here on"


def wanted() -> bool:
    """Whether :data:`SWITCH` leaves the cache on (the default)."""
    return not switched_off(SWITCH)


def install() -> None:
    """Memoize ``vllm.envs`` in this process (vLLM's ``enable_envs_cache``), unless
    :data:`SWITCH` says not to or vLLM has no such function."""
    if not wanted():
        return
    import vllm.envs as envs

    enable = getattr(envs, "enable_envs_cache", None)
    if enable is None:
        return
    enable()
    logger.info("corewire: %s (%s=0 reads them on every access)", CACHED_LOG_LINE, SWITCH)
