"""Times CPython's cyclic garbage collector inside another process (``corewire bench serve``).

The serve benchmark copies this file, as ``sitecustomize.py``, into a private directory of
its own and puts that directory first on the API server's ``PYTHONPATH``: Python imports
it at start-up, before vLLM. With ``COREWIRE_GC_PROBE_DIR`` set to that directory it times
every collection (``gc.callbacks``, ``start`` to ``stop``) per generation, in CPU time of
the collecting thread (on a shared machine, wall time would count the waits for a core),
and whenever a client connects to ``DIR/gc-<pid>.sock`` it writes its totals so far to
``DIR/gc-<pid>.json`` and answers ``ok``. The benchmark asks at both ends of a measured
window and subtracts.

Only the standard library: importing vLLM or corewire here would change the heap whose
collections are measured. Any failure to install leaves the process as it would have been
(the benchmark then reports the collector time as unavailable). Another ``sitecustomize``
further on ``sys.path``, which this file hides, still runs.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import time

__all__ = ["ENV", "GENERATIONS", "GcTotals", "install"]

#: The directory for the socket and the JSON file; unset, the probe does nothing.
ENV = "COREWIRE_GC_PROBE_DIR"
#: CPython's collector generations.
GENERATIONS = 3


class GcTotals:
    """Collections, collector CPU and wall seconds, and objects freed, per generation."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.cpu_s = [0.0] * GENERATIONS
        self.wall_s = [0.0] * GENERATIONS
        self.collected = [0] * GENERATIONS
        self.uncollectable = [0] * GENERATIONS
        # Collections never overlap (the collector refuses to re-enter), so one pair of
        # start times is enough.
        self._cpu0 = 0.0
        self._wall0 = 0.0

    def callback(self, phase: str, info: dict) -> None:
        """The ``gc.callbacks`` entry: allocates no container, so it triggers nothing."""
        if phase == "start":
            self._cpu0 = time.thread_time()
            self._wall0 = time.perf_counter()
            return
        generation = info["generation"]
        self.cpu_s[generation] += time.thread_time() - self._cpu0
        self.wall_s[generation] += time.perf_counter() - self._wall0
        self.collections[generation] += 1
        self.collected[generation] += info["collected"]
        self.uncollectable[generation] += info["uncollectable"]

    def as_dict(self) -> dict:
        """The totals as the JSON file holds them."""
        return {
            "pid": os.getpid(),
            "collections": list(self.collections),
            "cpu_s": list(self.cpu_s),
            "wall_s": list(self.wall_s),
            "collected": list(self.collected),
            "uncollectable": list(self.uncollectable),
            "process_cpu_s": time.process_time(),
            "thresholds": list(gc.get_threshold()),
            "frozen": gc.get_freeze_count(),
        }


def _write(path: str, totals: GcTotals) -> None:
    # Written aside and renamed: a reader never sees half a file.
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(totals.as_dict(), f)
    os.replace(tmp, path)


def _answer(server: socket.socket, directory: str, totals: GcTotals) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            try:
                conn.recv(64)
                _write(os.path.join(directory, f"gc-{os.getpid()}.json"), totals)
                conn.sendall(b"ok\n")
            except OSError:
                continue


def install(directory: str) -> GcTotals:
    """Start timing collections and answering on ``directory/gc-<pid>.sock``."""
    totals = GcTotals()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = os.path.join(directory, f"gc-{os.getpid()}.sock")
    try:
        server.bind(path)
        server.listen(4)
    except OSError:
        server.close()
        raise
    gc.callbacks.append(totals.callback)
    # A daemon thread blocked in accept() holds no GIL: it costs the process nothing
    # until the benchmark asks.
    threading.Thread(
        target=_answer, args=(server, directory, totals), name="corewire-gc-probe", daemon=True
    ).start()
    return totals


def _run_hidden_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file hides, if there is one further on ``sys.path``."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get(ENV):
        try:
            install(os.environ[ENV])
        except Exception as exc:  # never break the process being measured
            print(f"corewire gc probe: not installed: {exc!r}", file=sys.stderr)
    _run_hidden_sitecustomize()
