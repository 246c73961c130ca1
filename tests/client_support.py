"""Engines that misbehave on purpose, and requests, for the client, fault and DP tests.

Everything here is importable in a spawned engine process: ``multiprocessing``'s spawn
start method gives the child the parent's ``sys.path``, which holds ``tests/`` under
pytest, so ``engine_main="client_support:run_support_engine"`` and
``engine="client_support:FailingEngine"`` resolve in the child.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from corewire.engine.interface import Engine
from corewire.engine.replay import EngineLink, ReplayEngine
from corewire.engine.synthetic import SyntheticEngine
from corewire.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    UtilityOutput,
    UtilityResult,
)

REPLAY = "corewire.engine.replay:run_replay_engine"
SUPPORT = "client_support:run_support_engine"
NEVER_READY = "client_support:run_never_ready"
CRASH_ON_START = "client_support:run_crash_on_start"

#: Malformed output frames by name (each a full multipart message).
GARBAGE: dict[str, list[bytes]] = {
    "not_msgpack": [b"\xc1\xc1\xc1 definitely not msgpack"],
    "truncated": [msgspec.msgpack.encode([0, [["req", [1, 2, 3]]]])[:-3]],
    "wrong_type": [msgspec.msgpack.encode([0, "outputs should be an array"])],
    "aux_out_of_range": [
        msgspec.msgpack.encode(
            [0, [["req", [1], None, None, ["float32", [64], 5]]], None, 0.0, None, None]
        )
    ],
    "trailing_bytes": [msgspec.msgpack.encode([0, []]) + b"\x00"],
}


class SupportEngine(ReplayEngine):
    """A replay engine with utility methods that block, lie and break the protocol."""

    def __init__(self, link: EngineLink, step_delay: float = 0.0) -> None:
        super().__init__(link, step_delay)
        self.embed_sums: list[float] = []

    def add(self, request: EngineCoreRequest) -> None:
        """Also records the sum of the request's ``prompt_embeds``."""
        if request.prompt_embeds is not None:
            self.embed_sums.append(float(request.prompt_embeds.double().sum()))
        super().add(request)

    def utility_block(self, seconds: float) -> float:
        """Hold the engine loop (no reply to anything) for ``seconds``."""
        time.sleep(seconds)
        return seconds

    def utility_embed_sums(self) -> list[float]:
        """Sums of the ``prompt_embeds`` received so far."""
        return self.embed_sums

    def utility_garbage(self, kind: str, then_value: Any = None) -> Any:
        """After the reply, push the malformed frame ``kind``."""
        frames = GARBAGE[kind]
        self._after_reply = lambda: self.link.outputs.send_multipart(frames)
        return then_value

    def utility_unreadable_reply(self) -> Any:
        """Reply with a value no decoder accepts (an unknown msgpack extension type)."""
        return msgspec.msgpack.Ext(99, b"boom")

    def utility_notify(self, kind: str, rank: int) -> None:
        """After the reply, push an elastic-scaling notification (call_id -1)."""
        note = EngineCoreOutputs(
            utility_output=UtilityOutput(call_id=-1, result=UtilityResult([kind, rank]))
        )
        self._after_reply = lambda: self.link.push(note)

    def utility_stray_replies(self, call_ids: list[int]) -> None:
        """After the reply, answer calls nobody made (unknown and duplicate ids)."""
        self._after_reply = lambda: [self.link.reply(i, "stray") for i in call_ids]

    def utility_stats(self, waiting: int) -> None:
        """After the reply, push outputs holding only scheduler stats, and an empty
        message that must not reach the output queue."""

        def push() -> None:
            self.link.push(EngineCoreOutputs(scheduler_stats={"num_waiting_reqs": waiting}))
            self.link.push(EngineCoreOutputs(finished_requests={"gone"}))

        self._after_reply = push

    def utility_die(self) -> None:
        """After the reply, send ENGINE_CORE_DEAD and exit with status 1."""

        def die() -> None:
            self.link.outputs.send(ENGINE_CORE_DEAD)
            time.sleep(0.2)
            os._exit(1)

        self._after_reply = die


def run_support_engine(
    *,
    engine_index: int,
    input_address: str,
    output_address: str,
    engine_args: dict[str, Any] | None = None,
    parent_pid: int | None = None,
    **_: Any,
) -> None:
    """Process target running a :class:`SupportEngine`."""
    link = EngineLink(engine_index, input_address, output_address, parent_pid)
    try:
        SupportEngine(link, **(engine_args or {})).serve()
    finally:
        link.close()


def run_never_ready(
    *, engine_index: int, input_address: str, output_address: str, **_: Any
) -> None:
    """Process target that connects but never sends its ready message."""
    link = EngineLink(engine_index, input_address, output_address)
    try:
        time.sleep(600)
    finally:
        link.close()


def run_crash_on_start(**_: Any) -> None:
    """Process target that fails before connecting."""
    raise RuntimeError("engine failed to start (on purpose)")


class FailingEngine(Engine):
    """An :class:`corewire.engine.Engine` whose ``step()`` raises after ``fail_after``
    steps (run through ``corewire.engine.launch.run_engine_core``)."""

    def __init__(self, fail_after: int = 2) -> None:
        self.fail_after = fail_after
        self.steps = 0
        self.running: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request."""
        self.running.append(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget requests."""
        self.running = [r for r in self.running if r not in request_ids]

    def has_unfinished_requests(self) -> bool:
        """Whether any request runs."""
        return bool(self.running)

    def step(self) -> list[EngineCoreOutput]:
        """One token per request, until the injected failure."""
        self.steps += 1
        if self.steps > self.fail_after:
            raise RuntimeError("step failed (on purpose)")
        return [EngineCoreOutput(r, [self.steps]) for r in self.running]

    def echo(self, x: Any) -> Any:
        """Returns ``x``."""
        return x


class BrokenEngine(FailingEngine):
    """An engine whose constructor raises."""

    def __init__(self) -> None:
        raise RuntimeError("engine constructor failed (on purpose)")


class SlowStartEngine(SyntheticEngine):
    """corewire's synthetic engine that takes ``start_s`` seconds to build (a replacement
    still starting when the next fault strikes)."""

    def __init__(self, start_s: float = 2.0, **kwargs: Any) -> None:
        time.sleep(start_s)
        super().__init__(**kwargs)


#: ``sampling`` for :func:`request` that restores ``SamplingParams``' own defaults (vLLM's)
#: under its greedy ones: a request like one built from ``SamplingParams(**fields)``.
DEFAULT_SAMPLING: dict[str, Any] = {
    name: getattr(SamplingParams(), name) for name in ("max_tokens", "temperature", "ignore_eos")
}


def request(
    request_id: str,
    max_tokens: int | None = 4,
    rank: int | None = None,
    *,
    prompt: Sequence[int] = (1, 2, 3),
    sampling: Mapping[str, Any] | None = None,
    **fields: Any,
) -> EngineCoreRequest:
    """The suite's one request builder: a greedy generation request on ``prompt`` that
    runs exactly ``max_tokens`` steps (it ignores EOS), for the data-parallel rank
    ``rank`` when one is given.

    ``sampling`` are further ``SamplingParams`` fields, over those three defaults
    (``{"temperature": 1.0}`` samples; :data:`DEFAULT_SAMPLING` brings back vLLM's own);
    ``fields`` are further ``EngineCoreRequest`` fields.
    """
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**{**params, **(sampling or {})}),
        data_parallel_rank=rank,
        **fields,
    )


def finished(outputs: EngineCoreOutputs) -> list[str]:
    """Ids of the requests that finished in ``outputs``."""
    return [o.request_id for o in outputs.outputs if o.finish_reason is not None]


__all__ = [
    "CRASH_ON_START",
    "DEFAULT_SAMPLING",
    "GARBAGE",
    "NEVER_READY",
    "REPLAY",
    "SUPPORT",
    "BrokenEngine",
    "FailingEngine",
    "SupportEngine",
    "finished",
    "request",
    "run_support_engine",
]
