"""Differential testing of an output processor against the installed vLLM's own
``OutputProcessor`` (0.25.1, 0.34.0).

The pieces, each usable alone:

- tokenizers: :func:`write_bpe_tokenizer_dir` trains a small byte-level BPE at test time
  on generated text mixing ASCII, accented Latin, Greek, CJK and emoji (so that many
  characters are split across tokens), with special and added tokens, and saves it as a
  ``PreTrainedTokenizerFast`` directory; :func:`load_tokenizer` loads a directory the way
  vLLM's front-end does (its tokenizer registry, then the renderer's thread pool), which is
  the object ``AsyncLLM`` hands to its output processor. :class:`TokenizerInfo` adds what
  the workload needs to know about it (special ids, ids whose single-id decode ends in
  U+FFFD, a text source).
- a workload: :class:`EngineSim` plays the engine for a seed. It plans client requests
  (real ``EngineCoreRequest`` / ``SamplingParams``; n > 1 through ``ParentRequest`` as
  ``AsyncLLM`` adds them) and emits engine steps as plain data (:class:`OutputSpec`),
  which :func:`make_output` turns into fresh vLLM ``EngineCoreOutput`` objects for each
  processor (the collectors mutate what they are given, so the two sides never share one).
- a driver: :class:`Side` is one processor with its own collectors; :class:`Pair` feeds a
  reference side (vLLM's class) and a candidate side the same and compares, after every
  action, the drained ``RequestOutput`` snapshots (:func:`snapshot`), ``reqs_to_abort``,
  the ``IterationStats`` (lists as multisets), the LoRA scheduler stats and the
  unfinished counts; :func:`run_workload` runs an :class:`EngineSim` through a pair.

What a later release added is exercised where the installed vLLM has it (read off its own
classes, as :data:`FEATURES`): each step's ``weight_version`` (changing now and then),
watermarked requests (their first output's ``watermarking``), ``prompt_logprob_start``,
and a request's own ``stream_interval``.

Nothing here mocks vLLM: the processors, collectors, stats and output classes are vLLM's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from vllm.logprobs import FlatLogprobs
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.metrics.stats import IterationStats, PrefillStats, SchedulerStats
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

__all__ = [
    "ADDED_TOKENS",
    "FEATURES",
    "KINDS",
    "SPECIAL_TOKENS",
    "ClientPlan",
    "EngineSim",
    "LogprobsSpec",
    "OutputSpec",
    "Pair",
    "Side",
    "TokenizerInfo",
    "WorkloadResult",
    "expected_native",
    "load_tokenizer",
    "make_output",
    "processor_goes_native",
    "run_workload",
    "snapshot",
    "write_bpe_tokenizer_dir",
]


#: What the installed vLLM's classes offer beyond 0.25.1's, read off those classes:
#: ``weight_version`` (``process_outputs`` takes each step's), ``watermarking`` (requests
#: ask for it), ``watermark_report`` (0.34.0: their first output reports it),
#: ``prompt_logprob_start`` (0.34.0: the prompt logprobs padded before it),
#: ``stream_interval`` (per request).
def _pads_prompt_logprobs() -> bool:
    # vLLM's own processor asked: do positions before prompt_logprob_start start the
    # prompt logprobs as None (0.34.0), or does the container start as before (0.33.0
    # has the parameter, its processor not the padding)?
    from types import SimpleNamespace

    from vllm.v1.engine.logprobs import LogprobsProcessor

    try:
        params = SamplingParams(prompt_logprobs=1, prompt_logprob_start=2)
    except TypeError:
        return False
    made = LogprobsProcessor.from_new_request(None, SimpleNamespace(sampling_params=params))
    return made.prompt_logprobs is not None and len(made.prompt_logprobs) == 3


FEATURES = (
    frozenset(
        {f.name for f in msgspec.structs.fields(SamplingParams)}
        & {"watermarking", "stream_interval"}
    )
    | ({"prompt_logprob_start"} if _pads_prompt_logprobs() else set())
    | {
        feature
        for feature, struct, field in (
            ("weight_version", EngineCoreOutputs, "weight_version"),
            ("watermark_report", EngineCoreOutput, "watermarking"),
        )
        if field in {f.name for f in msgspec.structs.fields(struct)}
    }
)

KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)

# ids 0-3 of the trained tokenizer, in this order; the first is its eos.
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Added but not special: `spaces_between_special_tokens` treats it like the specials.
ADDED_TOKENS = ("<tool>",)

_REPLACEMENT = "\ufffd"


# ---------------------------------------------------------------------------------------
# Text and tokenizers


_ASCII = ["ka", "lo", "mi", "ne", "ra", "tu", "si", "ve", "pa", "do", "ri", "fu", "the", "an"]
_LATIN = list("éèêàçñöüøåßłő")
_GREEK = [chr(c) for c in range(0x3B1, 0x3CA)]  # the small letters
# Spread over the blocks so that most characters are rare: BPE leaves them split in bytes.
_CJK = [chr(0x4E00 + i * 37) for i in range(400)]
_EMOJI = [chr(0x1F300 + i * 3) for i in range(120)] + ["❤️", "👍🏽"]
_SCRIPTS = ((_ASCII, 6), (_LATIN, 3), (_GREEK, 2), (_CJK, 2), (_EMOJI, 1))


def _word(rng: random.Random) -> str:
    pieces, _ = rng.choices(_SCRIPTS, weights=[w for _, w in _SCRIPTS])[0]
    parts = [rng.choice(pieces) for _ in range(rng.randint(1, 4))]
    if pieces is _LATIN:
        # Accents inside ASCII words, as in real text.
        parts = [rng.choice(_ASCII) + p for p in parts]
    return "".join(parts)


class TextSource:
    """Generated text: Zipf-weighted words of a fixed lexicon, plus unseen words.

    The tokenizer is trained on the lexicon; unseen words (a share of every text) split
    into byte-level pieces, so that multi-byte characters cross token boundaries often.
    """

    def __init__(self, seed: int, lexicon_size: int = 6000) -> None:
        rng = random.Random(seed)
        self.lexicon = [_word(rng) for _ in range(lexicon_size)]
        self.weights = [1.0 / (i + 1) for i in range(lexicon_size)]

    def line(self, rng: random.Random, words: int, unseen: float = 0.0) -> str:
        """``words`` words joined by spaces, each unseen with probability ``unseen``."""
        out = [
            _word(rng) if rng.random() < unseen else rng.choices(self.lexicon, self.weights)[0]
            for _ in range(words)
        ]
        return " ".join(out) + rng.choice([".", "!", "?", ",", ""])


def write_bpe_tokenizer_dir(path: Path, *, vocab_size: int = 3000, seed: int = 0) -> Path:
    """Train a byte-level BPE on generated text; save it as a ``PreTrainedTokenizerFast``.

    ids 0-3 are :data:`SPECIAL_TOKENS` (0 is eos, 1 pad), the last id is the added
    non-special ``<tool>``. Trains in well under a second. Returns ``path``.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from corewire.bench.bpe import train_byte_level

    source = TextSource(seed)
    rng = random.Random(seed + 1)
    corpus = [source.line(rng, rng.randint(4, 16)) for _ in range(3000)]
    tok = train_byte_level(corpus, vocab_size, list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
        clean_up_tokenization_spaces=False,
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


def load_tokenizer(path: Path) -> Any:
    """Load a tokenizer directory as vLLM 0.25.1's front-end does.

    vLLM's tokenizer registry (``get_tokenizer``: transformers' ``AutoTokenizer`` and the
    cached-properties wrapper), then a copy turned into the renderer's thread pool
    (``maybe_make_thread_pool`` with the default ``renderer_num_workers + 1`` copies): the
    object ``AsyncLLM`` passes to ``OutputProcessor``.
    """
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.hf import maybe_make_thread_pool

    tokenizer = copy.copy(get_tokenizer(str(path)))
    maybe_make_thread_pool(tokenizer, 2)
    return tokenizer


@dataclass
class TokenizerInfo:
    """A loaded tokenizer and what a workload needs to know about it."""

    tokenizer: Any
    eos_id: int
    added_ids: list[int]  # special and added tokens (their spacing rules differ)
    fffd_ids: list[int]  # single-id decode ends in U+FFFD (logprob strings need context)
    plain_ids: list[int]  # every other id
    encode: Callable[[random.Random], list[int]]  # token ids of one piece of new text

    @property
    def beyond_ids(self) -> list[int]:
        """Ids past the tokenizer's vocabulary (a model's padded embedding rows can be
        sampled): they decode to nothing."""
        return list(range(len(self.tokenizer), len(self.tokenizer) + 16))

    @classmethod
    def for_bpe(cls, tokenizer: Any, seed: int = 0) -> TokenizerInfo:
        """For :func:`write_bpe_tokenizer_dir`'s tokenizer trained with ``seed``."""
        source = TextSource(seed)

        def encode(rng: random.Random) -> list[int]:
            text = source.line(rng, rng.randint(3, 14), unseen=0.4)
            return tokenizer.encode(" " + text, add_special_tokens=False)

        return cls._build(tokenizer, encode)

    @classmethod
    def for_word_level(cls, tokenizer: Any) -> TokenizerInfo:
        """For ``corewire.vllm.serve.model_dir``'s word-level tokenizer (ids 0-3 special)."""
        vocab = len(tokenizer)

        def encode(rng: random.Random) -> list[int]:
            return [rng.randrange(4, vocab) for _ in range(rng.randint(3, 14))]

        return cls._build(tokenizer, encode)

    @classmethod
    def _build(cls, tokenizer: Any, encode: Callable[[random.Random], list[int]]) -> TokenizerInfo:
        added = sorted(tokenizer._tokenizer.get_added_tokens_decoder())
        fffd, plain = [], []
        for token_id in range(len(tokenizer)):
            if token_id in added:
                continue
            text = tokenizer._tokenizer.decode([token_id], skip_special_tokens=False)
            (fffd if text.endswith(_REPLACEMENT) else plain).append(token_id)
        return cls(tokenizer, tokenizer.eos_token_id, added, fffd, plain, encode)


# ---------------------------------------------------------------------------------------
# Which requests go native


def processor_goes_native(tokenizer: Any, *, tracing: bool) -> bool:
    """Whether a processor so built may take the native path at all: not without a
    tokenizer or with tracing (docs/native-output-processing-notes.md §3.3). Any
    ``stream_interval`` may."""
    return tokenizer is not None and not tracing


def expected_native(
    request: EngineCoreRequest, *, n: int, queued: bool = True, processor: bool = True
) -> bool:
    """Whether ``request`` (one of ``n`` siblings; ``queued``: added with a collector, as
    ``AsyncLLM`` adds) should take the native path in a processor that may
    (:func:`processor_goes_native`): not for prompt embeddings, pooling or streaming
    input (notes §3.3)."""
    del n  # n > 1 children go native too
    params = request.sampling_params
    return (
        processor
        and queued
        and params is not None
        and request.prompt_embeds is None
        and not request.resumable
    )


# ---------------------------------------------------------------------------------------
# The workload: requests and engine steps as plain data


@dataclass
class LogprobsSpec:
    """One output's sample logprobs: rows of (ids, values), one row per new token."""

    ids: list[list[int]]
    values: list[list[float]]  # float32 values: the array is made float32
    ranks: list[int]


@dataclass
class OutputSpec:
    """One ``EngineCoreOutput`` as plain data; :func:`make_output` builds the object."""

    request_id: str
    new_token_ids: list[int]
    logprobs: LogprobsSpec | None = None
    prompt_logprobs: LogprobsSpec | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[tuple[EngineCoreEventType, float]] | None = None
    prefill: tuple[int, int, int] | None = None  # prompt, local cached, external cached
    kv_transfer_params: dict[str, Any] | None = None
    num_nans: int = 0
    routed_experts: list[list[list[int]]] | None = None  # tokens x layers x top-k
    watermarking: bool | None = None  # the engine's report (first output; 0.34.0 on)


def _logprobs_lists(spec: LogprobsSpec, width: int) -> LogprobsLists:
    # As the scheduler sends them: rows as wide as the batch's largest k (+ 1), sliced
    # per request out of one batch array.
    rows = len(spec.ids)
    ids = np.zeros((rows + 2, width), dtype=np.int32)
    values = np.full((rows + 2, width), -99.0, dtype=np.float32)
    ranks = np.zeros(rows + 2, dtype=np.int64)
    for r in range(rows):
        ids[r + 1, : len(spec.ids[r])] = spec.ids[r]
        values[r + 1, : len(spec.values[r])] = spec.values[r]
        ranks[r + 1] = spec.ranks[r]
    return LogprobsLists(ids, values, ranks).slice_request(1, rows)


def make_output(spec: OutputSpec, width: int) -> EngineCoreOutput:
    """A fresh vLLM ``EngineCoreOutput`` for ``spec``; logprob rows ``width`` wide."""
    prompt_lp = None
    if spec.prompt_logprobs is not None:
        p = spec.prompt_logprobs
        prompt_lp = LogprobsTensors(
            torch.tensor(p.ids, dtype=torch.int32),
            torch.tensor(p.values, dtype=torch.float32),
            # Both rank types the engines use (vLLM's own sampler makes int32 ones).
            torch.tensor(p.ranks, dtype=torch.int32 if len(p.ranks) % 2 else torch.int64),
        )
    prefill = None
    if spec.prefill is not None:
        prompt, local, external = spec.prefill
        prefill = PrefillStats()
        prefill.set(prompt, local, external)
    extra = {}
    if spec.watermarking is not None:
        extra["watermarking"] = spec.watermarking
    return EngineCoreOutput(
        **extra,
        request_id=spec.request_id,
        new_token_ids=list(spec.new_token_ids),
        new_logprobs=None if spec.logprobs is None else _logprobs_lists(spec.logprobs, width),
        new_prompt_logprobs_tensors=prompt_lp,
        finish_reason=spec.finish_reason,
        stop_reason=spec.stop_reason,
        events=None
        if spec.events is None
        else [EngineCoreEvent(kind, ts) for kind, ts in spec.events],
        kv_transfer_params=copy.deepcopy(spec.kv_transfer_params),
        prefill_stats=prefill,
        routed_experts=None
        if spec.routed_experts is None
        else np.array(spec.routed_experts, dtype=np.int16),
        num_nans_in_logits=spec.num_nans,
    )


@dataclass
class EnginePlan:
    """One request as the engine runs it (a child of an n > 1 request is one of these)."""

    request_id: str
    client: ClientPlan
    planned: list[int]  # the ids the engine will sample, the last one finishing
    finish: FinishReason
    stop_reason: int | None
    produced: int = 0
    started: bool = False
    prefilled: int = 0  # prompt positions whose logprobs were sent
    done: bool = False


@dataclass
class ClientPlan:
    """One client request: what ``AsyncLLM.add_request`` gives the output processor."""

    external_id: str
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: dict[str, Any]  # SamplingParams keyword arguments (built fresh per side)
    lora: tuple[str, int] | None
    arrival_time: float
    embeds: bool = False  # prompt embeddings in place of the prompt ids
    children: list[EnginePlan] = field(default_factory=list)

    def sampling_params(self) -> SamplingParams:
        """A fresh ``SamplingParams`` for this request."""
        return SamplingParams(**self.params)

    @property
    def n(self) -> int:
        """The number of engine requests (n)."""
        return self.params.get("n", 1)


class EngineSim:
    """The engine side of a randomized workload, decided by ``seed``.

    Call :meth:`arrivals` before each step for the requests to add, :meth:`step` for
    the step's outputs, :meth:`engine_aborted` with the processors' ``reqs_to_abort``
    (the output handler aborts those in the engine), :meth:`client_abort` for an abort
    to make between steps (or None). :attr:`done` when everything has finished.
    """

    def __init__(
        self,
        seed: int,
        info: TokenizerInfo,
        num_requests: int,
        *,
        fallback_share: float = 0.2,
        max_tokens: int = 32,
        max_stop_chars: int = 6,
    ) -> None:
        self.rng = random.Random(seed)
        self.info = info
        self.max_stop_chars = max_stop_chars
        self.step_index = 0
        self.engine_ts = 5000.0
        self.wall = 1_700_000_000.0
        self.clients: list[ClientPlan] = []
        self.pending: list[tuple[int, ClientPlan]] = []
        self.live: list[EnginePlan] = []
        self.stragglers: list[str] = []  # aborted or stopped ids the engine sends once more
        #: The engine's weight version, stamped on each step (where vLLM has it); it
        #: changes now and then, as after a weight update.
        self.weight_version: str | None = "default" if "weight_version" in FEATURES else None
        self.ghosts = 0
        for i in range(num_requests):
            plan = self._client(i, fallback_share, max_tokens)
            self.pending.append((self.rng.randint(0, 10), plan))
            self.clients.append(plan)

    # -- planning

    def _stop_strings(self, planned: list[int], skip: bool) -> list[str]:
        rng = self.rng
        text = self.info.tokenizer.decode(planned, skip_special_tokens=skip)
        stops: list[str] = []
        for _ in range(rng.randint(1, 3)):
            if text and rng.random() < 0.8:
                start = rng.randrange(len(text))
                stop = text[start : start + rng.randint(1, self.max_stop_chars)]
                if stop and stop not in stops:
                    stops.append(stop)
            else:
                stops.append(rng.choice(["§never§", "\u2603\u2603"]))
        return stops

    def _planned(self, max_tokens: int) -> tuple[list[int], FinishReason, int | None]:
        rng, info = self.rng, self.info
        planned: list[int] = []
        while len(planned) < max_tokens:
            planned.extend(info.encode(rng))
            if rng.random() < 0.25:
                at = rng.randrange(len(planned) + 1)
                planned[at:at] = rng.choices(info.added_ids, k=rng.randint(1, 3))
            if rng.random() < 0.03:
                planned.insert(rng.randrange(len(planned) + 1), rng.choice(info.beyond_ids))
        ending = rng.random()
        if ending < 0.45 or max_tokens == 1:
            return planned[:max_tokens], FinishReason.LENGTH, None
        cut = rng.randint(1, max_tokens)
        if ending < 0.7:
            return [*planned[: cut - 1], info.eos_id], FinishReason.STOP, None
        if ending < 0.95:
            stop_id = rng.choice(info.plain_ids)
            return [*planned[: cut - 1], stop_id], FinishReason.STOP, stop_id
        return planned[:cut], FinishReason.REPETITION, None

    def _client(self, index: int, fallback_share: float, max_tokens_cap: int) -> ClientPlan:
        rng, info = self.rng, self.info
        kind = "native"
        if rng.random() < fallback_share:
            kind = rng.choice(["parallel", "prompt_logprobs", "embeds"])
        max_tokens = rng.randint(1, max_tokens_cap)
        detokenize = rng.random() > 0.1
        skip = rng.random() < 0.5
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "output_kind": rng.choice(KINDS),
            "detokenize": detokenize,
            "skip_special_tokens": skip,
            "spaces_between_special_tokens": rng.random() < 0.5,
            "logprobs": rng.choice([None, None, 0, 1, 5, 5, 20]),
            "include_stop_str_in_output": rng.random() < 0.3,
        }
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randint(0, min(max_tokens, 8))
        if kind == "parallel":
            params["n"] = rng.randint(2, 3)
            if rng.random() < 0.3:
                # Each child has prompt logprobs of its own (FINAL_ONLY: the last one's).
                params["prompt_logprobs"] = rng.choice([0, 2])
        elif kind == "prompt_logprobs":
            # -1: every candidate the rows hold (rows of the vocabulary's width in a real
            # engine; narrow ones here exercise the same rule).
            params["prompt_logprobs"] = rng.choice([-1, 0, 1, 3])
        if rng.random() < 0.2:
            # vLLM's FlatLogprobs container: native requests fill it natively.
            params["flat_logprobs"] = True
        if "watermarking" in FEATURES and rng.random() < 0.2:
            params["watermarking"] = True
        if "stream_interval" in FEATURES and rng.random() < 0.15:
            params["stream_interval"] = rng.randint(1, 4)
        external = f"ext-{index}"
        if index and rng.random() < 0.04:
            # The same user id twice: aborting it by that id aborts both.
            external = rng.choice(self.clients).external_id
        prompt_ids = []
        while len(prompt_ids) < (2 if "prompt_logprobs" in params else 1):
            prompt_ids = info.encode(rng)[: rng.randint(1, 12)]
        if (
            "prompt_logprob_start" in FEATURES
            and "prompt_logprobs" in params
            and len(prompt_ids) > 2
            and rng.random() < 0.5
        ):
            # Scoring starts later: the positions before are None in the container.
            params["prompt_logprob_start"] = rng.randint(1, len(prompt_ids) - 2)
        plan = ClientPlan(
            external_id=external,
            request_id=f"{external}-{index:04x}{rng.randrange(1 << 16):04x}",
            prompt=None
            if kind == "embeds" or rng.random() < 0.3
            else info.tokenizer.decode(prompt_ids),
            prompt_ids=prompt_ids,
            params=params,
            lora=rng.choice([("lora-a", 1), ("lora-b", 2)]) if rng.random() < 0.15 else None,
            arrival_time=0.0,
            embeds=kind == "embeds",
        )
        for child in range(plan.n):
            planned, finish, stop_reason = self._planned(max_tokens)
            if detokenize and child == 0 and rng.random() < 0.5:
                params["stop"] = self._stop_strings(planned, skip)
            if finish is FinishReason.STOP and stop_reason is not None:
                params.setdefault("stop_token_ids", []).append(stop_reason)
            engine_id = plan.request_id if plan.n == 1 else f"{child}_{plan.request_id}"
            plan.children.append(EnginePlan(engine_id, plan, planned, finish, stop_reason))
        return plan

    # -- driving

    @property
    def done(self) -> bool:
        """Every request has been added and none is running in the engine."""
        return not self.pending and not self.live

    def arrivals(self) -> list[ClientPlan]:
        """The requests to add before the next step (their arrival times set)."""
        now = [plan for at, plan in self.pending if at <= self.step_index]
        self.pending = [(at, plan) for at, plan in self.pending if at > self.step_index]
        for plan in now:
            plan.arrival_time = self.wall - self.rng.uniform(0.0, 0.004)
            for child in plan.children:
                self.live.append(child)
        return now

    def clock(self) -> tuple[float, float, str | None]:
        """This step's engine timestamp (monotonic), wall-clock iteration timestamp and
        weight version (None where vLLM has none)."""
        return self.engine_ts, self.wall, self.weight_version

    def step(self) -> list[OutputSpec]:
        """The next engine step's outputs (advances the clocks)."""
        rng = self.rng
        self.step_index += 1
        self.engine_ts += rng.uniform(0.005, 0.03)
        self.wall += rng.uniform(0.005, 0.03)
        if self.weight_version is not None and rng.random() < 0.05:
            self.weight_version = f"v{self.step_index}"
        outputs: list[OutputSpec] = []
        for plan in list(self.live):
            if rng.random() < 0.15:
                continue  # not scheduled this step
            outputs.extend(self._advance(plan))
        for request_id in self.stragglers:
            outputs.append(OutputSpec(request_id, [rng.choice(self.info.plain_ids)]))
        self.stragglers = []
        if rng.random() < 0.05:
            self.ghosts += 1
            outputs.append(OutputSpec(f"ghost-{self.ghosts}", [rng.choice(self.info.plain_ids)]))
        rng.shuffle(outputs)
        return outputs

    def _advance(self, plan: EnginePlan) -> list[OutputSpec]:
        rng = self.rng
        client = plan.client
        params = client.params
        spec = OutputSpec(plan.request_id, [])
        if not plan.started:
            plan.started = True
            spec.events = self._first_events()
            prompt = len(client.prompt_ids)
            local = rng.randint(0, prompt - 1)
            spec.prefill = (prompt, local, rng.randint(0, prompt - 1 - local))
            if params.get("watermarking") and "watermark_report" in FEATURES:
                # The engine reports what it applied (greedy rows are skipped).
                spec.watermarking = rng.random() < 0.7
            if params.get("prompt_logprob_start"):
                plan.prefilled = max(plan.prefilled, params["prompt_logprob_start"])
        elif rng.random() < 0.03:
            spec.events = [
                (EngineCoreEventType.PREEMPTED, self.engine_ts - 0.004),
                (EngineCoreEventType.SCHEDULED, self.engine_ts - 0.002),
            ]
        positions = len(client.prompt_ids) - 1
        if params.get("prompt_logprobs") is not None and plan.prefilled < positions:
            # Prompt logprobs, in one or two prefill chunks; a chunk before the last
            # comes without a token.
            first = plan.prefilled + 1
            last = positions if rng.random() < 0.5 else rng.randint(first, positions)
            spec.prompt_logprobs = self._prompt_logprobs(client, first, last)
            plan.prefilled = last
            if last < positions:
                return [spec]
        if plan.produced and not spec.events and rng.random() < 0.03:
            # No token this time, only KV-transfer news (the scheduler sends such outputs):
            # a DELTA output without new tokens (0.25.1 slices logprobs[-0:] for it).
            spec.kv_transfer_params = {"remote_blocks": [self.step_index]}
            return [spec]
        count = 2 if rng.random() < 0.1 else 1
        new = plan.planned[plan.produced : plan.produced + count]
        plan.produced += len(new)
        spec.new_token_ids = new
        if plan.produced == len(plan.planned):
            spec.finish_reason = plan.finish
            spec.stop_reason = plan.stop_reason
            if rng.random() < 0.3:
                spec.kv_transfer_params = {"do_remote_decode": False, "blocks": [plan.produced]}
            plan.done = True
            self.live.remove(plan)
        elif rng.random() < 0.03:
            spec.kv_transfer_params = {"step": self.step_index}
        num_logprobs = params.get("logprobs")
        if num_logprobs is not None:
            spec.logprobs = self._sample_logprobs(new, num_logprobs)
        return [spec]

    def _first_events(self) -> list[tuple[EngineCoreEventType, float]]:
        queued = self.engine_ts - self.rng.uniform(0.002, 0.01)
        return [
            (EngineCoreEventType.QUEUED, queued),
            (EngineCoreEventType.SCHEDULED, queued + self.rng.uniform(0.0, 0.002)),
        ]

    def _row(self, sampled: int, k: int) -> tuple[list[int], list[float], int]:
        """A logprobs row as the sampler makes it: sampled id, then the top k."""
        rng, info = self.rng, self.info
        top = []
        for _ in range(k):
            pool = rng.choices(
                [info.fffd_ids or info.plain_ids, info.added_ids, info.plain_ids, info.beyond_ids],
                [3, 1, 6, 0.2],
            )[0]
            top.append(rng.choice(pool))
        values = sorted((rng.uniform(-12.0, -0.01) for _ in range(k)), reverse=True)
        if k > 2 and rng.random() < 0.05:
            values[-1] = float("-inf")  # masked tokens can make the top k
        rank = 1 if rng.random() < 0.5 else rng.randint(2, 20)
        if rank <= k:
            top[rank - 1] = sampled
            sampled_value = values[rank - 1]
        else:
            sampled_value = (values[-1] if values else -0.5) - rng.uniform(0.0, 2.0)
            sampled_value = max(sampled_value, -30.0)
        # float32 round trip: the processors see float32 values, as from the sampler.
        row = [float(np.float32(v)) for v in [sampled_value, *values]]
        return [sampled, *top], row, rank

    def _sample_logprobs(self, new: list[int], k: int) -> LogprobsSpec:
        spec = LogprobsSpec([], [], [])
        for token in new:
            ids, values, rank = self._row(token, k)
            spec.ids.append(ids)
            spec.values.append(values)
            spec.ranks.append(rank)
        return spec

    def _prompt_logprobs(self, client: ClientPlan, first: int, last: int) -> LogprobsSpec:
        k = client.params["prompt_logprobs"]
        if k == -1:
            k = 4
        spec = LogprobsSpec([], [], [])
        for position in range(first, last + 1):
            ids, values, rank = self._row(client.prompt_ids[position], k)
            spec.ids.append(ids)
            spec.values.append(values)
            spec.ranks.append(rank)
        return spec

    def engine_aborted(self, request_ids: Iterable[str]) -> None:
        """The output handler aborted these in the engine (stop strings found)."""
        self._stop(set(request_ids))

    def client_abort(self) -> tuple[list[str], bool] | None:
        """An abort to make between steps: (ids, internal), or None this time."""
        rng = self.rng
        if rng.random() > 0.08:
            return None
        added = [c for c in self.clients if c.arrival_time and any(not e.done for e in c.children)]
        if not added or rng.random() < 0.1:
            # An id that is unknown or already finished: nothing happens.
            return [rng.choice(["nobody", *(c.external_id for c in self.clients)])], False
        plan = rng.choice(added)
        if rng.random() < 0.5:
            ids, internal = [plan.external_id], False
            aborted = {
                e.request_id
                for c in self.clients
                if c.external_id == plan.external_id
                for e in c.children
            }
        elif plan.n > 1 and rng.random() < 0.5:
            child = rng.choice(plan.children)
            ids, internal, aborted = [child.request_id], True, {child.request_id}
        else:
            ids, internal = [plan.request_id], True
            aborted = {e.request_id for e in plan.children}
        self._stop(aborted)
        return ids, internal

    def _stop(self, request_ids: set[str]) -> None:
        for plan in list(self.live):
            if plan.request_id in request_ids:
                plan.done = True
                self.live.remove(plan)
                if self.rng.random() < 0.3:
                    self.stragglers.append(plan.request_id)


# ---------------------------------------------------------------------------------------
# Snapshots: what a consumer could observe, as plain comparable data


def _logprobs_snapshot(logprobs: Any) -> Any:
    if logprobs is None:
        return None
    if isinstance(logprobs, FlatLogprobs):
        # Its own lists, with each item's type: reading positions would merge duplicates.
        lists = {
            f.name: [(v, type(v).__name__) for v in getattr(logprobs, f.name)]
            for f in dataclasses.fields(logprobs)
        }
        return "FlatLogprobs", {**lists, "layout": _types(logprobs)}
    positions = []
    for i in range(len(logprobs)):
        position = logprobs[i]
        if position is None:
            positions.append(None)
            continue
        positions.append(
            [
                # The layout too: an object built another way must still look the same.
                (token_id, lp.logprob, lp.rank, lp.decoded_token, _types(lp))
                for token_id, lp in position.items()
            ]
        )
    return type(logprobs).__name__, positions


def _types(obj: Any) -> tuple[str, ...]:
    """The class and its attributes' names, types and order (a Python float and a
    numpy float32 compare equal; a consumer may still see the difference)."""
    return (type(obj).__name__, *(f"{k}:{type(v).__name__}" for k, v in vars(obj).items()))


def _field(name: str, value: Any) -> Any:
    if name in ("logprobs", "prompt_logprobs"):
        return _logprobs_snapshot(value)
    if name == "outputs":
        return [_object(c) for c in value]
    if name in ("token_ids", "prompt_token_ids") and value is not None:
        return list(value)
    if name == "metrics" and value is not None:
        return dataclasses.asdict(value)  # the live object: its values now
    if name == "lora_request" and value is not None:
        return (value.lora_name, value.lora_int_id)
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.tolist())
    return copy.deepcopy(value)


def _object(obj: Any) -> dict[str, Any]:
    out = {name: _field(name, value) for name, value in vars(obj).items()}
    out["layout"] = _types(obj)
    return out


def snapshot(output: Any) -> Any:
    """A ``RequestOutput`` (or a queued exception) as plain data, at the time of the call.

    Every attribute of the ``RequestOutput`` and of each ``CompletionOutput`` (so every
    field the serving layer reads: docs/native-output-processing-notes.md §1.2, §3.1),
    logprob dicts in insertion order, the live ``metrics`` object's values now, and each
    object's class and attribute layout.
    """
    if isinstance(output, Exception):
        return ("exception", type(output).__name__, str(output))
    assert isinstance(output, RequestOutput), type(output)
    return _object(output)


def stats_snapshot(stats: IterationStats) -> dict[str, Any]:
    """Every attribute of an ``IterationStats``; lists sorted (multisets), since a
    processor that splits a batch may append in another order."""
    out: dict[str, Any] = {}
    for name, value in vars(stats).items():
        if isinstance(value, list):
            items = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
            out[name] = sorted(items, key=lambda v: json.dumps(v, sort_keys=True, default=str))
        elif dataclasses.is_dataclass(value):
            out[name] = dataclasses.asdict(value)
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------
# Driving one processor


class Side:
    """One processor and its collectors, fed as ``AsyncLLM`` feeds its processor."""

    def __init__(
        self,
        processor: OutputProcessor,
        *,
        collectors: bool = True,
        chunk: int | None = None,
        wire: bool = False,
    ) -> None:
        self.processor = processor
        self.collectors = collectors  # False: as vLLM's LLMEngine, outputs are returned
        self.chunk = chunk  # the output handler's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
        # True: each step's outputs go over the wire first (vLLM's encoder, corewire's
        # native decoder as vLLM's front-end gets it under corewire's client), so the
        # processor reads corewire's output objects, as it does in a server.
        self.through_wire = _through_wire() if wire else None
        self.queues: dict[str, RequestOutputCollector] = {}
        self.engine_ids: dict[str, tuple[EngineCoreRequest, int]] = {}  # id -> (request, n)

    def add(self, plan: ClientPlan) -> None:
        """Add ``plan`` as ``AsyncLLM.add_request`` does (n > 1 through a parent)."""
        params = plan.sampling_params()
        request = EngineCoreRequest(
            request_id=plan.request_id,
            prompt_token_ids=None if plan.embeds else list(plan.prompt_ids),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=plan.arrival_time,
            lora_request=None
            if plan.lora is None
            else LoRARequest(*plan.lora, lora_path=f"adapters/{plan.lora[0]}"),
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=plan.external_id,
            prompt_embeds=torch.zeros(len(plan.prompt_ids), 4) if plan.embeds else None,
        )
        queue = None
        if self.collectors:
            queue = RequestOutputCollector(params.output_kind, request.request_id)
            self.queues[request.request_id] = queue
        if params.n == 1:
            self.engine_ids[request.request_id] = (request, 1)
            self.processor.add_request(request, plan.prompt, None, 0, queue)
            return
        parent = ParentRequest(request)
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            child = request if index == params.n - 1 else copy.copy(request)
            child.request_id = child_id
            child.sampling_params = child_params
            self.engine_ids[child_id] = (child, params.n)
            self.processor.add_request(child, plan.prompt, parent, index, queue)

    def step(
        self,
        specs: list[OutputSpec],
        engine_ts: float,
        wall: float,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Process one engine step; everything observable except the queues."""
        widths = [len(s.logprobs.ids[0]) for s in specs if s.logprobs and s.logprobs.ids]
        width = max(widths, default=1)
        outputs = [make_output(spec, width) for spec in specs]
        if self.through_wire is not None:
            outputs = self.through_wire(outputs)
        stats = None
        if self.processor.log_stats:
            stats = IterationStats()
            stats.iteration_timestamp = wall  # TTFT and e2e are measured from it
        # As the output handler: chunks of one step share its IterationStats.
        size = self.chunk or max(len(outputs), 1)
        request_outputs, reqs_to_abort = [], []
        # As the output handler passes the step's weight version (0.33.0 on).
        extra = {} if weight_version is None else {"weight_version": weight_version}
        for start in range(0, max(len(outputs), 1), size):
            result = self.processor.process_outputs(
                outputs[start : start + size], engine_ts, stats, **extra
            )
            request_outputs.extend(snapshot(o) for o in result.request_outputs)
            reqs_to_abort.extend(result.reqs_to_abort)
        scheduler = SchedulerStats()
        self.processor.update_scheduler_stats(scheduler)
        return {
            "request_outputs": request_outputs,
            "reqs_to_abort": sorted(reqs_to_abort),
            "stats": None if stats is None else stats_snapshot(stats),
            "lora_waiting": dict(scheduler.waiting_lora_adapters),
            "lora_running": dict(scheduler.running_lora_adapters),
            **self.counts(),
        }

    def abort(self, ids: list[str], internal: bool) -> dict[str, Any]:
        """``abort_requests`` as ``AsyncLLM.abort`` calls it."""
        aborted = self.processor.abort_requests(list(ids), internal=internal)
        return {"aborted": sorted(aborted), **self.counts()}

    def counts(self) -> dict[str, Any]:
        """The unfinished-request counters ``AsyncLLM`` reads."""
        return {
            "unfinished": self.processor.get_num_unfinished_requests(),
            "has_unfinished": self.processor.has_unfinished_requests(),
        }

    def drain(self) -> list[tuple[str, Any]]:
        """``get_nowait`` on every collector, as the serving tasks would."""
        drained = []
        for key, queue in self.queues.items():
            try:
                output = queue.get_nowait()
            except Exception as e:  # propagate_error: the queued exception is raised
                drained.append((key, snapshot(e)))
                continue
            if output is not None:
                drained.append((key, snapshot(output)))
        return drained


def _through_wire() -> Callable[[list[EngineCoreOutput]], list[Any]]:
    # vLLM's encoder writes a step's outputs as its engine core does; corewire's decoder
    # reads them back as the one vLLM's front-end gets from corewire's client.
    from vllm.v1.serial_utils import MsgpackEncoder

    from corewire.vllm.adapters.client import make_output_decoder

    encoder, decoder = MsgpackEncoder(), make_output_decoder()

    def through(outputs: list[EngineCoreOutput]) -> list[Any]:
        frames = encoder.encode(EngineCoreOutputs(engine_index=0, outputs=outputs))
        return list(decoder.decode([bytes(frame) for frame in frames]).outputs)

    return through


class Pair:
    """A reference side (vLLM's ``OutputProcessor``) and a candidate side, fed the same.

    Every method does the same to both and asserts that both observed the same, naming
    ``label`` and the step; each returns the reference's view. Where the candidate has
    ``is_native`` (corewire's class), every request added is checked against
    :func:`expected_native`.
    """

    def __init__(
        self,
        tokenizer: Any,
        candidate_cls: type[OutputProcessor],
        *,
        stream_interval: int = 1,
        tracing: bool = False,
        collectors: bool = True,
        log_stats: bool = True,
        chunk: int | None = None,
        label: str = "",
        candidate_wire: bool = False,
    ) -> None:
        kwargs = {
            "log_stats": log_stats,
            "stream_interval": stream_interval,
            "tracing_enabled": tracing,
        }
        sides = {"collectors": collectors, "chunk": chunk}
        self.reference = Side(OutputProcessor(tokenizer, **kwargs), **sides)
        self.candidate = Side(candidate_cls(tokenizer, **kwargs), **sides, wire=candidate_wire)
        self.processor_native = processor_goes_native(tokenizer, tracing=tracing)
        self.label = label
        self.steps = 0
        self.natives: dict[str, bool] = {}

    def _where(self) -> str:
        return f"{self.label} step {self.steps}"

    def add(self, plan: ClientPlan) -> None:
        """Add ``plan`` to both."""
        before = set(self.reference.engine_ids)
        self.reference.add(plan)
        self.candidate.add(plan)
        is_native = getattr(self.candidate.processor, "is_native", None)
        for engine_id, (request, n) in self.reference.engine_ids.items():
            if engine_id in before:
                continue
            expected = expected_native(
                request,
                n=n,
                queued=self.reference.collectors,
                processor=self.processor_native,
            )
            self.natives[engine_id] = expected
            if is_native is not None:
                assert is_native(engine_id) is expected, f"{self._where()}: {engine_id} native?"

    def step(
        self,
        specs: list[OutputSpec],
        engine_ts: float,
        wall: float,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """One engine step into both; compares everything but the queues."""
        expected = self.reference.step(specs, engine_ts, wall, weight_version)
        actual = self.candidate.step(specs, engine_ts, wall, weight_version)
        for key in expected:
            assert actual[key] == expected[key], f"{self._where()}: {key}"
        self.steps += 1
        return expected

    def abort(self, ids: list[str], internal: bool) -> dict[str, Any]:
        """``abort_requests`` on both."""
        expected = self.reference.abort(ids, internal)
        actual = self.candidate.abort(ids, internal)
        assert actual == expected, f"{self._where()}: abort {ids} internal={internal}"
        return expected

    def propagate_error(self, error: Exception) -> None:
        """``propagate_error`` on both, with the same exception object."""
        self.reference.processor.propagate_error(error)
        self.candidate.processor.propagate_error(error)

    def drain(self) -> list[tuple[str, Any]]:
        """Drain both sides' collectors; the drained snapshots must be equal."""
        expected = self.reference.drain()
        assert self.candidate.drain() == expected, f"{self._where()}: drained outputs"
        return expected

    def native_counts(self) -> dict[str, int] | None:
        """The candidate's ``native_counts`` (None for a class without them, as vLLM's)."""
        counts = getattr(self.candidate.processor, "native_counts", None)
        return None if counts is None else dict(counts)


@dataclass
class WorkloadResult:
    """What a differential run saw (the reference side's view)."""

    pair: Pair
    outputs: list[tuple[str, Any]]  # every drained snapshot, in order
    reqs_to_abort: list[str]


def run_workload(
    sim: EngineSim,
    tokenizer: Any,
    candidate_cls: type[OutputProcessor],
    *,
    drain_every: int = 1,
    stream_interval: int = 1,
    tracing: bool = False,
    collectors: bool = True,
    log_stats: bool = True,
    chunk: int | None = None,
    label: str = "",
    candidate_wire: bool = False,
) -> WorkloadResult:
    """Drive a reference and a candidate processor with ``sim``'s workload; compare all.

    ``tokenizer`` None is a processor without one (``skip_tokenizer_init``);
    ``collectors`` False adds requests without collectors, as vLLM's ``LLMEngine``
    does (the outputs come back from ``process_outputs``); ``log_stats`` False is
    ``--disable-log-stats`` (no ``IterationStats``, no ``metrics``); ``chunk`` splits each
    step into ``process_outputs`` calls of that many outputs sharing one ``IterationStats``,
    as the output handler does above ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``;
    ``candidate_wire`` hands the candidate corewire's decoded output objects (see
    :class:`Side`), the reference vLLM's own. Raises
    ``AssertionError`` naming the step at the first difference.
    """
    pair = Pair(
        tokenizer,
        candidate_cls,
        stream_interval=stream_interval,
        tracing=tracing,
        collectors=collectors,
        log_stats=log_stats,
        chunk=chunk,
        label=label,
        candidate_wire=candidate_wire,
    )
    outputs: list[tuple[str, Any]] = []
    stopped: list[str] = []
    while not sim.done or pair.steps == 0:
        for plan in sim.arrivals():
            pair.add(plan)
        if (abort := sim.client_abort()) is not None:
            pair.abort(*abort)
        specs = sim.step()
        result = pair.step(specs, *sim.clock())
        sim.engine_aborted(result["reqs_to_abort"])
        stopped.extend(result["reqs_to_abort"])
        if pair.steps % drain_every == 0 or sim.done:
            outputs.extend(pair.drain())
    end = {"unfinished": 0, "has_unfinished": False}
    assert pair.reference.counts() == pair.candidate.counts() == end, label
    return WorkloadResult(pair, outputs, stopped)
