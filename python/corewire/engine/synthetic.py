"""A model-free engine for front-end benchmarks: tokens at the speed of the loop.

:class:`SyntheticEngine` honours what a front-end's output path depends on (``max_tokens``,
``min_tokens``, ``stop_token_ids``, the EOS token unless ``ignore_eos``, top-k
``logprobs``, aborts) but computes no model: each request's tokens follow a fixed,
prompt-seeded sequence, and logprobs are made up yet well-formed (descending values, the
sampled token first with its rank), and each request's first output carries vLLM's
``prefill_stats`` (its prompt tokens, none cached). Every running request gets one token
per step, so the
engine streams as fast as the front-end takes its outputs, or one step per ``step_delay``
seconds. Use it with ``corewire engine --engine corewire.engine.synthetic:SyntheticEngine``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from corewire.engine.interface import Engine, EngineInfo, prefill_stats
from corewire.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)

__all__ = ["SyntheticEngine"]

# Multiplier of the token sequence: coprime with any vocabulary size that is a power of two
# or a small multiple of one, so a request walks through the whole vocabulary.
_STRIDE = 7919


class _Running:
    __slots__ = (
        "eos",
        "logprobs",
        "max_tokens",
        "min_tokens",
        "produced",
        "prompt_len",
        "request_id",
        "stops",
        "token",
    )

    def __init__(self, request_id: str, token: int, prompt_len: int) -> None:
        self.request_id = request_id
        self.token = token
        self.prompt_len = prompt_len
        self.produced = 0
        self.max_tokens = 16
        self.min_tokens = 0
        self.stops: frozenset[int] = frozenset()
        self.eos: int | None = None
        self.logprobs = 0


class SyntheticEngine(Engine):
    """Streams made-up tokens without a model (see the module docstring).

    Parameters: ``vocab_size`` (token ids are below it), ``eos_token_id``,
    ``first_token_id`` (ids below it, special tokens, are never produced),
    ``max_model_len``, ``max_batch`` (requests running at once; more wait), and
    ``step_delay`` (seconds per step; 0 = as fast as possible).
    """

    def __init__(
        self,
        *,
        vocab_size: int = 4096,
        eos_token_id: int = 2,
        first_token_id: int = 4,
        max_model_len: int = 2048,
        max_batch: int = 1024,
        step_delay: float = 0.0,
    ) -> None:
        if not 0 <= first_token_id < vocab_size:
            raise ValueError("first_token_id must be inside the vocabulary")
        if max_batch < 1 or max_model_len < 2 or step_delay < 0:
            raise ValueError("max_batch >= 1, max_model_len >= 2 and step_delay >= 0 required")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.first_token_id = first_token_id
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.step_delay = step_delay
        self._running: dict[str, _Running] = {}
        self._waiting: dict[str, _Running] = {}
        self._next_step = 0.0
        self._span = vocab_size - first_token_id

    def engine_info(self) -> EngineInfo:
        """No KV cache; the configured length limit; ``max_batch`` requests per step,
        one token each."""
        return EngineInfo(
            max_model_len=self.max_model_len,
            dtype="float32",
            max_num_seqs=self.max_batch,
            max_num_batched_tokens=self.max_batch,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a generate request; pooling and bad prompts are refused."""
        prompt = request.prompt_token_ids
        if request.sampling_params is None or not prompt:
            raise ValueError("SyntheticEngine serves generate requests with prompt token ids")
        if request.request_id in self._running or request.request_id in self._waiting:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.resumable:
            raise ValueError("streaming input (resumable requests) is not supported")
        sp = request.sampling_params
        # Length before the per-token check, whose cost grows with it.
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_model_len")
        if any(type(t) is not int or not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        req = _Running(request.request_id, sum(prompt) % self._span, len(prompt))
        req.max_tokens = min(sp.max_tokens if sp.max_tokens is not None else room, room)
        req.min_tokens = sp.min_tokens
        req.stops = frozenset(sp.stop_token_ids or ())
        req.eos = None if sp.ignore_eos else self.eos_token_id
        req.logprobs = sp.logprobs or 0
        if req.logprobs < 0:
            req.logprobs = self.vocab_size  # -1: the whole vocabulary, as vLLM allows
        req.logprobs = min(req.logprobs, self.vocab_size - 1)
        self._waiting[req.request_id] = req

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget these requests (unknown ids are ignored)."""
        for request_id in request_ids:
            self._running.pop(request_id, None)
            self._waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self._running or self._waiting)

    def scheduler_stats(self) -> dict[str, Any]:
        """Running and waiting counts, as vLLM's ``SchedulerStats`` names them."""
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting)}

    def step(self) -> list[EngineCoreOutput]:
        """One token for every running request."""
        if self.step_delay:
            now = time.monotonic()
            if now < self._next_step:
                time.sleep(self._next_step - now)
            self._next_step = max(now, self._next_step) + self.step_delay
        while self._waiting and len(self._running) < self.max_batch:
            request_id = next(iter(self._waiting))
            self._running[request_id] = self._waiting.pop(request_id)
        outputs = []
        finished = []
        for req in self._running.values():
            req.token = (req.token * _STRIDE + 1) % self._span
            token = self.first_token_id + req.token
            req.produced += 1
            reason: FinishReason | None = None
            stop_reason: int | None = None
            if req.produced >= req.min_tokens and (token in req.stops or token == req.eos):
                reason = FinishReason.STOP
                stop_reason = token if token in req.stops else None
            elif req.produced >= req.max_tokens:
                reason = FinishReason.LENGTH
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    new_logprobs=self._logprobs(token, req.logprobs) if req.logprobs else None,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    prefill_stats=prefill_stats(req.prompt_len) if req.produced == 1 else None,
                )
            )
            if reason is not None:
                finished.append(req.request_id)
        for request_id in finished:
            del self._running[request_id]
        return outputs

    def _logprobs(self, token: int, k: int) -> LogprobsLists:
        # Sampled token first, then k "top" tokens: the sampled one ranked 1 among them.
        ids = np.empty((1, k + 1), dtype=np.int32)
        ids[0, 0] = token
        ids[0, 1:] = (token + np.arange(k, dtype=np.int32)) % self.vocab_size
        values = -np.arange(k + 1, dtype=np.float32)[np.newaxis, :] / 4  # top j: -j/4
        values[0, 0] = values[0, 1]  # the sampled token is the top one
        return LogprobsLists(ids, values, np.ones(1, dtype=np.int32), None)
