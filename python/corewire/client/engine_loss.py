"""What a data-parallel client does when one of its engines is lost.

A load-balancing client (:class:`~corewire.DPLBAsyncMPClient`) chooses with
``engine_loss=`` (or, for the clients vLLM's ``AsyncLLM`` builds through the plugin, the
environment variable :data:`ENGINE_LOSS_ENV`):

- ``"fail"``: vLLM's behaviour. Any engine's death is the whole client's: every caller
  gets :class:`~corewire.EngineDeadError`, and the owner must build a new client.
- ``"isolate"``: only the lost engine's work fails. Its requests end at once, as outputs
  with ``FinishReason.ERROR`` (:func:`lost_outputs`); what waited on it alone (a utility
  call to it, room in its input backlog) raises :class:`~corewire.EngineLostError`
  naming it; routing, health checks and calls to every engine leave it out from then on;
  the group serves on the others.
- ``"replace"`` (the default): ``"isolate"``, then the rank serves again:
  - an engine this client started: a new one is started for the rank (a local process,
    or a Ray actor with the Ray backend) and rejoins routing once it is ready. A rank
    replaced more than :data:`RESTART_LIMIT` times within :data:`RESTART_WINDOW_S`
    seconds stays isolated (:class:`RestartBudget`; said in the log and counted in
    ``corewire_engine_ranks_given_up_total``);
  - an engine the client only reaches (another host's ``corewire engine --connect``, the
    engines of ``scripts/serve``, vLLM's headless engines): its launcher starts it again
    and it rejoins: the client routes to it again once its ready message comes
    (``corewire engine --join-record PATH --rejoin`` rejoins a vLLM front-end);
  - an engine vLLM's launcher started in this process's group: it stays isolated (vLLM's
    launcher cannot start one rank again).

An engine the client only reaches is found lost by the health watchdog (it cannot be
killed: it stays out of routing, and what it sends later is ignored), or by a new engine
of its index connecting, which tells that the one before it is gone: its requests end as
a loss's, are aborted on the newcomer, and the newcomer is routed to.

The whole group still fails when no engine would be left, or where the engines are
coupled (``engines_coupled=True``: engines that run collectives together, such as vLLM's
expert-parallel engines, stop when a peer does); the client says so once in the log.

Requests the lost engine held are never sent again, not even those that streamed
nothing: an output the engine wrote before it died may still be on its way, so the
client cannot know that a request produced nothing; the front-end, which knows what it
streamed, decides (the error says ``retryable``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Collection
from typing import Any, Protocol

from corewire.protocol import FinishReason, finished_outputs
from corewire.releases import Release
from corewire.wire.layouts import RequestError
from corewire.wire.outputs import output_converter

__all__ = [
    "ENGINE_LOSS_ENV",
    "POLICIES",
    "RESTART_LIMIT",
    "RESTART_WINDOW_S",
    "LossClaims",
    "LossHook",
    "RestartBudget",
    "engine_loss_policy",
    "lost_outputs",
]

logger = logging.getLogger("corewire.client")

#: The environment variable that sets ``engine_loss`` where the client is built by vLLM
#: (the plugin), read when the client is made.
ENGINE_LOSS_ENV = "COREWIRE_ENGINE_LOSS"
#: The policies, the default first.
POLICIES = ("replace", "isolate", "fail")
#: Replacements of one rank allowed within :data:`RESTART_WINDOW_S` seconds.
RESTART_LIMIT = 3
#: The window of :data:`RESTART_LIMIT`, in seconds.
RESTART_WINDOW_S = 300.0
#: The ``code`` of the error a lost engine's requests end with (vLLM 0.33.0's layouts on).
LOST_CODE = "engine_lost"


def engine_loss_policy(value: str | None = None) -> str:
    """``value``, else :data:`ENGINE_LOSS_ENV`'s value, else ``"replace"``; a
    ``ValueError`` naming the choices for anything else."""
    source = "engine_loss"
    if value is None:
        value = os.environ.get(ENGINE_LOSS_ENV) or None
        source = ENGINE_LOSS_ENV
    if value is None:
        return POLICIES[0]
    policy = value.strip().lower()
    if policy not in POLICIES:
        raise ValueError(f"{source} must be one of {', '.join(POLICIES)}; got {value!r}")
    return policy


class RestartBudget:
    """At most ``limit`` replacements of one rank within ``window_s`` seconds (a rank
    that keeps dying, a bad GPU say, is given up instead of restarted forever)."""

    def __init__(self, limit: int = RESTART_LIMIT, window_s: float = RESTART_WINDOW_S) -> None:
        if limit < 0 or window_s <= 0:
            raise ValueError("a restart budget needs limit >= 0 and window_s > 0")
        self.limit = limit
        self.window_s = window_s
        self._spent: dict[int, collections.deque[float]] = {}

    def spend(self, rank: int, now: float | None = None) -> bool:
        """Take one replacement of ``rank`` from the budget; False when none is left."""
        now = time.monotonic() if now is None else now
        spent = self._spent.setdefault(rank, collections.deque())
        while spent and spent[0] <= now - self.window_s:
            spent.popleft()
        if len(spent) >= self.limit:
            return False
        spent.append(now)
        return True


class LossHook(Protocol):
    """What the engine monitor and the health watchdog ask of a client that may lose an
    engine and serve on (:attr:`ClientResources.engine_loss`); called on their threads."""

    def claim(self, index: int, reason: str) -> bool:
        """Whether the client takes the loss of engine ``index`` alone (recorded at once,
        so that a second loss is judged with the first one counted); False: the whole
        client dies, as before."""

    def lost(self, index: int) -> None:
        """Engine ``index``, claimed, is gone (its process reaped): end what it held."""


class LossClaims:
    """The engines claimed lost and not yet replaced, and why; safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: dict[int, str] = {}

    def claim(
        self, index: int, reason: str, engines: Collection[int], *, newcomer: bool = False
    ) -> bool:
        """Record ``index`` lost (the first reason stays) unless that would leave none of
        ``engines`` serving (``newcomer``: a new engine of ``index`` is there already, so
        it would not); True when ``index`` is (now, or already) claimed."""
        with self._lock:
            if index in self._reasons:
                return True
            if not newcomer and not any(e != index and e not in self._reasons for e in engines):
                return False
            self._reasons[index] = reason
            return True

    def reason(self, index: int) -> str | None:
        """Why ``index`` was claimed, or None when it is not."""
        return self._reasons.get(index)

    def release(self, index: int) -> None:
        """``index`` serves again (its replacement is ready)."""
        with self._lock:
            self._reasons.pop(index, None)

    def __contains__(self, index: object) -> bool:
        return index in self._reasons

    def __len__(self) -> int:
        return len(self._reasons)


def lost_outputs(request_ids: Collection[str], rank: int, reason: str, release: Release) -> Any:
    """The outputs that end ``request_ids`` of lost engine ``rank``, in ``release``'s
    layout: ``FinishReason.ERROR``, no tokens, listed as finished; where the layout has
    an ``error`` (vLLM 0.33.0 on), :data:`LOST_CODE`, the reason, retryable (vLLM's
    front-end then raises its ``GenerationError`` for them)."""
    outputs = finished_outputs(request_ids, FinishReason.ERROR, engine_index=rank)
    to_wire = output_converter(release)
    if to_wire is None:
        return outputs
    outputs = to_wire(outputs)
    error = RequestError(LOST_CODE, f"engine {rank} was lost: {reason}", True)
    for output in outputs.outputs:
        if hasattr(output, "error"):
            output.error = error
    return outputs
