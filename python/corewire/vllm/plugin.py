"""The ``vllm.general_plugins`` entry point: corewire's client inside vLLM's ``AsyncLLM``.

``pip install corewire`` registers :func:`register` with vLLM, which calls it in each of
its processes. It does nothing unless switched on. ``COREWIRE_VLLM_CLIENT=1`` replaces
``EngineCoreClient.make_async_mp_client``, the factory through which vLLM's ``AsyncLLM``
builds its engine-core client, with :func:`corewire.vllm.adapters.classes.make_async_mp_client`.
vLLM looks the factory up when ``AsyncLLM`` starts, after the plugins ran. The clients
speak the installed vLLM's release (one checked live: :data:`PLUGIN_VLLM_VERSIONS`; a newer
final release runs if the self-check passes; another is refused by name). Engine-core and
worker processes never call that factory, so nothing changes for them, and vLLM's
synchronous ``LLM`` class keeps its own client.

``COREWIRE_VLLM_OUTPUT`` (a switch of its own) hands ``AsyncLLM``'s output processing to
corewire: the plugin replaces ``vllm.v1.engine.async_llm.OutputProcessor``, the name
``AsyncLLM.__init__`` builds its processor from, with
the installed release's :class:`corewire.vllm.output.processor.NativeOutputProcessor` (a subclass
per release that changed vLLM's: ``corewire.vllm.output.by_release``). Unset, it follows
the client switch where the differential tests hold the native path to the installed
vLLM (0.25.1, 0.33.0, 0.34.0): corewire's client comes with corewire's output processing; under
another release vLLM's is kept, and one log line says so. ``0`` keeps vLLM's; ``1`` asks
for it even with vLLM's own client, and is refused by name under another release. vLLM's
synchronous ``LLMEngine`` keeps vLLM's processor (it imports the class under its own
name).

``COREWIRE_VLLM_FAST_PATH`` (a switch of its own) governs the per-token fast path of
``vllm serve`` (:mod:`corewire.vllm.fast_path`): streaming completions whose chunks after
the first are written from the native output state. Unset, it is on wherever native output
processing is and the differential HTTP tests hold the fast path to the installed release's
server (0.33.0, 0.34.0); ``0`` keeps vLLM's serving code; ``1`` asks for it, and is refused
by name under another release or without native output processing. It is installed only in the
API server's process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from corewire import releases

__all__ = [
    "ENV_SWITCH",
    "FAST_PATH_SWITCH",
    "FAST_PATH_VLLM_VERSIONS",
    "OUTPUT_SWITCH",
    "OUTPUT_VLLM_VERSIONS",
    "PLUGIN_VLLM_VERSIONS",
    "check_output_version",
    "check_vllm_version",
    "enabled",
    "fast_path_release",
    "fast_path_wanted",
    "output_enabled",
    "output_wanted",
    "register",
    "self_check_passes",
]

# Under vLLM's logger namespace: its handlers (and level) show this in the server's log.
logger = logging.getLogger("vllm.corewire")

#: The switch: "1" (or "true", "yes", "on") makes vLLM use corewire's client.
ENV_SWITCH = "COREWIRE_VLLM_CLIENT"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

#: The output switch: "1" makes vLLM's ``AsyncLLM`` process outputs natively, "0" keeps
#: vLLM's; unset, it follows the client switch (see :func:`output_wanted`).
OUTPUT_SWITCH = "COREWIRE_VLLM_OUTPUT"

#: The vLLM releases whose output processing corewire's native path reproduces.
OUTPUT_VLLM_VERSIONS = tuple(r for r in releases.SUPPORTED if r.native_output)


#: The vLLM releases whose OpenAI server corewire's fast path is held to.
FAST_PATH_VLLM_VERSIONS = tuple(r for r in releases.SUPPORTED if r.fast_path)

#: The fast-path switch: "0" keeps vLLM's serving code, "1" asks for the fast path;
#: unset, it follows native output processing (see :func:`fast_path_wanted`).
FAST_PATH_SWITCH = "COREWIRE_VLLM_FAST_PATH"


def _switch(name: str) -> bool:
    # A value that is neither on nor off raises rather than being guessed.
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be 1 or 0, got {os.environ[name]!r}")


def enabled() -> bool:
    """Whether ``COREWIRE_VLLM_CLIENT`` asks for corewire's client.

    Raises ``ValueError`` for a value that is neither on nor off, rather than guessing.
    """
    return _switch(ENV_SWITCH)


def output_enabled() -> bool:
    """Whether ``COREWIRE_VLLM_OUTPUT`` asks for native output processing (``ValueError``
    for a value that is neither on nor off); False when unset."""
    return _switch(OUTPUT_SWITCH)


def output_wanted(vllm_version: str) -> bool:
    """Whether the plugin installs native output processing under vLLM ``vllm_version``:
    as ``COREWIRE_VLLM_OUTPUT`` says, or, unset, with corewire's client where the native
    path reproduces that release."""
    if os.environ.get(OUTPUT_SWITCH, "").strip():
        return output_enabled()
    return enabled() and vllm_version.split("+", 1)[0] in OUTPUT_VLLM_VERSIONS


def fast_path_wanted(vllm_version: str, output_installed: bool) -> bool:
    """Whether the plugin installs ``vllm serve``'s fast path under vLLM ``vllm_version``
    with native output processing installed or not: as ``COREWIRE_VLLM_FAST_PATH`` says
    (``1`` raises ``RuntimeError`` where the fast path cannot run), or, unset, wherever
    native output processing runs under a release the fast path is held to."""
    covered = fast_path_release(vllm_version) is not None
    if not os.environ.get(FAST_PATH_SWITCH, "").strip():
        return covered and output_installed
    if not _switch(FAST_PATH_SWITCH):
        return False
    if not covered:
        supported = ", ".join(FAST_PATH_VLLM_VERSIONS)
        raise RuntimeError(
            f"{FAST_PATH_SWITCH}=1: corewire's fast path reproduces the OpenAI server of "
            f"vLLM {supported}, not the installed {vllm_version}; unset {FAST_PATH_SWITCH}"
        )
    if not output_installed:
        raise RuntimeError(
            f"{FAST_PATH_SWITCH}=1: the fast path writes from native output processing, "
            f"which is off ({OUTPUT_SWITCH}, {ENV_SWITCH})"
        )
    return True


#: The vLLM releases whose ``AsyncLLM`` the plugin's client is built and tested for (each
#: with its own client classes: ``corewire.vllm.adapters.classes.client_classes``); corewire speaks
#: the wire of more (``corewire.releases.SUPPORTED``).
PLUGIN_VLLM_VERSIONS = tuple(r for r in releases.SUPPORTED if r.vllm_client)


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` naming the supported releases unless the plugin's client
    supports vLLM ``version`` (a local label such as ``+cpu`` is ignored)."""
    # A release newer than the newest tested one is not refused by name: the self-check
    # decides (self_check_passes), and corewire.releases.installed warns it is untested.
    base = version.split("+", 1)[0]
    if base not in PLUGIN_VLLM_VERSIONS and not releases.is_newer_than_tested(base):
        supported = ", ".join(PLUGIN_VLLM_VERSIONS)
        raise RuntimeError(
            f"{ENV_SWITCH}=1: corewire's client inside vLLM supports vLLM {supported}, "
            f"not the installed {version}; unset {ENV_SWITCH} to keep vLLM's own client"
        )


def check_output_version(version: str) -> None:
    """Raise ``RuntimeError`` unless the native output path reproduces vLLM ``version``."""
    if version.split("+", 1)[0] not in OUTPUT_VLLM_VERSIONS:
        supported = ", ".join(OUTPUT_VLLM_VERSIONS)
        raise RuntimeError(
            f"{OUTPUT_SWITCH}=1: corewire's output processing reproduces vLLM {supported}, "
            f"not the installed {version}; unset {OUTPUT_SWITCH} to keep vLLM's own"
        )


_told_output_kept = False


def register() -> None:
    """Entry point run by vLLM: install what the switches ask for."""
    output_installed = False
    if os.environ.get(OUTPUT_SWITCH, "").strip() or enabled():
        import vllm

        if output_wanted(vllm.__version__):
            _install_output_processor()
            output_installed = True
        elif not os.environ.get(OUTPUT_SWITCH, "").strip():
            _tell_output_kept(vllm.__version__)
    if output_installed or os.environ.get(FAST_PATH_SWITCH, "").strip():
        import vllm

        if fast_path_wanted(vllm.__version__, output_installed) and _in_api_server():
            _install_fast_path()
    if enabled():
        _install_client()


def fast_path_release(vllm_version: str) -> releases.Release | None:
    """The release of vLLM ``vllm_version`` (``vllm.__version__``) if its OpenAI server is
    one the fast path is held to (its ``fast_path`` flag), else None."""
    try:
        release = releases.for_vllm(vllm_version)
    except releases.UnsupportedProtocolError:
        return None
    return release if release.fast_path else None


def _install_fast_path() -> None:
    # Into vLLM 0.33.0's or 0.34.0's OpenAI server, those the fast path is held to
    # (fast_path_wanted checked that the installed release is one whose fast_path holds).
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from corewire.vllm import fast_path

    fast_path.install(OpenAIServingCompletion, OpenAIServingChat)


#: Modules only an API server's process has loaded by the time vLLM loads plugins there
#: (0.25.1's server module; 0.34.0's app builder).
_API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.app")


def _in_api_server() -> bool:
    # An engine or worker process has no server to patch (and importing one costs).
    return any(name in sys.modules for name in _API_SERVER_MODULES)


def _tell_output_kept(version: str) -> None:
    # Once per process (vLLM loads plugins more than once): the client switch alone does
    # not bring native output processing under a release it was not verified against.
    global _told_output_kept
    if _told_output_kept:
        return
    _told_output_kept = True
    logger.info(
        "corewire: native output processing is verified against vLLM %s, not the "
        "installed %s; vLLM's output processing is kept (%s=1 asks for it anyway only "
        "under a verified release)",
        ", ".join(OUTPUT_VLLM_VERSIONS),
        version,
        OUTPUT_SWITCH,
    )


def _install_output_processor() -> None:
    import vllm

    check_output_version(vllm.__version__)
    import vllm.v1.engine.async_llm as async_llm

    from corewire.vllm.output.by_release import native_output_processor

    native = native_output_processor(releases.installed(vllm))
    if async_llm.OutputProcessor is native:
        return  # vLLM loads plugins more than once per process
    async_llm.OutputProcessor = native  # type: ignore[misc]
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from corewire.vllm.output import latency_histogram

    # The last per-token Python of the output path: one histogram call per token. Both
    # are said in the log by the processor when vLLM builds it: vLLM 0.34.0 configures
    # its logging after loading plugins, and drops what they say at INFO before that.
    latency_histogram.install(PrometheusStatLogger)


def self_check_passes() -> bool:
    """Whether corewire's wire for the installed vLLM is, checked against that vLLM's own
    classes, encoder and decoder (``corewire.vllm.self_check``), what it writes and reads;
    otherwise one warning line names the difference, and vLLM keeps its own client."""
    import vllm

    from corewire.vllm.self_check import first_difference

    difference = first_difference(releases.installed(vllm))
    if difference is None:
        return True
    logger.warning(
        "corewire: %s=1, but corewire's wire does not match the installed vLLM %s (%s); "
        "vLLM keeps its own engine-core client",
        ENV_SWITCH,
        vllm.__version__,
        difference,
    )
    return False


def _install_client() -> None:
    import vllm

    # Before importing the adapter: under another vLLM it would fail on a moved name,
    # or worse, run and decode wrongly.
    check_vllm_version(vllm.__version__)
    from vllm.v1.engine.core_client import EngineCoreClient

    from corewire.vllm.adapters import classes
    from corewire.vllm.adapters.classes import make_async_mp_client

    current: Any = EngineCoreClient.__dict__.get("make_async_mp_client")
    if getattr(current, "__func__", None) is make_async_mp_client:
        return  # vLLM loads plugins more than once per process
    if not self_check_passes():
        return
    # Kept for the servers corewire declines (corewire.vllm.adapters.classes.declined_reason).
    classes.vllm_factory = current.__func__ if isinstance(current, staticmethod) else current
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]
    _client_logs_in_vllms_log()
    logger.info("corewire: vLLM's AsyncLLM uses corewire's engine-core client")


def _client_logs_in_vllms_log() -> None:
    """Show the client's warnings (an engine lost, replaced, rejoined, given up) in the
    server's log: the root logger, which they would reach otherwise, is at ERROR once
    some vLLM servers have imported their dependencies, and has no handler there."""
    client_logger = logging.getLogger("corewire.client")
    if any(isinstance(h, _ToVllmLogger) for h in client_logger.handlers):
        return  # vLLM loads plugins more than once per process
    client_logger.addHandler(_ToVllmLogger())
    # Its own level, unless someone set one (on it or on corewire's logger): the root's may
    # still be WARNING here and turn ERROR later in the server's start-up (vLLM 0.34.0).
    if client_logger.level == logging.NOTSET == logging.getLogger("corewire").level:
        client_logger.setLevel(logging.WARNING)


class _ToVllmLogger(logging.Handler):
    """Hands each record to the ``vllm.corewire.client`` logger, whose handlers are
    vLLM's whenever vLLM has set them up (some releases do so after the plugins load);
    where the root logger has handlers of its own, the record reaches them anyway and is
    not handed on twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.root.handlers:
            logging.getLogger("vllm.corewire.client").handle(record)
