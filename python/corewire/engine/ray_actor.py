"""An engine core inside a Ray actor: what ``data_parallel_backend="ray"`` places.

:class:`EngineActor` is a plain class; :mod:`corewire.client.ray_engines` makes it a Ray
actor (``ray.remote``) with the resources of its placement-group bundle. The actor is
the engine's process: :meth:`EngineActor.serve` builds the engine core and runs its busy
loop on one of the actor's threads until it stops, while the actor's other thread
answers :meth:`EngineActor.where` and :meth:`EngineActor.stop`. The engine connects to
the front-end's TCP endpoints (behind CURVE when the front-end's host is not loopback)
exactly as ``corewire engine --connect`` does, or (:meth:`EngineActor.join`) joins a vLLM
API server through its start-up handshake as ``corewire engine --handshake-address``
does; nothing of Ray is on corewire's wire.

This module imports no Ray: the actor's own process has it, and the engine code does not
need it (the node id is read through the Ray module already loaded there).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from corewire.engine.launch import EngineLaunch, build_proc, configure_logging, run_proc

__all__ = ["EngineActor"]


class EngineActor:
    """One engine core in a Ray actor (two concurrent methods: the loop and control)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._stop_early = threading.Event()
        self._lock = threading.Lock()

    def where(self) -> dict[str, Any]:
        """Where this engine runs, read inside it: Ray's node id and address, the process
        id, the GPUs Ray gave it (``CUDA_VISIBLE_DEVICES``, None without GPUs), and the
        values of its runtime environment's ``env_vars`` as this process sees them."""
        ray = sys.modules["ray"]  # loaded: this is a Ray worker
        context = ray.get_runtime_context()
        env_vars = (context.runtime_env or {}).get("env_vars") or {}
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "env_vars": {name: os.environ.get(name) for name in env_vars},
        }

    def serve(self, options: dict[str, Any]) -> int:
        """Build the engine core from ``options`` (the keyword arguments of
        :class:`corewire.engine.launch.EngineLaunch`) and run it until it stops; return its
        exit status. A failure to build raises (the caller's ``ray.get`` sees it)."""
        launch = EngineLaunch.of(**options)
        configure_logging(launch.engine_index)
        proc = build_proc(launch)
        self._built(proc)
        # No parent to watch: Ray ends the actor when its owner (the front-end) exits.
        return run_proc(proc)

    def join(self, options: dict[str, Any]) -> int:
        """Join a vLLM API server through its start-up handshake, as ``corewire engine
        --handshake-address`` does (``options``: the keyword arguments of
        :func:`corewire.engine.handshake.join_frontend`), and serve until stopped;
        return the exit status."""
        from corewire.engine.handshake import join_frontend

        return join_frontend(**options, on_built=self._built)

    def _built(self, proc: Any) -> None:
        with self._lock:
            self._proc = proc
            stop_first = self._stop_early.is_set()
        if stop_first:
            proc.request_stop()

    def stop(self) -> None:
        """Ask the engine to stop (it sends what it has queued, then :meth:`serve`
        returns); before it is built, it stops as soon as it is."""
        with self._lock:
            proc = self._proc
            self._stop_early.set()
        if proc is not None:
            proc.request_stop()
