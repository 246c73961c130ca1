"""A serve stack's engines started again when they die (``ServeStack(restart_engines=True)``,
``scripts/serve``'s default).

The stack's engines join vLLM's API server through its start-up handshake, which vLLM
closes once every engine has joined; each keeps the handshake's answer in a private join
record, and an engine started again for a dead one's index rejoins with it
(``corewire engine --join-record PATH --rejoin``). corewire's client inside the API server
takes it back in place of the lost one (``engine_loss="replace"``; see
:mod:`corewire.client.engine_loss`); vLLM's own client would not, so the stack restarts
engines only for corewire's client.

A rank that dies more than :data:`~corewire.client.engine_loss.RESTART_LIMIT` times within
:data:`~corewire.client.engine_loss.RESTART_WINDOW_S` seconds is left down (said in the
log): the group serves on without it.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable

from corewire.client.engine_loss import RestartBudget

__all__ = ["EngineRestarts"]

logger = logging.getLogger("corewire.vllm.serve")

#: How often the engines' processes are looked at.
POLL_S = 0.2
#: Seconds at least between two starts of one engine (one that dies at once would
#: otherwise spend its budget in a second).
RESTART_DELAY_S = 2.0


class EngineRestarts:
    """A thread that watches ``engines`` (the stack's list, updated in place) and
    replaces a process that exited with ``restart(index)``'s, within ``budget``."""

    def __init__(
        self,
        engines: list[subprocess.Popen[bytes]],
        restart: Callable[[int], subprocess.Popen[bytes]],
        budget: RestartBudget | None = None,
    ) -> None:
        self._engines = engines
        self._restart = restart
        self._budget = budget or RestartBudget()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: Restarts so far, per engine index.
        self.restarts: Counter[int] = Counter()
        #: Engine indices left down (they died too often).
        self.given_up: set[int] = set()
        # Engine index -> the monotonic time before which it is not started again.
        self._not_before: dict[int, float] = {}

    def start(self) -> None:
        """Start watching (once every engine has joined)."""
        self._thread = threading.Thread(
            target=self._watch, name="corewire-serve-engine-restarts", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before the stack stops its engines: they are not restarted)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            for index, proc in enumerate(self._engines):
                if proc.poll() is None or index in self.given_up:
                    continue
                if time.monotonic() < self._not_before.get(index, 0.0):
                    continue
                if not self._budget.spend(index):
                    self.given_up.add(index)
                    logger.error(
                        "engine %d exited (status %s) again after %d restarts within %g s: "
                        "left down; the group serves on without it",
                        index,
                        proc.returncode,
                        self._budget.limit,
                        self._budget.window_s,
                    )
                    continue
                logger.warning(
                    "engine %d exited (status %s): starting it again (it rejoins the API server)",
                    index,
                    proc.returncode,
                )
                self._not_before[index] = time.monotonic() + RESTART_DELAY_S
                try:
                    self._engines[index] = self._restart(index)
                except Exception as exc:  # the watch lives on; the next look tries again
                    logger.error("engine %d could not be started again: %s", index, exc)
                    continue
                self.restarts[index] += 1
