"""Starting an engine process: loading the engine, signals, parent-death watch.

:func:`run_engine_core` is the target a client gives ``multiprocessing`` (spawn context);
:func:`serve_engine` is the same without the process exit, used by ``corewire engine``.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from corewire import releases
from corewire.engine.core import EngineCoreProc
from corewire.engine.interface import Engine
from corewire.engine.startup import REQUIRED_METHODS, report_startup_error, split_engine_spec
from corewire.fast_exit import exit_now
from corewire.logtext import LineLimit

__all__ = [
    "EngineLaunch",
    "build_proc",
    "configure_logging",
    "load_engine",
    "run_engine_core",
    "run_proc",
    "serve_engine",
]

logger = logging.getLogger("corewire.engine")

#: After a stop was requested, the process exits by force if the loop has not finished
#: by then (a step that never returns must not keep an orphan alive).
STOP_GRACE_S = 15.0
_WATCH_INTERVAL_S = 0.25


def load_engine(spec: str | None = None, engine_args: dict[str, Any] | None = None) -> Engine:
    """Build the engine named by ``spec`` ("module:Class", an alias, or None for the
    reference engine) with ``engine_args`` as keyword arguments."""
    module_name, attr = split_engine_spec(spec)
    factory: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    engine = factory(**(engine_args or {}))
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(engine, m, None))]
    if missing:
        raise TypeError(
            f"{module_name}:{attr} does not implement the Engine interface (missing {missing})"
        )
    return engine


def _proc_class(dp_options: dict[str, Any]) -> type[EngineCoreProc]:
    """The data-parallel proc class when DP options are given, else the plain one.

    The DP module is imported here, not at the top, so that a plain engine does not
    load it; an ImportError propagates (a broken install must not quietly run a plain
    engine that ignores its DP options).
    """
    if not dp_options:
        return EngineCoreProc
    from corewire.engine.dp import DPEngineCoreProc

    return DPEngineCoreProc


@dataclass(frozen=True)
class EngineLaunch:
    """What an engine core is started with, written once for every way of starting one
    (a client's child process, ``corewire engine``, a Ray actor).

    ``engine_index``: its index in the group; ``input_address`` / ``output_address``: the
    front-end's request and output endpoints (a list: one per front-end); ``engine``: the
    engine class as ``"module:Class"`` (None: the reference engine); ``engine_args``: its
    constructor's keyword arguments; ``release``: the vLLM release whose wire it speaks
    (None: ``corewire.releases.DEFAULT``); ``dp_options``: the data-parallel engine core's
    further arguments (none: a plain engine core).
    """

    engine_index: int
    input_address: str | list[str]
    output_address: str | list[str]
    engine: str | None = None
    engine_args: dict[str, Any] | None = None
    release: str | None = None
    dp_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, **options: Any) -> EngineLaunch:
        """The launch the keyword arguments of :func:`run_engine_core` describe (the
        process target's contract): the named fields, every other keyword a DP option."""
        named = {f.name for f in fields(cls)} - {"dp_options"}
        if "protocol" in options:
            # The deprecated name of ``release`` (a caller's engine-main contract).
            options = dict(options)
            protocol = options.pop("protocol")
            options["release"] = releases.named(options.get("release"), protocol, "run_engine_core")
        return cls(
            **{k: v for k, v in options.items() if k in named},
            dp_options={k: v for k, v in options.items() if k not in named},
        )


def serve_engine(launch: EngineLaunch, parent_pid: int | None = None) -> int:
    """Run the engine core ``launch`` describes in this process until it stops; return
    its exit status.

    SIGTERM and SIGINT stop it cleanly (status 0) when called on the main thread. With
    ``parent_pid``, it also stops when that process dies. A fatal engine error sends
    ENGINE_CORE_DEAD and returns 1. An engine that fails to build returns 1 before the
    ready message, so the front-end sees the process exit instead of a ready engine.
    """
    configure_logging(launch.engine_index)
    try:
        proc = build_proc(launch)
    except Exception as exc:
        logger.exception("engine %d failed to start", launch.engine_index)
        report_startup_error(exc)  # to the client that started this process, if one did
        return 1
    return run_proc(proc, parent_pid)


def build_proc(launch: EngineLaunch) -> EngineCoreProc:
    """Build the engine ``launch`` names and the engine core around it (the DP one when
    it has ``dp_options``), connected and ready to :func:`run_proc`; raises what building
    raised."""
    built = load_engine(launch.engine, launch.engine_args)
    return _proc_class(launch.dp_options)(
        built,
        engine_index=launch.engine_index,
        input_address=launch.input_address,
        output_address=launch.output_address,
        release=launch.release,
        **launch.dp_options,
    )


def run_proc(proc: EngineCoreProc, parent_pid: int | None = None) -> int:
    """Run a built engine core on this thread until it stops; return its exit status.

    SIGTERM and SIGINT stop it cleanly when called on the main thread; with
    ``parent_pid`` it also stops when that process dies.
    """

    def _stop(signum: int, _frame: Any) -> None:
        proc.request_stop()

    installed: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            installed[sig] = signal.signal(sig, _stop)
    watcher = _Watcher(proc, parent_pid)
    watcher.start()
    try:
        status = proc.run()
    finally:
        watcher.stop()
        for sig, previous in installed.items():
            signal.signal(sig, previous)
    logger.info("engine %d stopped (status %d)", proc.engine_index, status)
    return status


def run_engine_core(*, parent_pid: int | None = None, **options: Any) -> None:
    """Process target of an engine started by a client (``multiprocessing`` spawn).

    ``options``: the fields of :class:`EngineLaunch` as keyword arguments (``engine_index``,
    ``input_address``, ``output_address``, and optionally ``engine``, ``engine_args``,
    ``release``; ``protocol`` is its deprecated name), every other keyword a DP option
    for the data-parallel proc class: the contract every engine-main callable a client is
    given shares. Blocks until the engine stops; exits the process with status 1 on a
    fatal error. ``parent_pid`` defaults to this process's parent: the engine stops when
    it dies.
    """
    status = serve_engine(
        EngineLaunch.of(**options),
        parent_pid=os.getppid() if parent_pid is None else parent_pid,
    )
    if multiprocessing.parent_process() is not None:
        # A child started for this engine alone: skip the interpreter's teardown, which
        # with torch loaded outlasts the client's SIGTERM grace (corewire.fast_exit).
        exit_now(status)
    if status:
        sys.exit(status)


class _Watcher:
    """Background thread: stops the engine when ``parent_pid`` dies, and exits the
    process by force when a requested stop takes longer than :data:`STOP_GRACE_S`."""

    def __init__(self, proc: EngineCoreProc, parent_pid: int | None) -> None:
        self._proc = proc
        self._parent_pid = parent_pid
        self._done = threading.Event()
        self._pidfd: int | None = None
        # Re-parenting tells that a direct parent died when pidfds are unavailable.
        self._direct_parent = parent_pid is not None and parent_pid == os.getppid()
        self._thread = threading.Thread(
            target=self._main, name=f"corewire-engine-{proc.engine_index}-watch", daemon=True
        )

    def start(self) -> None:
        if self._parent_pid is not None:
            try:
                # A pidfd turns readable when the process exits and never names a
                # recycled pid, unlike polling the number.
                self._pidfd = os.pidfd_open(self._parent_pid)
            except (AttributeError, OSError):
                self._pidfd = None
            if not self._parent_alive():
                logger.warning("parent process %d is already gone", self._parent_pid)
                self._proc.request_stop(discard_pending=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2.0)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _parent_alive(self) -> bool:
        pid = self._parent_pid
        if pid is None:
            return True
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            return not readable
        if self._direct_parent and os.getppid() != pid:
            return False  # re-parented: the original parent is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _main(self) -> None:
        stop_seen: float | None = None
        while not self._done.wait(_WATCH_INTERVAL_S):
            if self._parent_pid is not None and stop_seen is None and not self._parent_alive():
                logger.warning("parent process %d died; stopping engine", self._parent_pid)
                self._proc.request_stop(discard_pending=True)
            if self._proc.stop_requested:
                now = time.monotonic()
                if stop_seen is None:
                    stop_seen = now
                elif now - stop_seen > STOP_GRACE_S:
                    logger.error("engine did not stop within %.0f s; exiting", STOP_GRACE_S)
                    os._exit(1)


def configure_logging(engine_index: int) -> None:
    """Log to stderr with the engine's name, unless the host configured logging
    (level from ``COREWIRE_LOG_LEVEL``, default INFO); every line bounded in bytes
    (:class:`corewire.logtext.LineLimit`)."""
    root = logging.getLogger()
    if root.handlers:
        return
    level = os.environ.get("COREWIRE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [engine {engine_index} pid %(process)d] "
        "%(name)s: %(message)s",
    )
    for handler in root.handlers:
        handler.addFilter(LineLimit())
