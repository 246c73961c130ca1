"""corewire's output processor against the installed vLLM's own ``OutputProcessor``,
differentially (vLLM 0.25.1 in the main venv; 0.34.0 in its own, with
``COREWIRE_REQUIRE_VLLM=0.34.0``: scripts/test).

Two processors get identical inputs: the same requests (real ``EngineCoreRequest`` and
``SamplingParams``; n > 1 through ``ParentRequest`` as ``AsyncLLM`` adds them) and the same
engine steps (fresh vLLM ``EngineCoreOutput`` objects for each), each with its own
collectors and its own ``IterationStats`` per step. Everything a consumer can observe must
be the same, field by field: every ``RequestOutput`` drained from the collectors (logprob
dicts in key order), ``reqs_to_abort``, the stats (lists as multisets), the LoRA
scheduler stats, the unfinished-request counts. Spec: docs/native-output-processing-
notes.md §1, §3.1, §3.2 and §5.2.

The candidate is the installed release's ``NativeOutputProcessor`` (a subclass per release
that changed vLLM's: ``Release.native_output_processor``): each request's
``is_native`` must match its parameters (``output_diff_support.expected_native``) and the
native fast path must have run (``native_counts``). Deliberately wrong processors (vLLM's
with one thing changed) must make the harness fail.

The tokenizers: a byte-level BPE trained at test time on text with multi-byte characters,
special and added tokens (so characters split across tokens and logprob candidates whose
single-id decode ends in U+FFFD), and ``corewire.vllm.serve.model_dir``'s word-level one, both
loaded the way vLLM's front-end loads them.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreEventType, FinishReason
from vllm.v1.engine.detokenizer import check_stop_strings
from vllm.v1.engine.output_processor import OutputProcessor

from corewire import releases
from corewire.vllm.output.by_release import native_output_processor
from corewire.vllm.serve.model_dir import write_model_dir
from output_diff_support import (
    FEATURES,
    ClientPlan,
    EngineSim,
    LogprobsSpec,
    OutputSpec,
    Pair,
    TokenizerInfo,
    load_tokenizer,
    run_workload,
    write_bpe_tokenizer_dir,
)

SEEDS = range(30)
REQUESTS = 24
WALL = 1_700_000_000.0


@pytest.fixture(scope="session")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> TokenizerInfo:
    """The byte-level BPE, trained once per session (well under a second)."""
    path = write_bpe_tokenizer_dir(tmp_path_factory.mktemp("bpe") / "tokenizer")
    info = TokenizerInfo.for_bpe(load_tokenizer(path))
    # The point of this tokenizer: ids that decode to a piece of a character.
    assert len(info.fffd_ids) > 100
    return info


@pytest.fixture(scope="session")
def word_level(tmp_path_factory: pytest.TempPathFactory) -> TokenizerInfo:
    """``corewire.vllm.serve.model_dir``'s word-level tokenizer (the serve tests' model)."""
    path = write_model_dir(tmp_path_factory.mktemp("model") / "model", vocab_size=1024)
    return TokenizerInfo.for_word_level(load_tokenizer(path))


#: The installed vLLM's stop-string rule, asked of vLLM itself: 0.33.0 on, the stop string
#: that ends earliest wins; 0.25.1 takes the first listed.
EARLIEST_STOP = check_stop_strings("abcd", 4, ["cd", "b"], False) == ("b", 1)
#: Changed in the same release (0.33.0): a ``DELTA`` output without new tokens carries no
#: sample logprobs (``[:0]``); 0.25.1 slices ``[-0:]``, the whole history.
EMPTY_DELTA_SLICE = EARLIEST_STOP


@pytest.fixture(scope="session")
def candidate() -> type[OutputProcessor]:
    """The processor under test: the installed release's. A release the native path is
    not verified against (``Release.native_output`` False) is skipped: these tests are
    what verifies one (set ``NATIVE_OUTPUT`` in its class to run them)."""
    release = releases.installed(vllm)
    if not release.native_output:
        pytest.skip(f"native output processing is not verified against vLLM {release}")
    return native_output_processor(release)


def _check_fast_path_ran(pair: Pair, *, expect_fast: bool = True) -> None:
    counts = pair.native_counts()
    assert counts is not None, "NativeOutputProcessor has no native_counts"
    if expect_fast:
        assert counts["fast"] > 0, counts
    else:
        assert counts["fast"] == counts["slow"] == 0, counts


# ---------------------------------------------------------------------------------------
# Randomized workloads


@pytest.mark.parametrize("drain_every", [1, 3], ids=["drain-each-step", "drain-every-3"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_bpe(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], seed: int, drain_every: int
) -> None:
    """Native and fallback requests mixed in the same batches; draining every 3 steps
    makes the collectors merge outputs (``RequestOutput.add``)."""
    cls = candidate
    sim = EngineSim(seed, bpe, REQUESTS)
    result = run_workload(sim, bpe.tokenizer, cls, drain_every=drain_every, label=f"seed {seed}")
    assert len(result.outputs) >= REQUESTS
    _check_fast_path_ran(result.pair)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_over_the_wire(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], seed: int
) -> None:
    """The candidate reads corewire's decoded output objects (the wire between: vLLM's
    encoder, corewire's native decoder), as in a server under corewire's client, where
    the native path reads their fields in place rather than by attribute; the reference
    reads vLLM's own. Finishes, events, KV transfer parameters, experts, prompt logprobs
    and (0.34.0) watermarking each send an output through vLLM's loop, read either way."""
    sim = EngineSim(4000 + seed, bpe, REQUESTS)
    result = run_workload(
        sim, bpe.tokenizer, candidate, drain_every=2, label=f"seed {seed}", candidate_wire=True
    )
    assert len(result.outputs) >= REQUESTS
    _check_fast_path_ran(result.pair)
    counts = result.pair.native_counts()
    assert counts is not None and counts["slow"] > 0, counts


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_long_outputs(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], seed: int
) -> None:
    """Longer outputs and stop strings, more requests per batch, merging every 2 steps."""
    cls = candidate
    sim = EngineSim(3000 + seed, bpe, 48, max_tokens=160, max_stop_chars=16)
    result = run_workload(sim, bpe.tokenizer, cls, drain_every=2, label=f"seed {seed}")
    _check_fast_path_ran(result.pair)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "options",
    [{"log_stats": False}, {"chunk": 5}],
    ids=["disable-log-stats", "chunks-of-5"],
)
def test_random_workload_server_options(
    bpe: TokenizerInfo,
    candidate: type[OutputProcessor],
    seed: int,
    options: dict[str, Any],
) -> None:
    """``--disable-log-stats`` (no stats objects at all), and steps split into chunks
    that share one ``IterationStats`` (the output handler's chunking)."""
    cls = candidate
    sim = EngineSim(4000 + seed, bpe, REQUESTS)
    result = run_workload(sim, bpe.tokenizer, cls, drain_every=2, label=f"seed {seed}", **options)
    _check_fast_path_ran(result.pair)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interval", [2, 3, 7])
def test_random_workload_stream_interval(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], seed: int, interval: int
) -> None:
    """``--stream-interval`` above 1 on the native path: a ``DELTA`` request's outputs
    wait for ``interval`` new tokens (its first and its finish go at once) and then carry
    every token, text and logprob since the last one sent; other kinds send each
    output (vLLM moves the sent-token offset only for ``DELTA``). Stop strings finish
    a request between two intervals; draining every 1 or 2 steps merges some outputs."""
    cls = candidate
    sim = EngineSim(5000 + 10 * interval + seed, bpe, REQUESTS, max_stop_chars=12)
    result = run_workload(
        sim,
        bpe.tokenizer,
        cls,
        drain_every=1 + seed % 2,
        stream_interval=interval,
        label=f"seed {seed}, interval {interval}",
    )
    _check_fast_path_ran(result.pair)
    assert result.pair.candidate.processor.stream_interval == interval


def test_stream_interval_workloads_cover_their_cases(
    bpe: TokenizerInfo, candidate: type[OutputProcessor]
) -> None:
    """The stream-interval workloads really have what their test claims: outputs held
    back (the same workloads send fewer outputs at interval 3 than at 1), stop strings
    finishing requests, and flat logprobs."""
    seen: Counter[str] = Counter()
    stopped = 0
    sent = {1: 0, 3: 0}
    for seed in range(3):
        for interval in sent:
            sim = EngineSim(5000 + 30 + seed, bpe, REQUESTS, max_stop_chars=12)
            result = run_workload(sim, bpe.tokenizer, candidate, stream_interval=interval)
            sent[interval] += len(result.outputs)
            if interval == 3:
                seen += _coverage(result.outputs, bpe)
                stopped += len(result.reqs_to_abort)
    assert sent[3] < sent[1], sent
    assert stopped > 0
    for what in ("stop string", "FlatLogprobs logprobs"):
        assert seen[what] > 0, (what, seen)


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_word_level(
    word_level: TokenizerInfo, candidate: type[OutputProcessor], seed: int
) -> None:
    """The serve tests' word-level tokenizer: no split characters, tokens joined by
    spaces, four special tokens."""
    cls = candidate
    sim = EngineSim(1000 + seed, word_level, REQUESTS)
    result = run_workload(sim, word_level.tokenizer, cls, drain_every=1 + seed % 3)
    _check_fast_path_ran(result.pair)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "processor",
    [{"tracing": True}, {"tokenizer": None}, {"collectors": False}],
    ids=["tracing", "no-tokenizer", "llm-engine"],
)
def test_whole_processor_fallbacks(
    bpe: TokenizerInfo,
    candidate: type[OutputProcessor],
    processor: dict[str, Any],
    seed: int,
) -> None:
    """vLLM's path for every request, and identical: tracing, no tokenizer
    (``skip_tokenizer_init``), no collectors (``LLMEngine``: the outputs are returned,
    compared in order)."""
    cls = candidate
    sim = EngineSim(2000 + seed, bpe, 12)
    options = {"tokenizer": bpe.tokenizer, **processor}
    result = run_workload(sim, options.pop("tokenizer"), cls, **options)
    assert not any(result.pair.natives.values())
    _check_fast_path_ran(result.pair, expect_fast=False)


def _coverage(outputs: list[tuple[str, Any]], info: TokenizerInfo) -> Counter[str]:
    seen: Counter[str] = Counter()
    decode = info.tokenizer._tokenizer.decode
    for _, out in outputs:
        if not isinstance(out, dict):
            continue
        if out["prompt_logprobs"]:
            seen["prompt logprobs"] += 1
            kind, positions = out["prompt_logprobs"]
            seen[f"{kind} prompt logprobs"] += 1
            if any(c["index"] > 0 for c in out["outputs"]):
                seen["n > 1 prompt logprobs"] += 1
            if kind == "list":
                for position in positions:
                    for token_id, _, _, text, _ in position or ():
                        if text and decode([token_id]).endswith("\ufffd"):
                            seen["U+FFFD prompt candidate corrected"] += 1
        if not any(out["prompt_token_ids"]):
            seen["prompt embeds"] += 1  # placeholder ids: the request had embeddings
        for c in out["outputs"]:
            seen[f"finish {c['finish_reason']}"] += 1
            if isinstance(c["stop_reason"], str):
                seen["stop string"] += 1
            elif isinstance(c["stop_reason"], int):
                seen["stop token"] += 1
            if c["index"] > 0:
                seen["n > 1"] += 1
            if c["logprobs"] is None:
                continue
            kind, positions = c["logprobs"]
            seen[f"{kind} logprobs"] += 1
            if kind == "FlatLogprobs":
                assert positions["layout"][0] == "FlatLogprobs"
                # The snapshot holds the flat lists; their candidates as (id, text) pairs.
                pairs = [
                    list(zip([v for v, _ in positions["token_ids"]],
                             [v for v, _ in positions["decoded_tokens"]], strict=True))
                ]  # fmt: skip
                positions = positions["start_indices"]
            else:
                pairs = [[(p[0], p[3]) for p in position] for position in positions]
            if c["finish_reason"] == "abort" and positions:
                seen["abort output with logprobs"] += 1
            if c["finish_reason"] is None and not c["token_ids"]:
                if positions:
                    seen["DELTA output without tokens, with logprobs"] += 1
                else:
                    seen["DELTA output without tokens, logprobs empty"] += 1
            for position in pairs:
                for token_id, text in position:
                    if text is not None and decode([token_id]).endswith("\ufffd"):
                        seen["U+FFFD candidate"] += 1
                        if text:
                            seen["U+FFFD candidate corrected"] += 1
    return seen


def test_workloads_cover_the_edge_cases(
    bpe: TokenizerInfo, candidate: type[OutputProcessor]
) -> None:
    """The generator really produces what the randomized tests claim to cover."""
    cls = candidate
    seen: Counter[str] = Counter()
    stopped = 0
    for seed in range(10):
        result = run_workload(EngineSim(seed, bpe, REQUESTS), bpe.tokenizer, cls)
        seen += _coverage(result.outputs, bpe)
        stopped += len(result.reqs_to_abort)
    for what in (
        "finish stop",
        "finish length",
        "finish abort",
        "finish repetition",
        "stop string",
        "stop token",
        "n > 1",
        "prompt logprobs",
        "list prompt logprobs",
        "FlatLogprobs prompt logprobs",
        "U+FFFD prompt candidate corrected",
        "n > 1 prompt logprobs",
        "prompt embeds",
        "list logprobs",
        "FlatLogprobs logprobs",
        "abort output with logprobs",
        "DELTA output without tokens, "
        + ("logprobs empty" if EMPTY_DELTA_SLICE else "with logprobs"),
        "U+FFFD candidate",
        "U+FFFD candidate corrected",
    ):
        assert seen[what] > 0, (what, seen)
    assert stopped > 0


# ---------------------------------------------------------------------------------------
# The harness itself must see a difference


class _NoUtf8Correction(OutputProcessor):
    """vLLM's processor without the U+FFFD context correction of logprob strings."""

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):  # type: ignore[no-untyped-def]
        super().add_request(request, prompt, parent_req, request_index, queue)
        state = self.request_states[request.request_id]
        state.logprobs_processor._verify_tokens = lambda decoded_tokens_list, **_: (  # type: ignore[method-assign]
            decoded_tokens_list
        )


class _NoHoldBack(OutputProcessor):
    """vLLM's processor streaming text without holding back a possible stop string."""

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):  # type: ignore[no-untyped-def]
        super().add_request(request, prompt, parent_req, request_index, queue)
        detokenizer = self.request_states[request.request_id].detokenizer
        if hasattr(detokenizer, "stop_buffer_length"):
            detokenizer.stop_buffer_length = 0


class _NoEvents(OutputProcessor):
    """vLLM's processor ignoring the engine's request events (queue/schedule times)."""

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, stats=None, **kw):  # type: ignore[no-untyped-def]
        for output in engine_core_outputs:
            output.events = None
        return super().process_outputs(engine_core_outputs, engine_core_timestamp, stats, **kw)


class _NoKvParams(OutputProcessor):
    """vLLM's processor dropping ``kv_transfer_params``."""

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, stats=None, **kw):  # type: ignore[no-untyped-def]
        for output in engine_core_outputs:
            output.kv_transfer_params = None
        return super().process_outputs(engine_core_outputs, engine_core_timestamp, stats, **kw)


class _FlatAsDicts(OutputProcessor):
    """vLLM's processor keeping ``flat_logprobs`` requests' logprobs as position dicts."""

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):  # type: ignore[no-untyped-def]
        if request.sampling_params is not None and request.sampling_params.flat_logprobs:
            request.sampling_params = request.sampling_params.clone()
            request.sampling_params.flat_logprobs = False
        super().add_request(request, prompt, parent_req, request_index, queue)


class _PromptLogprobsResent(OutputProcessor):
    """vLLM's processor sending a ``DELTA`` request's prompt logprobs with every output
    (instead of once, then an empty list)."""

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):  # type: ignore[no-untyped-def]
        super().add_request(request, prompt, parent_req, request_index, queue)
        lp = self.request_states[request.request_id].logprobs_processor
        if lp is not None:
            lp.pop_prompt_logprobs = lambda: lp.prompt_logprobs  # type: ignore[method-assign]


class _NoPromptUtf8Correction(OutputProcessor):
    """vLLM's processor without the U+FFFD context correction of prompt logprob
    strings only (sample logprobs keep theirs)."""

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):  # type: ignore[no-untyped-def]
        super().add_request(request, prompt, parent_req, request_index, queue)
        lp = self.request_states[request.request_id].logprobs_processor
        if lp is None:
            return
        update = lp._update_prompt_logprobs

        def uncorrected(tensors):  # type: ignore[no-untyped-def]
            lp._verify_tokens = lambda decoded_tokens_list, **_: decoded_tokens_list
            try:
                update(tensors)
            finally:
                del lp._verify_tokens  # the class's method again

        lp._update_prompt_logprobs = uncorrected  # type: ignore[method-assign]


class _IntervalIgnored(OutputProcessor):
    """vLLM's processor sending every output whatever the stream interval."""

    def __init__(self, tokenizer, *, log_stats, stream_interval=1, tracing_enabled=False):  # type: ignore[no-untyped-def]
        super().__init__(
            tokenizer, log_stats=log_stats, stream_interval=1, tracing_enabled=tracing_enabled
        )


def test_harness_catches_an_ignored_stream_interval(bpe: TokenizerInfo) -> None:
    """With ``stream_interval=3`` on both sides, a processor that ignores it must fail."""
    with pytest.raises(AssertionError, match=r"step \d+: "):
        for seed in range(6):
            run_workload(
                EngineSim(seed, bpe, REQUESTS), bpe.tokenizer, _IntervalIgnored, stream_interval=3
            )


@pytest.mark.parametrize(
    "mutant",
    [
        _NoUtf8Correction,
        _NoHoldBack,
        _NoEvents,
        _NoKvParams,
        _FlatAsDicts,
        _PromptLogprobsResent,
        _NoPromptUtf8Correction,
    ],
)
def test_harness_catches_a_wrong_processor(bpe: TokenizerInfo, mutant: type) -> None:
    """vLLM's processor with one thing changed must fail the comparison (not crash)."""
    with pytest.raises(AssertionError, match=r"step \d+: "):
        for seed in range(6):
            run_workload(EngineSim(seed, bpe, REQUESTS), bpe.tokenizer, mutant)


# ---------------------------------------------------------------------------------------
# Targeted cases (docs/native-output-processing-notes.md §3.2)


def _plan(request_id: str, prompt_ids: list[int], **params: Any) -> ClientPlan:
    params.setdefault("max_tokens", 64)
    return ClientPlan(
        external_id=request_id,
        request_id=f"{request_id}-0001",
        prompt="a prompt",
        prompt_ids=prompt_ids,
        params=params,
        lora=None,
        arrival_time=WALL - 0.01,
    )


def _first(spec: OutputSpec) -> OutputSpec:
    spec.events = [(EngineCoreEventType.QUEUED, 4999.9), (EngineCoreEventType.SCHEDULED, 4999.95)]
    spec.prefill = (4, 1, 0)
    return spec


class _Script:
    """A pair of processors fed by hand, one request, one token per step by default."""

    def __init__(self, info: TokenizerInfo, candidate: type[OutputProcessor]) -> None:
        self.pair = Pair(info.tokenizer, candidate)
        self.t = 0
        self.outputs: list[tuple[str, Any]] = []
        self.aborts: list[list[str]] = []

    def step(self, specs: list[OutputSpec], weight_version: str | None = None) -> dict[str, Any]:
        self.t += 1
        if weight_version is None and "weight_version" in FEATURES:
            weight_version = "default"  # what vLLM's engine stamps on every step
        result = self.pair.step(specs, 5000.0 + 0.01 * self.t, WALL + 0.01 * self.t, weight_version)
        self.aborts.append(result["reqs_to_abort"])
        self.outputs.extend(self.pair.drain())
        return result

    def tokens(self, request_id: str, ids: list[int], per_step: int = 1, **last: Any) -> None:
        """Send ``ids`` for ``request_id``; ``last`` sets fields of the last output."""
        chunks = [ids[i : i + per_step] for i in range(0, len(ids), per_step)]
        for i, chunk in enumerate(chunks):
            spec = OutputSpec(request_id, chunk)
            if i == 0:
                _first(spec)
            if i == len(chunks) - 1:
                for name, value in last.items():
                    setattr(spec, name, value)
            self.step([spec])

    def final(self) -> dict[str, Any]:
        """The reference's last drained output of the only request."""
        return self.outputs[-1][1]


def _pieces(info: TokenizerInfo, ids: list[int]) -> list[str]:
    """The text each id adds, decoding incrementally (as the detokenizer streams)."""
    decode = info.tokenizer._tokenizer.decode
    return [decode(ids[: i + 1])[len(decode(ids[:i])) :] for i in range(len(ids))]


def _ascii_prompt(info: TokenizerInfo) -> list[int]:
    """A prompt that ends on a character boundary: the output text then decodes the same
    after it as alone (what the expected texts below assume)."""
    return info.tokenizer.encode(" ka lo mi", add_special_tokens=False)


def _text_ids(info: TokenizerInfo, seed: int) -> tuple[list[int], list[str]]:
    ids = info.encode(random.Random(seed))
    return ids, _pieces(info, ids)


def _spanning_stop(info: TokenizerInfo) -> tuple[list[int], str, int]:
    """Token ids and a stop string starting in token i, ending in token i + 2."""
    for seed in range(500):
        ids, pieces = _text_ids(info, seed)
        text = "".join(pieces)
        for i in range(1, len(ids) - 3):
            if not all(len(p) >= 2 and "\ufffd" not in p for p in pieces[i : i + 3]):
                continue
            stop = pieces[i][-1] + pieces[i + 1] + pieces[i + 2][0]
            if text.find(stop) == len("".join(pieces[:i])) + len(pieces[i]) - 1:
                return ids, stop, i
    raise AssertionError("no text with a stop string spanning three tokens")


@pytest.mark.parametrize("include", [False, True], ids=["stop-excluded", "stop-included"])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stop_string_spanning_three_tokens(
    bpe: TokenizerInfo,
    candidate: type[OutputProcessor],
    kind: RequestOutputKind,
    include: bool,
) -> None:
    """A stop string from the last character of one token to the first of the token
    after next: found at that token, text cut before (or after) it, request aborted."""
    ids, stop, i = _spanning_stop(bpe)
    script = _Script(bpe, candidate)
    plan = _plan(
        "span",
        _ascii_prompt(bpe),
        output_kind=kind,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    script.pair.add(plan)
    script.tokens(plan.request_id, ids)
    text = "".join(_pieces(bpe, ids))
    start = text.index(stop)
    expected = text[: start + len(stop)] if include else text[:start]
    # Found at token i + 2; the output handler must abort it in the engine then.
    assert script.aborts[i + 2] == [plan.request_id]
    final = script.final()["outputs"][0]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", stop)
    streamed = "".join(o["outputs"][0]["text"] for _, o in script.outputs)
    assert (streamed if kind is RequestOutputKind.DELTA else final["text"]) == expected
    assert final["token_ids"][-1] == ids[i + 2]


def test_two_stop_strings_in_one_step(bpe: TokenizerInfo, candidate: type[OutputProcessor]) -> None:
    """0.25.1 takes the first stop string in list order, not the one that ends first;
    0.33.0 on take the one that ends first, and drop the token after it (its id, and
    from the output)."""
    for seed in range(500):
        ids, pieces = _text_ids(bpe, seed)
        if len(ids) >= 5 and all(len(p.strip()) >= 2 for p in pieces[2:4]):
            early, late = pieces[2].strip(), pieces[3].strip()
            text = "".join(pieces)
            if text.find(early) >= len("".join(pieces[:2])) and text.find(late) >= len(
                "".join(pieces[:3])
            ):
                break
    else:
        raise AssertionError("no suitable text")
    script = _Script(bpe, candidate)
    plan = _plan("two", _ascii_prompt(bpe), stop=[late, early], output_kind=RequestOutputKind.DELTA)
    script.pair.add(plan)
    script.tokens(plan.request_id, ids[:2])
    script.step([OutputSpec(plan.request_id, ids[2:4])])  # both complete in this step
    final = script.final()["outputs"][0]
    text = "".join(pieces[:4])
    streamed = "".join(o["outputs"][0]["text"] for _, o in script.outputs)
    if EARLIEST_STOP:
        assert final["stop_reason"] == early
        assert streamed == text[: text.index(early)]
        assert final["token_ids"] == ids[2:3]  # the one after it is dropped
    else:
        assert final["stop_reason"] == late
        assert streamed == text[: text.index(late)]


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_min_tokens_suppresses_an_early_stop(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], min_tokens: int
) -> None:
    """A stop string within the first ``min_tokens`` tokens is ignored; its next
    occurrence stops the request."""
    decode = bpe.tokenizer._tokenizer.decode
    words = [i for i in bpe.plain_ids if decode([i]).startswith(" ") and len(decode([i])) >= 5]
    rng = random.Random(3)
    while True:
        a, b, c, d, e, f = rng.sample(words, 6)
        ids = [a, b, c, d, e, b, f, a]
        stop = decode([b]).strip()
        if decode(ids).count(stop) == 2:
            break
    script = _Script(bpe, candidate)
    plan = _plan("min", [c, d], stop=[stop], min_tokens=min_tokens, max_tokens=8)
    script.pair.add(plan)
    script.tokens(plan.request_id, ids)
    stopped_at = [i for i, ids_ in enumerate(script.aborts) if ids_]
    assert stopped_at == ([1] if min_tokens == 0 else [5])


def _split_character(info: TokenizerInfo) -> tuple[list[int], int]:
    """Ids of a text with a character split over two tokens; the index of the second."""
    decode = info.tokenizer._tokenizer.decode
    for seed in range(500):
        ids, _ = _text_ids(info, seed)
        for i in range(2, len(ids)):
            first, second = decode([ids[i - 1]]), decode([ids[i]])
            if first.endswith("\ufffd") and second.endswith("\ufffd"):
                whole = decode(ids[: i + 1])
                if not whole.endswith("\ufffd"):
                    return ids[: i + 3], i
    raise AssertionError("no character split over two tokens")


def test_replacement_character_candidates_are_corrected_with_context(
    bpe: TokenizerInfo, candidate: type[OutputProcessor]
) -> None:
    """A candidate whose single-id decode ends in U+FFFD gets its string from the
    sampled context (the completed character); a sampled token also in the top k keeps
    its first place in the dict with its top-k rank."""
    ids, i = _split_character(bpe)
    script = _Script(bpe, candidate)
    plan = _plan("fffd", ids[:2], logprobs=5, output_kind=RequestOutputKind.DELTA)
    script.pair.add(plan)
    rng = random.Random(7)
    for position, token in enumerate(ids):
        # The sampled token, then U+FFFD candidates (the sampled one again at rank 2).
        top = [rng.choice(bpe.fffd_ids), token, *rng.sample(bpe.fffd_ids, 3)]
        values = [-0.5, -0.5, -1.0, -2.0, -3.0, -4.0]
        spec = OutputSpec(plan.request_id, [token])
        spec.logprobs = _logprobs_row([token, *top], values, 2)
        if position == 0:
            _first(spec)
        script.step([spec])
    logprobs = [o["outputs"][0]["logprobs"][1] for _, o in script.outputs]
    position = logprobs[i][0]  # one position per output (DELTA, drained each step)
    decode = bpe.tokenizer._tokenizer.decode
    sampled_id, _, rank, text, _ = position[0]
    assert sampled_id == ids[i] and rank == 2  # first insertion place, the top-k rank
    # Corrected with the sampled context: the completed character, not U+FFFD.
    assert text and text != decode([ids[i]]) and not text.endswith("\ufffd")
    assert text.endswith(decode(ids[: i + 1])[-1])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_prompt_logprob_context_restarts_after_a_delta_pop(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], kind: RequestOutputKind
) -> None:
    """Prompt logprobs in two prefill chunks split inside a character. ``DELTA`` hands the
    first chunk's positions out with that chunk's output (vLLM pops them), so the second
    chunk's U+FFFD prompt token has no context left: its string is empty. ``CUMULATIVE``
    keeps the container, and the string is the completed character."""
    ids, i = _split_character(bpe)
    prompt = ids[: i + 1]
    script = _Script(bpe, candidate)
    plan = _plan("prompt-fffd", prompt, prompt_logprobs=1, output_kind=kind)
    script.pair.add(plan)
    other = bpe.plain_ids[0]

    def rows(first: int, last: int) -> LogprobsSpec:
        positions = range(first, last + 1)
        return LogprobsSpec(
            [[prompt[p], other] for p in positions],
            [[-0.5, -1.5] for _ in positions],
            [1 for _ in positions],
        )

    chunk = _first(OutputSpec(plan.request_id, []))  # a chunk before the last: no token
    chunk.prompt_logprobs = rows(1, i - 1)
    script.step([chunk])
    last = OutputSpec(plan.request_id, [ids[i + 1]])
    last.prompt_logprobs = rows(i, i)
    script.step([last])
    outputs = [o for _, o in script.outputs]
    assert len(outputs) == 2
    layout, positions = outputs[1]["prompt_logprobs"]
    assert layout == "list"
    token_id, _, _, text, _ = positions[-1][0]
    assert token_id == prompt[i]
    if kind == RequestOutputKind.DELTA:
        assert len(positions) == 1 and text == ""  # popped: no context before it
    else:
        assert len(positions) == i + 1  # the None position, then every scored one
        decode = bpe.tokenizer._tokenizer.decode
        assert text and not text.endswith("\ufffd")
        assert text.endswith(decode(prompt)[-1])


def _logprobs_row(ids: list[int], values: list[float], rank: int) -> LogprobsSpec:
    return LogprobsSpec([ids], [values], [rank])


@pytest.mark.parametrize("internal", [False, True], ids=["external-id", "internal-id"])
def test_delta_abort_output_logprobs(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], internal: bool
) -> None:
    """0.25.1 slices ``logprobs[-0:]`` for an output without new tokens: everything;
    0.33.0 on slice ``[:0]``: nothing."""
    ids, _ = _text_ids(bpe, 3)
    script = _Script(bpe, candidate)
    plan = _plan("abort", ids[:2], logprobs=2, output_kind=RequestOutputKind.DELTA)
    script.pair.add(plan)
    rng = random.Random(1)
    for position, token in enumerate(ids[:3]):
        spec = OutputSpec(plan.request_id, [token])
        spec.logprobs = _logprobs_row(
            [token, *rng.sample(bpe.plain_ids, 2)], [-0.25, -0.25, -1.5], 1
        )
        if position == 0:
            _first(spec)
        script.step([spec])
    aborted = script.pair.abort(
        [plan.request_id if internal else plan.external_id], internal=internal
    )
    assert aborted["aborted"] == [plan.request_id]
    final = script.pair.drain()
    assert len(final) == 1
    out = final[0][1]["outputs"][0]
    assert out["finish_reason"] == "abort" and out["token_ids"] == []
    assert len(out["logprobs"][1]) == (0 if EMPTY_DELTA_SLICE else 3)


def test_propagate_error_reaches_every_queue(
    bpe: TokenizerInfo, candidate: type[OutputProcessor]
) -> None:
    """The engine's death reaches every request's collector, native and fallback, as the
    same exception object."""
    ids, _ = _text_ids(bpe, 5)
    script = _Script(bpe, candidate)
    native = _plan("native", ids[:2], logprobs=1)
    parallel = _plan("parallel", ids[:2], n=2)
    final_only = _plan("final", ids[:3], output_kind=RequestOutputKind.FINAL_ONLY)
    for plan in (native, parallel, final_only):
        script.pair.add(plan)
    script.step(
        [
            _first(OutputSpec(native.request_id, ids[:1])),
            _first(OutputSpec(f"0_{parallel.request_id}", ids[:1])),
            _first(OutputSpec(final_only.request_id, ids[:1])),
        ]
    )
    error = RuntimeError("engine core died")
    script.pair.propagate_error(error)
    for side in (script.pair.reference, script.pair.candidate):
        assert len(side.queues) == 3
        for queue in side.queues.values():
            with pytest.raises(RuntimeError) as raised:
                queue.get_nowait()
            assert raised.value is error


@pytest.mark.parametrize(
    "kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
)
def test_parallel_children_share_a_collector_in_engine_order(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], kind: RequestOutputKind
) -> None:
    """n = 2: the children's outputs reach their one collector in the engine's order, so
    the merged ``RequestOutput`` (its base output, metrics and completion order) is
    vLLM's, also when one child's output needs vLLM's loop (its first) and the other's
    could be native in the same step; plain steps of both are native."""
    ids, _ = _text_ids(bpe, 5)
    script = _Script(bpe, candidate)
    plan = _plan("parallel", ids[:2], n=2, output_kind=kind, max_tokens=6)
    script.pair.add(plan)
    first, second = f"0_{plan.request_id}", f"1_{plan.request_id}"
    script.step([_first(OutputSpec(first, ids[2:3]))])
    # The second child's first output (vLLM's loop), then the first child's plain one:
    # handled natively before the other, it would reach the collector first.
    script.step([_first(OutputSpec(second, ids[2:3])), OutputSpec(first, ids[3:4])])
    counts = script.pair.native_counts()
    assert counts is not None
    slow_before = counts["slow"]
    assert len(ids) >= 8
    for step in range(4, 8):
        finish = FinishReason.LENGTH if step == 7 else None
        script.step(
            [
                OutputSpec(second, ids[step : step + 1], finish_reason=finish),
                OutputSpec(first, ids[step : step + 1], finish_reason=finish),
            ]
        )
    counts = script.pair.native_counts()
    assert counts is not None and counts["fast"] > 0, counts
    assert counts["slow"] > slow_before  # the finishes went through vLLM's loop
    outputs = [o for _, o in script.outputs if isinstance(o, dict)]
    assert outputs[-1]["finished"] is True
    assert sorted(c["index"] for c in outputs[-1]["outputs"]) == [0, 1]


def _distinct_piece(info: TokenizerInfo, at: int) -> tuple[list[int], str]:
    """Ids of a text whose token ``at`` adds a piece of two or more characters (no
    U+FFFD) that the text holds nowhere before it: a stop string that ends there."""
    for seed in range(500):
        ids, pieces = _text_ids(info, seed)
        if len(ids) <= at:
            continue
        piece = pieces[at]
        if len(piece.strip()) >= 2 and "\ufffd" not in piece and piece not in "".join(pieces[:at]):
            return ids[: at + 1], piece
    raise AssertionError("no distinct piece")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
)
def test_parallel_children_stopped_in_one_step(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], kind: RequestOutputKind, n: int
) -> None:
    """Every child of an n > 1 request stopped by the same stop string in one step,
    natively: each is finished right after its own output, as in vLLM's loop, so the
    parent's stats count the request once (when its last child finishes), not once per
    child; the engine is asked to abort every child."""
    ids, stop = _distinct_piece(bpe, 5)
    script = _Script(bpe, candidate)
    plan = _plan("stopped", _ascii_prompt(bpe), n=n, output_kind=kind, stop=[stop])
    script.pair.add(plan)
    children = [f"{i}_{plan.request_id}" for i in range(n)]
    script.step([_first(OutputSpec(child, ids[:1])) for child in children])
    for step in range(1, len(ids)):
        result = script.step([OutputSpec(child, ids[step : step + 1]) for child in children])
    assert result["reqs_to_abort"] == sorted(children)
    counts = script.pair.native_counts()
    assert counts is not None and counts["fast"] >= n * (len(ids) - 1), counts
    stats = result["stats"]
    assert stats["n_params_iter"] == [n] and len(stats["max_num_generation_tokens_iter"]) == 1
    outputs = [o for _, o in script.outputs if isinstance(o, dict)]
    assert outputs[-1]["finished"] is True
    assert {c["stop_reason"] for c in outputs[-1]["outputs"]} == {stop}


def test_output_for_an_unknown_id_is_ignored(
    bpe: TokenizerInfo, candidate: type[OutputProcessor]
) -> None:
    """An output for a request never added (or already gone) changes nothing."""
    ids, _ = _text_ids(bpe, 9)
    script = _Script(bpe, candidate)
    plan = _plan("known", ids[:2])
    script.pair.add(plan)
    result = script.step(
        [
            _first(OutputSpec("never-added", ids[:2], finish_reason=FinishReason.LENGTH)),
            _first(OutputSpec(plan.request_id, ids[:1])),
        ]
    )
    assert result["stats"]["num_generation_tokens"] == 1
    assert [key for key, _ in script.outputs] == [plan.request_id]
    assert result["unfinished"] == 1


def test_nans_in_logits_and_routed_experts(
    bpe: TokenizerInfo,
    candidate: type[OutputProcessor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two per-output extras vLLM keeps: NaN counts (with ``VLLM_COMPUTE_NANS_IN_LOGITS``,
    read per output in 0.25.1) mark a request corrupted in its finished stats; routed
    experts arrays are concatenated into the finished ``CompletionOutput``."""
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    ids, _ = _text_ids(bpe, 11)
    script = _Script(bpe, candidate)
    nans = _plan("nans", ids[:2], max_tokens=5)
    experts = _plan("experts", ids[:2], max_tokens=5, output_kind=RequestOutputKind.DELTA)
    script.pair.add(nans)
    script.pair.add(experts)
    for position in range(5):
        finish = FinishReason.LENGTH if position == 4 else None
        a = OutputSpec(nans.request_id, ids[position : position + 1], finish_reason=finish)
        a.num_nans = 2 if position == 2 else 0
        b = OutputSpec(experts.request_id, ids[position : position + 1], finish_reason=finish)
        b.routed_experts = [[[position, 1], [2, position]]]
        if position == 0:
            _first(a)
            _first(b)
        result = script.step([a, b])
    assert result["stats"]["num_corrupted_reqs"] == 1
    corrupted = {f["request_id"]: f["is_corrupted"] for f in result["stats"]["finished_requests"]}
    assert corrupted == {"nans": True, "experts": False}
    final = {key: out for key, out in script.outputs}[experts.request_id]
    assert final["outputs"][0]["routed_experts"][2] == [[[p, 1], [2, p]] for p in range(5)]


# ---------------------------------------------------------------------------------------
# What later releases added (where the installed vLLM has it)


def _needs(feature: str) -> Any:
    return pytest.mark.skipif(feature not in FEATURES, reason=f"this vLLM has no {feature}")


@_needs("watermarking")
def test_watermarked_requests_are_counted_in_finished_stats(
    bpe: TokenizerInfo, candidate: type[OutputProcessor]
) -> None:
    """0.33.0 on, stats count each finished request as watermarked (from its parameters;
    0.34.0: the engine's report on its first output wins), watermark-skipped or not
    watermarked; stop strings finish two of them natively."""
    ids, stop = _distinct_piece(bpe, 4)
    script = _Script(bpe, candidate)
    plans = {
        "marked": _plan("marked", _ascii_prompt(bpe), watermarking=True, stop=[stop]),
        "refused": _plan("refused", _ascii_prompt(bpe), watermarking=True),
        # No report (an engine without a watermark config): the parameters decide.
        "unreported": _plan("unreported", _ascii_prompt(bpe), watermarking=True),
        "plain": _plan("plain", _ascii_prompt(bpe), stop=[stop]),
    }
    for plan in plans.values():
        script.pair.add(plan)
    reports = {"marked": True, "refused": False, "unreported": None, "plain": None}
    reported = "watermark_report" in FEATURES  # 0.34.0 on
    first = []
    for name, plan in plans.items():
        spec = _first(OutputSpec(plan.request_id, ids[:1]))
        if reported:
            spec.watermarking = reports[name]
        first.append(spec)
    script.step(first)
    for step in range(1, len(ids)):
        finish = FinishReason.LENGTH if step == len(ids) - 1 else None
        result = script.step(
            [
                OutputSpec(p.request_id, ids[step : step + 1], finish_reason=finish)
                for p in plans.values()
            ]
        )
    stats = result["stats"]
    assert stats["num_watermarked_reqs"] == (2 if reported else 3)
    assert stats["num_not_watermarked_reqs"] == (2 if reported else 1)
    counts = script.pair.native_counts()
    assert counts is not None and counts["fast"] > 0, counts


@_needs("prompt_logprob_start")
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_prompt_logprob_start_pads_the_container(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], kind: RequestOutputKind
) -> None:
    """0.34.0: prompt positions before ``prompt_logprob_start`` are None in the prompt
    logprobs (the first scored position's correction context skips them)."""
    ids, i = _split_character(bpe)
    prompt = ids[: i + 1]
    start = max(1, i - 2)
    script = _Script(bpe, candidate)
    plan = _plan("start", prompt, prompt_logprobs=1, prompt_logprob_start=start, output_kind=kind)
    script.pair.add(plan)
    positions = range(start + 1, len(prompt))
    chunk = _first(OutputSpec(plan.request_id, ids[i + 1 : i + 2]))
    chunk.prompt_logprobs = LogprobsSpec(
        [[prompt[p], bpe.plain_ids[0]] for p in positions],
        [[-0.5, -1.5] for _ in positions],
        [1 for _ in positions],
    )
    script.step([chunk])
    script.step([OutputSpec(plan.request_id, ids[i + 2 : i + 3])])
    layout, got = script.outputs[0][1]["prompt_logprobs"]
    assert layout == "list"
    assert got[: 1 + start] == [None] * (1 + start)
    assert len(got) == len(prompt)


@_needs("weight_version")
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_weight_version_spans_on_finished_outputs(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], kind: RequestOutputKind
) -> None:
    """0.33.0 on: the weight version of every step is tracked per request (natively on
    the fast path) and a finished output carries its spans, also one a stop string
    finished natively."""
    ids, stop = _distinct_piece(bpe, 6)
    script = _Script(bpe, candidate)
    stopped = _plan("stopped", _ascii_prompt(bpe), stop=[stop], output_kind=kind)
    running = _plan("running", _ascii_prompt(bpe), output_kind=kind, max_tokens=len(ids))
    script.pair.add(stopped)
    script.pair.add(running)
    versions = ["v1", "v1", "v2", "v2", "v3", "v3", "v3"]
    for step in range(len(ids)):
        finish = FinishReason.LENGTH if step == len(ids) - 1 else None
        specs = [
            OutputSpec(stopped.request_id, ids[step : step + 1]),
            OutputSpec(running.request_id, ids[step : step + 1], finish_reason=finish),
        ]
        if step == 0:
            specs = [_first(s) for s in specs]
        script.step(specs, weight_version=versions[step])
    finals = {key: out for key, out in script.outputs}
    spans = [
        (s.version, s.start, s.end)
        for s in finals[stopped.request_id]["outputs"][0]["weight_versions"]
    ]
    assert spans == [("v1", 0, 2), ("v2", 2, 4), ("v3", 4, 7)]
    counts = script.pair.native_counts()
    assert counts is not None and counts["fast"] > 0, counts


@_needs("stream_interval")
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_request_stream_interval(
    bpe: TokenizerInfo, candidate: type[OutputProcessor], seed: int
) -> None:
    """0.33.0 on: a request's own ``stream_interval`` (never below the engine's 2 here)
    holds its ``DELTA`` outputs back natively as the engine's would."""
    sim = EngineSim(6000 + seed, bpe, REQUESTS)
    for plan in sim.clients:
        plan.params["stream_interval"] = 1 + (seed + len(plan.prompt_ids)) % 4
    result = run_workload(sim, bpe.tokenizer, candidate, stream_interval=2, label=f"seed {seed}")
    _check_fast_path_ran(result.pair)
