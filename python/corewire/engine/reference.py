"""The reference engine: a small, real torch language model behind the Engine interface.

It exists so that corewire runs end to end on any machine (``corewire demo``, the tests,
the benchmarks) without downloading anything: a windowed MLP language model (embedding,
two residual MLP layers, vocabulary head) with random weights from a fixed seed, on CUDA
when available, else on the CPU. Each step runs ONE batched forward pass over every
running request. The model reads the last ``window`` tokens of each sequence, so there is
no KV cache to manage and a step over hundreds of requests stays cheap on a CPU.

Sampling follows vLLM's semantics for the parameters it honours: ``max_tokens``,
``min_tokens``, ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``seed``,
``stop_token_ids``, ``ignore_eos``, top-k ``logprobs`` (raw model logprobs, the sampled
token first) and ``prompt_logprobs`` (the same for each prompt token after the first, with
the request's first output). Pooling requests get the mean of the last layer's hidden
states.

Each request's first output carries vLLM's ``prefill_stats`` (every prompt token computed,
none cached: there is no prefix cache), from which vLLM's front-end counts prompt tokens
in its metrics. The utilities a client can call are bounded: ``delayed_echo`` shares one
timer thread and a capped backlog, ``profile`` writes only into the engine's own
directory and fails when it cannot write there. Fault hooks for tests are not part of
this engine (the project's tests subclass it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import math
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from corewire.engine.delayed import DelayedResults
from corewire.engine.interface import Engine, EngineInfo, prefill_stats
from corewire.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    PoolingParams,
    SamplingParams,
)

__all__ = ["ReferenceEngine", "TinyLM"]

_GREEDY_EPS = 1e-5
_SLEEP_TAGS = frozenset({"weights", "kv_cache"})
_U64 = (1 << 64) - 1
#: A step's batch is padded to a multiple of this many rows: BLAS takes other kernels for
#: small or ragged batches, whose sums round differently, so that a request's logits
#: (and logprobs) would depend on which others shared its step. Padded, a row's result
#: is the same in any batch (checked on x86-64 with one thread: every size from 1 to 299).
_ROW_BLOCK = 16


def _top_p_mask(probs: torch.Tensor, top_p: torch.Tensor, steps: int = 24) -> torch.Tensor:
    """Which tokens the nucleus keeps: the most probable ones whose mass reaches
    ``top_p`` (per row), i.e. ``probs >= t`` for the largest threshold ``t`` that still
    keeps that mass.

    Found by bisection on ``t`` instead of a full sort: ``steps`` masked sums over the
    vocabulary cost a fraction of sorting it on a CPU, and the result is the same set
    up to ties within ``max(probs) / 2**steps`` of the boundary.
    """
    lo = torch.zeros_like(top_p)  # invariant: mass(probs >= lo) >= top_p
    hi = probs.amax(dim=-1, keepdim=True)
    for _ in range(steps):
        mid = (lo + hi) * 0.5
        ok = (probs * (probs >= mid)).sum(dim=-1, keepdim=True) >= top_p
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    # The most probable token alone may already hold the mass.
    top_ok = (probs * (probs >= hi)).sum(dim=-1, keepdim=True) >= top_p
    return probs >= torch.where(top_ok, hi, lo)


def _check_file_prefix(prefix: str) -> None:
    """Refuse a profile prefix that would name a path instead of a file in the
    engine's own directory."""
    if (
        not isinstance(prefix, str)
        or not prefix
        or prefix in (".", "..")
        or os.path.basename(prefix) != prefix
        or "\x00" in prefix
        or (os.altsep is not None and os.altsep in prefix)
    ):
        raise ValueError(f"profile_prefix must be a file-name prefix, not a path: {prefix!r}")


class _Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """A small windowed MLP language model.

    The next token depends on the last ``window`` tokens: their embeddings are
    concatenated (so position matters), projected to ``d_model``, passed through
    ``num_layers`` residual MLP blocks, and projected to vocabulary logits. One row of
    work per sequence per step keeps a batch of hundreds cheap on a CPU, where a
    transformer re-reading its window would cost ``window`` times as much.
    """

    def __init__(self, vocab_size: int, d_model: int, num_layers: int, window: int) -> None:
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(vocab_size, d_model)
        self.in_proj = nn.Linear(window * d_model, d_model)
        self.blocks = nn.ModuleList(_Block(d_model) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def init_weights(self, seed: int) -> None:
        """Deterministic random weights: the same seed gives the same model anywhere."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if ".ln" in name or name.startswith("ln"):
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    param.zero_()
                elif name == "embed.weight":
                    param.copy_(torch.randn(param.shape, generator=gen))
                else:
                    # Unit-variance inputs stay unit-variance; the lm_head gets a std of
                    # about 3 on its logits: peaked enough for top-k / top-p to matter.
                    scale = 3.0 if name == "lm_head.weight" else 1.0
                    std = scale / math.sqrt(param.shape[1])
                    param.copy_(torch.randn(param.shape, generator=gen) * std)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[batch, d_model]`` for ``[batch, window]`` token ids."""
        x = self.in_proj(self.embed(tokens).flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, vocab]`` for ``[batch, window]`` token ids."""
        return self.lm_head(self.hidden(tokens))


class _Request:
    """Per-request state of the reference engine."""

    __slots__ = (
        "events",
        "generator",
        "ignore_eos",
        "logprobs",
        "max_tokens",
        "min_tokens",
        "num_output",
        "pooling",
        "prompt_len",
        "prompt_logprobs",
        "request_id",
        "stop_ids",
        "temperature",
        "tokens",
        "top_k",
        "top_p",
    )

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.num_output = 0
        self.max_tokens = 0
        self.min_tokens = 0
        self.temperature = 1.0
        self.top_k = 0
        self.top_p = 1.0
        self.generator: torch.Generator | None = None
        self.stop_ids: frozenset[int] = frozenset()
        self.ignore_eos = False
        self.logprobs: int | None = None
        self.prompt_logprobs: int | None = None
        self.pooling: PoolingParams | None = None
        self.events: list[EngineCoreEvent] | None = None


class _ReferenceWorker:
    """The single in-process "worker" that ``collective_rpc`` calls into."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self._engine = engine

    def echo(self, *args: Any) -> Any:
        """Return the arguments (one value as itself, several as a list)."""
        return args[0] if len(args) == 1 else list(args)

    def device(self) -> str:
        """The torch device the model runs on."""
        return str(self._engine.device)

    def dtype(self) -> str:
        """The model's parameter dtype."""
        return str(self._engine.dtype).removeprefix("torch.")

    def num_parameters(self) -> int:
        """Number of model parameters."""
        model = self._engine._model
        if model is None:
            raise RuntimeError("the model weights are discarded (sleep level 2)")
        return sum(p.numel() for p in model.parameters())

    def pid(self) -> int:
        """The worker's process id."""
        return os.getpid()


def _device_and_dtype(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """``device`` and ``dtype`` with "auto" resolved (CUDA and bfloat16 when there is a
    GPU); ``ValueError`` for a dtype that is not a torch floating-point type."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return device, torch_dtype


class ReferenceEngine(Engine):
    """Built-in engine: a tiny torch language model (see the module docstring).

    Arguments (all keyword, all optional, passed as ``engine_args``): ``device``
    ("auto" = CUDA when available, else CPU), ``dtype`` ("float32", "bfloat16",
    "float16", "auto" = bfloat16 on CUDA and float32 on CPU), ``max_batch`` (running
    requests per step), ``vocab_size``, ``d_model``, ``num_layers``,
    ``window`` (tokens the model reads), ``max_model_len``, ``eos_token_id``,
    ``pad_token_id``, ``seed`` (weights and the unseeded sampling stream),
    ``max_logprobs``, ``num_threads`` (torch CPU threads), ``step_delay`` (seconds slept
    per step, to emulate a slower model), ``record_events`` (QUEUED / SCHEDULED
    events on each request's first output) and ``profile_dir`` (where ``profile()``
    writes its traces; default: a private directory made on first use).

    Its ready response reports ``max_model_len`` and ``dtype`` as configured, one
    worker, and no KV cache (the model re-reads a window of tokens each step).
    """

    def __init__(
        self,
        *,
        device: str = "auto",
        dtype: str = "float32",
        max_batch: int = 256,
        vocab_size: int = 4096,
        d_model: int = 128,
        num_layers: int = 2,
        window: int = 8,
        max_model_len: int = 2048,
        eos_token_id: int = 2,
        pad_token_id: int = 0,
        seed: int = 0,
        max_logprobs: int = 20,
        num_threads: int | None = None,
        step_delay: float = 0.0,
        record_events: bool = False,
        profile_dir: str | None = None,
    ) -> None:
        device, torch_dtype = _device_and_dtype(device, dtype)
        for name, value in (("max_batch", max_batch), ("window", window)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 <= eos_token_id < vocab_size or not 0 <= pad_token_id < vocab_size:
            raise ValueError("eos_token_id and pad_token_id must be inside the vocabulary")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.dtype = torch_dtype
        self.vocab_size = vocab_size
        self.max_batch = max_batch
        self.window = window
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_logprobs = max_logprobs
        self.step_delay = step_delay
        self.record_events = record_events
        self._seed = seed
        self._model_shape = (vocab_size, d_model, num_layers, window)
        self._model: TinyLM | None = self._build_model()
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        self._arange_vocab = torch.arange(vocab_size, device=self.device)
        self._profile_dir = profile_dir
        self._init_scheduler_state()

    def _init_scheduler_state(self) -> None:
        """The request queues and the pause, sleep and profiling state (part of
        ``__init__``)."""
        self._requests: dict[str, _Request] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._pooling: list[_Request] = []
        self._num_steps = 0
        self._paused = False
        # pause_scheduler("wait"): the ids it waits for; requests added later are held.
        self._drain_ids: set[str] | None = None
        self._pause_waiters: list[concurrent.futures.Future] = []
        # Outputs owed outside a model pass (finishes of requests a pause aborted).
        self._pending_outputs: list[EngineCoreOutput] = []
        self._asleep: set[str] = set()
        self._sleep_level = 0
        self._profiler: Any = None
        self._profile_prefix: str | None = None
        # Pending delayed_echo replies: one thread for all of them, a capped backlog.
        self._delayed = DelayedResults("corewire-reference-delayed-echo")
        self._worker = _ReferenceWorker(self)

    def _build_model(self) -> TinyLM:
        model = TinyLM(*self._model_shape)
        model.init_weights(self._seed)
        return model.to(device=self.device, dtype=self.dtype).eval()

    # ------------------------------------------------------------------ Engine

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue a request; raises ``ValueError`` for one that cannot run."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already running")
        if request.resumable:
            raise ValueError("streaming input (resumable requests) is not supported")
        if request.prompt_token_ids is None:
            if request.prompt_embeds is not None:
                raise ValueError("the reference engine does not accept prompt_embeds")
            raise ValueError("request has no prompt_token_ids")
        # Length first: every other check (and the request's memory) grows with it.
        if len(request.prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt of {len(request.prompt_token_ids)} tokens exceeds max_model_len "
                f"{self.max_model_len}"
            )
        tokens = list(request.prompt_token_ids)
        vocab = self.vocab_size
        for t in tokens:
            if type(t) is not int or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        req = _Request(rid, tokens)
        if self.record_events:
            req.events = [EngineCoreEvent(EngineCoreEventType.QUEUED, time.monotonic())]
        if request.pooling_params is not None:
            if not tokens:
                raise ValueError("a pooling request needs at least one prompt token")
            dims = request.pooling_params.dimensions
            if dims is not None and not 1 <= dims <= self._model_shape[1]:
                raise ValueError(f"dimensions must be in [1, {self._model_shape[1]}], got {dims}")
            req.pooling = request.pooling_params
            self._requests[rid] = req
            self._pooling.append(req)
            return
        self._apply_sampling_params(req, request.sampling_params or SamplingParams())
        self._requests[rid] = req
        self._waiting.append(req)

    def _apply_sampling_params(self, req: _Request, sp: SamplingParams) -> None:
        if sp.temperature < 0 or not math.isfinite(sp.temperature):
            raise ValueError(f"temperature must be >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {sp.top_k}")
        room = self.max_model_len - len(req.tokens)
        if room < 1:
            raise ValueError(
                f"prompt of {len(req.tokens)} tokens leaves no room (max_model_len "
                f"{self.max_model_len})"
            )
        max_tokens = room if sp.max_tokens is None else sp.max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if sp.min_tokens < 0 or sp.min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {sp.min_tokens}")
        if sp.logprobs is not None and not 0 <= sp.logprobs <= self.max_logprobs:
            raise ValueError(f"logprobs must be in [0, {self.max_logprobs}], got {sp.logprobs}")
        if sp.prompt_logprobs is not None and not 0 <= sp.prompt_logprobs <= self.max_logprobs:
            raise ValueError(
                f"prompt_logprobs must be in [0, {self.max_logprobs}], got {sp.prompt_logprobs}"
            )
        req.max_tokens = max_tokens
        req.min_tokens = sp.min_tokens
        req.temperature = sp.temperature
        req.top_k = sp.top_k if 0 < sp.top_k < self.vocab_size else 0
        req.top_p = sp.top_p
        req.stop_ids = frozenset(sp.stop_token_ids or ())
        req.ignore_eos = sp.ignore_eos
        req.logprobs = sp.logprobs
        req.prompt_logprobs = sp.prompt_logprobs
        if sp.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(sp.seed & _U64)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests wherever they are (waiting, running or pooling)."""
        for rid in request_ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            for group in (self._running, self._pooling, self._waiting):
                try:
                    group.remove(req)
                    break
                except ValueError:
                    pass
        self._check_drained()

    def has_unfinished_requests(self) -> bool:
        """True when a step would make progress (False while paused or asleep)."""
        if self._pending_outputs:
            return True
        if self._paused or self._asleep:
            return False
        if self._drain_ids is not None:
            return bool(self._drain_ids)
        return bool(self._running or self._waiting or self._pooling)

    def engine_info(self) -> EngineInfo:
        """The configured ``max_model_len`` and dtype, one worker, no KV cache; a step
        runs up to ``max_batch`` requests and reads at most ``max_model_len`` tokens of
        one prompt at once (prompt logprobs), or ``max_batch`` new tokens."""
        return EngineInfo(
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            max_num_seqs=self.max_batch,
            max_num_batched_tokens=max(self.max_batch, self.max_model_len),
        )

    def scheduler_stats(self) -> dict[str, Any]:
        """Request counts and the number of steps taken, under the names of vLLM's
        ``SchedulerStats`` fields (vLLM drops keys it does not know)."""
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting) + len(self._pooling),
            "step_counter": self._num_steps,
        }

    def step(self) -> list[EngineCoreOutput]:
        """Answer pending pooling requests and advance every running request one token."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._paused or self._asleep:
            return outputs  # only the finishes of requests aborted by a pause
        if self.step_delay > 0:
            time.sleep(self.step_delay)
        self._num_steps += 1
        with torch.inference_mode():
            if self._pooling:
                outputs.extend(self._pool())
            self._admit()
            if self._running:
                outputs.extend(self._generate())
        self._check_drained()
        return outputs

    def _admit(self) -> None:
        """Move waiting requests into the running batch, up to ``max_batch`` (while a
        "wait" pause drains, only the requests it waits for)."""
        drain = self._drain_ids
        held: collections.deque[_Request] = collections.deque()
        while self._waiting and len(self._running) < self.max_batch:
            req = self._waiting.popleft()
            if drain is not None and req.request_id not in drain:
                held.append(req)
                continue
            if req.events is not None:
                req.events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, time.monotonic()))
            self._running.append(req)
        if held:
            held.extend(self._waiting)
            self._waiting = held

    def _check_drained(self) -> None:
        """Complete a "wait" pause once every request it waits for has left."""
        if self._drain_ids is None:
            return
        self._drain_ids.intersection_update(self._requests)
        if not self._drain_ids:
            self._drain_ids = None
            self._paused = True
            self._release_pause_waiters()

    def _release_pause_waiters(self) -> None:
        waiters, self._pause_waiters = self._pause_waiters, []
        for future in waiters:
            if future.set_running_or_notify_cancel():
                future.set_result(None)

    def shutdown(self) -> None:
        """Stop a running profiler and cancel pending delayed replies."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        self._delayed.close()
        waiters, self._pause_waiters = self._pause_waiters, []
        for future in waiters:
            future.cancel()

    # ------------------------------------------------------------------ model passes

    def _windows(self, reqs: list[_Request]) -> torch.Tensor:
        w, pad = self.window, self.pad_token_id
        flat: list[int] = []
        for req in reqs:
            last = req.tokens[-w:]
            if len(last) < w:
                flat.extend([pad] * (w - len(last)))
            flat.extend(last)
        return torch.tensor(flat, dtype=torch.long).view(len(reqs), w).to(self.device)

    def _generate(self) -> list[EngineCoreOutput]:
        reqs = self._running
        assert self._model is not None  # has_unfinished_requests() is False while asleep
        windows = self._windows(reqs)
        if pad := -len(reqs) % _ROW_BLOCK:
            windows = torch.cat([windows, windows[:1].expand(pad, -1)])
        logits = self._model(windows)[: len(reqs)].float()

        lp_rows = [i for i, r in enumerate(reqs) if r.logprobs is not None]
        # Raw logprobs, before min_tokens masking and temperature (vLLM's default mode).
        raw_lp = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        mask_rows: list[int] = []
        mask_cols: list[int] = []
        for i, r in enumerate(reqs):
            if r.num_output < r.min_tokens:
                banned = set(r.stop_ids)
                if not r.ignore_eos:
                    banned.add(self.eos_token_id)
                banned.intersection_update(range(self.vocab_size))
                mask_rows.extend([i] * len(banned))
                mask_cols.extend(banned)
        if mask_rows:
            logits[mask_rows, mask_cols] = -math.inf

        tokens = self._sample(reqs, logits)
        token_list: list[int] = tokens.tolist()
        logprobs = self._logprobs(reqs, lp_rows, raw_lp, tokens) if raw_lp is not None else {}

        outputs: list[EngineCoreOutput] = []
        still_running: list[_Request] = []
        for i, (req, tok) in enumerate(zip(reqs, token_list, strict=True)):
            req.tokens.append(tok)
            req.num_output += 1
            finish, stop_reason = self._check_stop(req, tok)
            out = EngineCoreOutput(
                req.request_id,
                [tok],
                new_logprobs=logprobs.get(i),
                finish_reason=finish,
                stop_reason=stop_reason,
                events=req.events,
            )
            if req.num_output == 1:
                out.prefill_stats = prefill_stats(req.prompt_len)
                if req.prompt_logprobs is not None:
                    out.new_prompt_logprobs_tensors = self._prompt_logprobs(req)
            req.events = None
            outputs.append(out)
            if finish is None:
                still_running.append(req)
            else:
                del self._requests[req.request_id]
        self._running = still_running
        return outputs

    def _check_stop(self, req: _Request, tok: int) -> tuple[FinishReason | None, int | None]:
        # Same order as vLLM: length caps first, then nothing before min_tokens, then eos,
        # then the request's stop tokens.
        if req.num_output >= req.max_tokens or len(req.tokens) >= self.max_model_len:
            return FinishReason.LENGTH, None
        if req.num_output < req.min_tokens:
            return None, None
        if not req.ignore_eos and tok == self.eos_token_id:
            return FinishReason.STOP, None
        if tok in req.stop_ids:
            return FinishReason.STOP, tok
        return None, None

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        temps_list = [r.temperature for r in reqs]
        if all(t < _GREEDY_EPS for t in temps_list):
            return greedy_tokens
        dev = self.device
        temps = torch.tensor(temps_list, device=dev)
        greedy = temps < _GREEDY_EPS
        scaled = logits / torch.where(greedy, 1.0, temps).unsqueeze(1)

        kmax = max(r.top_k for r in reqs)
        if kmax:
            # Keep logits >= each row's k-th largest (rows without top_k keep all).
            top_vals = scaled.topk(kmax, dim=-1).values
            ks = torch.tensor([r.top_k or kmax for r in reqs], device=dev)
            threshold = top_vals.gather(1, (ks - 1).unsqueeze(1))
            off = torch.tensor([r.top_k == 0 for r in reqs], device=dev).unsqueeze(1)
            scaled = scaled.masked_fill((scaled < threshold) & ~off, -math.inf)
        p_rows = [i for i, r in enumerate(reqs) if r.top_p < 1]
        if p_rows:
            sub = scaled[p_rows]
            keep = _top_p_mask(
                torch.softmax(sub, dim=-1),
                torch.tensor([reqs[i].top_p for i in p_rows], device=dev).unsqueeze(1),
            )
            scaled[p_rows] = sub.masked_fill(~keep, -math.inf)

        # Inverse-CDF sampling with one uniform draw per request: a seeded request draws
        # from its own generator, so its tokens do not depend on the rest of the batch.
        cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
        uniform = torch.rand(len(reqs), generator=self._rng, device=dev)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                uniform[i] = torch.rand(1, generator=r.generator, device=dev)[0]
        targets = (uniform * cdf[:, -1]).unsqueeze(1)
        sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1)
        sampled = sampled.clamp_(max=self.vocab_size - 1)
        return torch.where(greedy, greedy_tokens, sampled)

    def _logprobs(
        self,
        reqs: list[_Request],
        rows: list[int],
        raw_lp: torch.Tensor,
        tokens: torch.Tensor,
    ) -> dict[int, LogprobsLists]:
        sampled = tokens[rows].unsqueeze(1)
        sampled_lp = raw_lp.gather(1, sampled)
        ranks = ((raw_lp > sampled_lp).sum(dim=-1) + 1).to(torch.int32).cpu().numpy()
        kmax = max(reqs[i].logprobs or 0 for i in rows)
        ids, vals = sampled, sampled_lp
        if kmax:
            top_lp, top_ids = raw_lp.topk(kmax, dim=-1)
            ids = torch.cat([sampled, top_ids], dim=1)
            vals = torch.cat([sampled_lp, top_lp], dim=1)
        ids_np = ids.to(torch.int32).cpu().numpy()
        vals_np = vals.to(torch.float32).cpu().numpy()
        result: dict[int, LogprobsLists] = {}
        for j, i in enumerate(rows):
            k = reqs[i].logprobs or 0
            result[i] = LogprobsLists(
                np.ascontiguousarray(ids_np[j : j + 1, : k + 1]),
                np.ascontiguousarray(vals_np[j : j + 1, : k + 1]),
                ranks[j : j + 1].copy(),
                None,
            )
        return result

    def _prompt_logprobs(self, req: _Request) -> LogprobsTensors:
        """vLLM's prompt logprobs, sent with a request's first output: one row per prompt
        token after the first (the model's raw logprob of that token given the tokens
        before it, then the top ``prompt_logprobs``), and each token's rank."""
        assert self._model is not None
        prompt = req.tokens[: req.prompt_len]
        w, k = self.window, req.prompt_logprobs or 0
        padded = [self.pad_token_id] * (w - 1) + prompt
        # Row j predicts prompt[j + 1] from the window that ends at prompt[j].
        flat = [t for j in range(len(prompt) - 1) for t in padded[j : j + w]]
        dev = self.device
        if not flat:
            empty = torch.zeros((0, k + 1))
            return LogprobsTensors(empty.long(), empty, torch.zeros(0, dtype=torch.long))
        windows = torch.tensor(flat, dtype=torch.long).view(-1, w).to(dev)
        raw_lp = torch.log_softmax(self._model(windows).float(), dim=-1)
        actual = torch.tensor(prompt[1:], dtype=torch.long, device=dev).unsqueeze(1)
        actual_lp = raw_lp.gather(1, actual)
        ranks = (raw_lp > actual_lp).sum(dim=-1) + 1
        ids, vals = actual, actual_lp
        if k:
            top_lp, top_ids = raw_lp.topk(k, dim=-1)
            ids = torch.cat([actual, top_ids], dim=1)
            vals = torch.cat([actual_lp, top_lp], dim=1)
        return LogprobsTensors(ids.cpu(), vals.cpu(), ranks.cpu())

    def _pool(self) -> list[EngineCoreOutput]:
        """Embed pending pooling requests: the mean of the hidden state after every
        prompt token, in one forward pass over all their positions."""
        drain = self._drain_ids
        if drain is None:
            reqs, self._pooling = self._pooling, []
        else:
            reqs = [r for r in self._pooling if r.request_id in drain]
            self._pooling = [r for r in self._pooling if r.request_id not in drain]
            if not reqs:
                return []
        assert self._model is not None
        w, pad = self.window, self.pad_token_id
        flat: list[int] = []
        owner: list[int] = []
        for n, req in enumerate(reqs):
            padded = [pad] * (w - 1) + req.tokens
            for end in range(w, len(padded) + 1):
                flat.extend(padded[end - w : end])
            owner.extend([n] * len(req.tokens))
        dev = self.device
        tokens = torch.tensor(flat, dtype=torch.long).view(-1, w).to(dev)
        hidden = self._model.hidden(tokens).float()
        index = torch.tensor(owner, device=dev)
        sums = torch.zeros(len(reqs), hidden.shape[-1], device=dev).index_add_(0, index, hidden)
        counts = torch.tensor([len(r.tokens) for r in reqs], device=dev, dtype=torch.float32)
        means = (sums / counts.unsqueeze(1)).cpu()
        outputs = []
        for n, req in enumerate(reqs):
            params = req.pooling
            assert params is not None
            emb = means[n, : params.dimensions] if params.dimensions else means[n]
            if params.normalize is not False:
                emb = F.normalize(emb, dim=0)
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    [],
                    pooling_output=emb.clone(),
                    finish_reason=FinishReason.STOP,
                    events=req.events,
                    prefill_stats=prefill_stats(req.prompt_len),
                )
            )
            del self._requests[req.request_id]
        return outputs

    # ------------------------------------------------------------------ utilities

    def get_supported_tasks(self) -> list[str]:
        """Tasks this engine serves."""
        return ["generate", "embed"]

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker (here: the one in-process worker) and return
        the results as a list. The single worker runs inline, so ``timeout`` is checked
        when the call returns: a call that overran it raises ``TimeoutError``."""
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc needs a public worker method name, got {method!r}")
        fn = getattr(self._worker, method, None)
        if fn is None:
            raise AttributeError(f"worker has no method {method!r}")
        start = time.monotonic()
        result = fn(*(args or ()), **(kwargs or {}))
        if timeout is not None and time.monotonic() - start > timeout:
            raise TimeoutError(f"collective_rpc {method!r} took longer than {timeout} s")
        return [result]

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """There is no prefix cache (each step re-reads its window); always succeeds."""
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> concurrent.futures.Future | None:
        """Sleep as vLLM's engines do: pause the scheduler with ``mode`` (see
        :meth:`pause_scheduler`), then release the model: level 0 releases nothing
        (a pause only), level 1 moves the weights to host memory (on CUDA), level 2
        discards them (rebuilt from the seed on wake-up). With ``mode="wait"`` the
        reply waits until the requests in flight finished and the model is released."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        paused = self.pause_scheduler(mode, clear_cache=level >= 1)
        if level == 0:
            return paused
        if paused is None:
            self._release_model(level)
            return None
        slept: concurrent.futures.Future = concurrent.futures.Future()

        def _then_release(done: concurrent.futures.Future) -> None:
            if not slept.set_running_or_notify_cancel():
                return
            try:
                done.result()
                self._release_model(level)
            except BaseException as exc:  # a cancelled pause cancels the sleep reply
                slept.set_exception(exc)
            else:
                slept.set_result(None)

        paused.add_done_callback(_then_release)
        return slept

    def _release_model(self, level: int) -> None:
        if self._asleep:
            return
        if level == 2:
            self._model = None
        elif self.device.type != "cpu" and self._model is not None:
            self._model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._sleep_level = level
        self._asleep = set(_SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep() released: ``tags`` among "weights" and "kv_cache"
        (None = all); "scheduling" alone wakes nothing. Once nothing is asleep the
        scheduler resumes (vLLM's behaviour: a sleep's pause ends with the sleep)."""
        wanted = set(_SLEEP_TAGS if tags is None else tags) - {"scheduling"}
        unknown = wanted - _SLEEP_TAGS
        if unknown:
            raise ValueError(f"unknown wake-up tags {sorted(unknown)}")
        if "weights" in wanted and "weights" in self._asleep:
            if self._model is None:
                self._model = self._build_model()
            else:
                self._model.to(self.device)
        self._asleep -= wanted
        if not self._asleep:
            self.resume_scheduler()

    def is_sleeping(self) -> bool:
        """Whether the scheduler is paused or any part of the model is asleep (vLLM
        counts a level-0 sleep, a pause, as sleeping)."""
        return self.is_scheduler_paused() or bool(self._asleep)

    def pause_scheduler(
        self, mode: str = "keep", clear_cache: bool = False
    ) -> concurrent.futures.Future | None:
        """Stop scheduling; requests that arrive meanwhile queue until resume_scheduler().

        ``mode`` says what happens to the requests in flight: "keep" freezes them where
        they are; "abort" finishes them all now with ``FinishReason.ABORT``; "wait" lets
        every request held at the time of the call (running or queued) run to completion
        and returns a future that resolves once they did (the utility reply waits for
        it). ``clear_cache`` is accepted for compatibility: there
        is no cache to clear.
        """
        if mode == "keep":
            self._paused = True
        elif mode == "abort":
            for req in [*self._running, *self._waiting, *self._pooling]:
                self._pending_outputs.append(
                    EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ABORT)
                )
            self._running, self._pooling = [], []
            self._waiting.clear()
            self._requests.clear()
            self._paused = True
            self._check_drained()
        elif mode == "wait":
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._pause_waiters.append(future)
            if self._drain_ids is None:
                self._drain_ids = set() if self._paused else set(self._requests)
            self._check_drained()
            return future
        else:
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        return None

    def resume_scheduler(self) -> None:
        """Schedule again after pause_scheduler() (a pending "wait" pause resolves)."""
        self._paused = False
        self._drain_ids = None
        self._release_pause_waiters()

    def is_scheduler_paused(self) -> bool:
        """Whether a pause was requested and not resumed (a "wait" pause counts from the
        moment it was asked for)."""
        return self._paused or self._drain_ids is not None

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> str | None:
        """Start (``is_start``) or stop a torch profiler; stopping writes a Chrome trace
        and returns the file's path.

        As with vLLM, ``profile_prefix`` (given when starting or stopping) is a file-name
        prefix, never a path: traces are written only into the engine's ``profile_dir``
        (a private directory made on first use when none was configured).
        """
        if profile_prefix is not None:
            _check_file_prefix(profile_prefix)
        if is_start:
            if self._profiler is not None:
                raise RuntimeError("the profiler is already running")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # One profiler object per start/stop pair: there is a single cycle, so
            # keeping events "across cycles" changes nothing (and avoids torch's warning).
            profiler = torch.profiler.profile(activities=activities, acc_events=True)
            profiler.start()
            self._profiler = profiler
            self._profile_prefix = profile_prefix
            return None
        if self._profiler is None:
            raise RuntimeError("the profiler is not running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if self._profile_dir is None:
            self._profile_dir = tempfile.mkdtemp(prefix="corewire-profile-")
        prefix = profile_prefix or self._profile_prefix or "corewire-engine-trace"
        target = os.path.join(self._profile_dir, f"{prefix}-{os.getpid()}-{time.time_ns()}.json")
        profiler.export_chrome_trace(target)
        # torch logs a failed write and returns as if it had written: check the file.
        if not os.path.isfile(target) or os.path.getsize(target) == 0:
            raise OSError("could not write the profiler trace into the profile directory")
        return target

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        """One map per worker (here one): each parameter's name -> the sha256 hex digest
        of its bytes, as vLLM's workers digest theirs (to verify a weight update). A
        vLLM 0.33.0 front-end gets them keyed by rank too (the engine core adds that)."""
        if self._model is None:
            raise RuntimeError("the weights were discarded by sleep(level=2); wake_up first")
        return [
            {
                name: hashlib.sha256(
                    param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                ).hexdigest()
                for name, param in self._model.named_parameters()
            }
        ]

    def echo(self, x: Any) -> Any:
        """Return ``x`` (the cheapest round trip, for benchmarks and health checks)."""
        return x

    def delayed_echo(self, x: Any, delay: float) -> concurrent.futures.Future:
        """Return ``x`` after ``delay`` seconds without blocking the engine (the reply
        waits on a future): a slow utility call for tests and demos. ``delay`` is a
        number of seconds in [0, 3600]; at most 1024 replies wait at once, all on one
        thread."""
        return self._delayed.schedule(x, delay)
