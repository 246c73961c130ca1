"""The reference engine in-process: sampling semantics, logprobs, pooling, utilities.

The wire is covered by ``test_engine_proc.py``; here the engine is stepped directly so
that each sampling rule can be checked over many tokens cheaply.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import queue
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client_support import DEFAULT_SAMPLING, request
from corewire.engine import Engine, EngineCoreProc, ReferenceEngine
from corewire.engine.launch import load_engine
from corewire.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
)

PROMPT = [17, 4, 1999, 256]


@pytest.fixture(scope="module")
def engine() -> Iterator[ReferenceEngine]:
    """One CPU reference engine for the module (every test leaves it idle)."""
    eng = ReferenceEngine(device="cpu")
    yield eng
    eng.shutdown()


def req(rid: str, prompt: list[int] | None = None, **sp: Any) -> EngineCoreRequest:
    """``client_support.request`` on ``PROMPT`` with vLLM's default sampling, so that each
    test names only what it checks; ``sp`` are SamplingParams fields."""
    return request(
        rid, prompt=PROMPT if prompt is None else prompt, sampling={**DEFAULT_SAMPLING, **sp}
    )


def run(engine: ReferenceEngine, *requests: EngineCoreRequest) -> dict[str, list[EngineCoreOutput]]:
    """Add ``requests`` and step until the engine is idle; outputs per request."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[EngineCoreOutput]] = collections.defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    """All tokens of one request's outputs."""
    return [t for o in outs for t in o.new_token_ids]


def gen(engine: ReferenceEngine, rid: str = "r", **sp: Any) -> list[int]:
    """Tokens of one request run alone."""
    return tokens(run(engine, req(rid, **sp))[rid])


# ---------------------------------------------------------------------- greedy & lengths


def test_greedy_is_deterministic_and_seeded_by_the_engine_seed(engine: ReferenceEngine) -> None:
    a = gen(engine, temperature=0.0, max_tokens=16)
    assert a == gen(engine, temperature=0.0, max_tokens=16)
    assert a == gen(ReferenceEngine(device="cpu", seed=0), temperature=0.0, max_tokens=16)
    assert a != gen(ReferenceEngine(device="cpu", seed=1), temperature=0.0, max_tokens=16)
    # A near-zero temperature counts as greedy, whatever the seed.
    assert a == gen(engine, temperature=1e-7, max_tokens=16, seed=99)


def test_max_tokens_and_max_model_len(engine: ReferenceEngine) -> None:
    outs = run(engine, req("len", temperature=0.0, max_tokens=5))["len"]
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    assert [o.finish_reason for o in outs] == [None] * 4 + [FinishReason.LENGTH]
    assert outs[-1].stop_reason is None
    small = ReferenceEngine(device="cpu", max_model_len=10)
    # max_tokens None means "until max_model_len": 10 - 4 prompt tokens.
    assert len(gen(small, temperature=0.0, max_tokens=None)) == 6
    with pytest.raises(ValueError, match="leaves no room"):
        small.add_request(req("too-long", list(range(10))))


def test_eos_ignore_eos_and_min_tokens() -> None:
    first = gen(ReferenceEngine(device="cpu"), temperature=0.0, max_tokens=4)
    # An engine whose eos is the token greedy decoding produces first.
    eng = ReferenceEngine(device="cpu", eos_token_id=first[0])
    outs = run(eng, req("eos", temperature=0.0, max_tokens=4))["eos"]
    assert tokens(outs) == [first[0]]  # the eos token is part of the output
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason is None
    assert gen(eng, temperature=0.0, max_tokens=4, ignore_eos=True) == first
    # min_tokens keeps eos from being sampled at all before it is reached.
    held = gen(eng, temperature=0.0, max_tokens=6, min_tokens=3)
    assert len(held) >= 3 and first[0] not in held[:3]


def test_stop_token_ids_and_min_tokens(engine: ReferenceEngine) -> None:
    g = gen(engine, temperature=0.0, max_tokens=10)
    j = next(i for i in range(1, 10) if g[i] not in g[:i])
    outs = run(engine, req("stop", temperature=0.0, max_tokens=10, stop_token_ids=[g[j]]))
    assert tokens(outs["stop"]) == g[: j + 1]
    assert outs["stop"][-1].finish_reason == FinishReason.STOP
    assert outs["stop"][-1].stop_reason == g[j]
    # The stop token is banned until min_tokens, and stops the request after that.
    held = gen(engine, temperature=0.0, max_tokens=10, stop_token_ids=[g[0]], min_tokens=2)
    assert g[0] not in held[:2] and len(held) >= 2
    # Stop ids outside the vocabulary are harmless.
    assert gen(engine, temperature=0.0, max_tokens=10, stop_token_ids=[10**9]) == g


# ---------------------------------------------------------------------- random sampling


def test_seed_reproduces_and_ignores_the_rest_of_the_batch(engine: ReferenceEngine) -> None:
    alone = gen(engine, "s", seed=1234, max_tokens=16)
    # The same seeded request, batched with unseeded random requests.
    others = [req(f"noise-{i}", [i + 1, i + 2], max_tokens=16) for i in range(6)]
    batched = run(engine, *others, req("s", seed=1234, max_tokens=16))
    assert tokens(batched["s"]) == alone
    assert gen(engine, seed=4321, max_tokens=16) != alone
    # Unseeded requests with the same prompt vary.
    assert len({tuple(tokens(v)) for k, v in batched.items() if k != "s"}) > 1


def test_top_k_samples_only_among_the_k_best(engine: ReferenceEngine) -> None:
    ranks: list[int] = []
    for seed in range(12):
        outs = run(engine, req("k", temperature=1.5, top_k=3, logprobs=3, seed=seed))["k"]
        ranks.extend(int(o.new_logprobs.sampled_token_ranks[0]) for o in outs)
    assert max(ranks) <= 3
    assert len(set(ranks)) > 1  # it does sample, not only the argmax
    # top_k=1 is greedy.
    assert gen(engine, top_k=1, seed=5) == gen(engine, temperature=0.0)


def test_top_p_samples_only_inside_the_nucleus(engine: ReferenceEngine) -> None:
    top_p = 0.3
    seen: set[int] = set()
    for seed in range(12):
        outs = run(engine, req("p", top_p=top_p, logprobs=20, seed=seed))["p"]
        for out in outs:
            lp = out.new_logprobs
            rank = int(lp.sampled_token_ranks[0])
            seen.add(rank)
            assert rank <= 21
            # Temperature 1: raw logprobs are the sampling distribution; the tokens
            # ranked above the sampled one hold less than top_p of the mass.
            better = float(np.exp(lp.logprobs[0, 1:rank].astype(np.float64)).sum())
            assert better < top_p + 1e-4
    assert len(seen) > 1
    assert gen(engine, top_p=1e-6, temperature=3.0, seed=1) == gen(engine, temperature=0.0)


def test_temperature_flattens_the_distribution(engine: ReferenceEngine) -> None:
    def mean_rank(temperature: float) -> float:
        ranks = []
        for seed in range(10):
            outs = run(engine, req("t", temperature=temperature, logprobs=0, seed=seed))["t"]
            ranks.extend(int(o.new_logprobs.sampled_token_ranks[0]) for o in outs)
        return sum(ranks) / len(ranks)

    assert mean_rank(0.3) < mean_rank(1.0) < mean_rank(3.0)


# ---------------------------------------------------------------------- logprobs


def test_a_requests_logprobs_do_not_depend_on_its_batch(engine: ReferenceEngine) -> None:
    """The same seeded request alone and sharing its steps with 1 to 40 others: the same
    tokens and bit-identical logprobs every time (small and ragged batches take other
    BLAS kernels, which the engine's padding keeps out of a row's result), which is what
    lets two servers over two engines be compared byte for byte."""
    mine = dict(temperature=0.9, seed=77, max_tokens=6, logprobs=3)

    def seen(outs: list[EngineCoreOutput]) -> list[Any]:
        return [(o.new_token_ids, o.new_logprobs.logprobs.tobytes()) for o in outs]

    alone = seen(run(engine, req("me", **mine))["me"])
    for others in (1, 2, 5, 15, 16, 17, 40):
        noise = [req(f"n{others}-{i}", [i + 3, 7], max_tokens=i % 7 + 1) for i in range(others)]
        batched = run(engine, *noise, req("me", **mine))
        assert seen(batched["me"]) == alone, others


def test_logprobs_are_raw_model_logprobs(engine: ReferenceEngine) -> None:
    outs = run(engine, req("lp", temperature=0.0, max_tokens=3, logprobs=4))["lp"]
    engine.add_request(req("probe", temperature=0.0, max_tokens=1))
    window = engine._windows([engine._waiting[0]])
    engine.abort_requests(["probe"])
    with torch.inference_mode():
        expected = torch.log_softmax(engine._model(window).float(), dim=-1)[0]
    first = outs[0].new_logprobs
    top = expected.topk(4)
    assert first.logprob_token_ids[0, 1:].tolist() == top.indices.tolist()
    np.testing.assert_allclose(first.logprobs[0, 1:], top.values.numpy(), rtol=1e-5)
    assert first.logprob_token_ids[0, 0] == outs[0].new_token_ids[0] == top.indices[0]
    # Ranks count strictly better tokens, plus one.
    sampled = run(engine, req("lp2", max_tokens=8, logprobs=20, seed=3))["lp2"]
    for out in sampled:
        lp = out.new_logprobs
        rank = int(lp.sampled_token_ranks[0])
        if rank <= 20:
            assert lp.logprob_token_ids[0, rank] == out.new_token_ids[0]
            assert lp.logprobs[0, rank] == lp.logprobs[0, 0]


def test_min_tokens_masking_does_not_change_logprobs(engine: ReferenceEngine) -> None:
    g = gen(engine, temperature=0.0, max_tokens=1)
    plain = run(engine, req("a", temperature=0.0, max_tokens=1, logprobs=2))["a"][0]
    masked = run(
        engine,
        req("b", temperature=0.0, max_tokens=2, logprobs=2, stop_token_ids=[g[0]], min_tokens=2),
    )["b"][0]
    # The banned token is still reported as the model's top choice; a different token
    # (rank 2) was sampled.
    assert masked.new_token_ids[0] != g[0]
    assert masked.new_logprobs.logprob_token_ids[0, 1] == g[0]
    assert int(masked.new_logprobs.sampled_token_ranks[0]) == 2
    np.testing.assert_array_equal(
        masked.new_logprobs.logprobs[0, 1:], plain.new_logprobs.logprobs[0, 1:]
    )


# ---------------------------------------------------------------------- pooling


def test_pooling_embeddings(engine: ReferenceEngine) -> None:
    def pool(rid: str, prompt: list[int], params: PoolingParams) -> torch.Tensor:
        r = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, pooling_params=params)
        (out,) = run(engine, r)[rid]
        assert out.new_token_ids == [] and out.finish_reason == FinishReason.STOP
        return out.pooling_output

    e1 = pool("e1", PROMPT, PoolingParams())
    assert e1.shape == (128,) and e1.dtype == torch.float32 and e1.device.type == "cpu"
    assert math.isclose(float(e1.norm()), 1.0, rel_tol=1e-5)
    assert torch.equal(e1, pool("e1b", PROMPT, PoolingParams()))
    assert not torch.allclose(e1, pool("e2", [5, 6, 7], PoolingParams()))
    raw = pool("e3", PROMPT, PoolingParams(normalize=False, dimensions=32))
    assert raw.shape == (32,) and not math.isclose(float(raw.norm()), 1.0, rel_tol=1e-3)
    # Pooling and generation in the same steps; batched pooling equals one at a time.
    long_prompt = list(range(1, 40))
    batch = run(
        engine,
        EngineCoreRequest(request_id="b1", prompt_token_ids=PROMPT, pooling_params=PoolingParams()),
        req("g", temperature=0.0, max_tokens=3),
        EngineCoreRequest(
            request_id="b2", prompt_token_ids=long_prompt, pooling_params=PoolingParams()
        ),
    )
    assert torch.allclose(batch["b1"][0].pooling_output, e1, atol=1e-5)
    assert torch.allclose(
        batch["b2"][0].pooling_output, pool("b2-alone", long_prompt, PoolingParams()), atol=1e-5
    )
    assert len(tokens(batch["g"])) == 3
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.add_request(
            EngineCoreRequest(
                request_id="empty", prompt_token_ids=[], pooling_params=PoolingParams()
            )
        )


# ---------------------------------------------------------------------- scheduling


def test_validation_rejects_requests_that_cannot_run(engine: ReferenceEngine) -> None:
    bad: list[tuple[EngineCoreRequest, str]] = [
        (req("v", [4096]), "outside the vocabulary"),
        (req("v", [-1]), "outside the vocabulary"),
        (EngineCoreRequest(request_id="v"), "no prompt_token_ids"),
        (EngineCoreRequest(request_id="v", prompt_embeds=torch.zeros(2, 128)), "prompt_embeds"),
        (req("v", temperature=-0.5), "temperature"),
        (req("v", top_p=0.0), "top_p"),
        (req("v", top_p=1.5), "top_p"),
        (req("v", top_k=-2), "top_k"),
        (req("v", max_tokens=0), "max_tokens"),
        (req("v", max_tokens=4, min_tokens=5), "min_tokens"),
        (req("v", logprobs=21), "logprobs"),
        (
            EngineCoreRequest(
                request_id="v", prompt_token_ids=[1], pooling_params=PoolingParams(dimensions=129)
            ),
            "dimensions",
        ),
    ]
    for bad_request, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(bad_request)
    assert not engine.has_unfinished_requests()
    engine.add_request(req("dup", max_tokens=1))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(req("dup", max_tokens=1))
    run(engine)
    # top_k of -1 or at least the vocabulary means "off".
    assert gen(engine, top_k=-1, seed=8) == gen(engine, top_k=5000, seed=8) == gen(engine, seed=8)


def test_max_batch_abort_and_stats() -> None:
    eng = ReferenceEngine(device="cpu", max_batch=2, record_events=True)
    for i in range(5):
        eng.add_request(req(f"q{i}", max_tokens=3, temperature=0.0))
    eng.add_request(
        EngineCoreRequest(request_id="pool", prompt_token_ids=[1], pooling_params=PoolingParams())
    )
    assert eng.scheduler_stats() == {
        "num_running_reqs": 0,
        "num_waiting_reqs": 6,
        "step_counter": 0,
    }
    eng.abort_requests(["q4", "pool", "unknown"])
    first = eng.step()
    assert [o.request_id for o in first] == ["q0", "q1"]  # one batch of max_batch
    types = [e.type for e in first[0].events]
    assert types == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert eng.scheduler_stats()["num_running_reqs"] == 2
    assert eng.scheduler_stats()["num_waiting_reqs"] == 2
    eng.abort_requests(["q0", "q2"])
    outs = run(eng)
    assert set(outs) == {"q1", "q3"}
    assert eng.scheduler_stats()["num_running_reqs"] == 0
    assert eng.scheduler_stats()["num_waiting_reqs"] == 0


def test_pause_and_sleep_stop_stepping(engine: ReferenceEngine) -> None:
    expected = gen(engine, temperature=0.0, max_tokens=2)
    engine.pause_scheduler()
    engine.add_request(req("held", temperature=0.0, max_tokens=2))
    assert not engine.has_unfinished_requests() and engine.is_scheduler_paused()
    engine.resume_scheduler()
    assert tokens(run(engine)["held"]) == expected
    for level in (1, 2):
        engine.sleep(level)
        assert engine.is_sleeping() and not engine.has_unfinished_requests()
        engine.add_request(req(f"asleep{level}", temperature=0.0, max_tokens=2))
        assert not engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="unknown wake-up tags"):
            engine.wake_up(["everything"])
        engine.wake_up(["weights"])
        assert engine.is_sleeping()
        engine.wake_up(["kv_cache"])
        assert not engine.is_sleeping()
        assert tokens(run(engine)[f"asleep{level}"]) == expected


def test_prompt_logprobs_match_what_generation_sees() -> None:
    eng = ReferenceEngine(device="cpu")
    prompt = [5, 6, 7, 8, 9]
    (first, *_) = run(eng, req("p", prompt, temperature=0.0, max_tokens=2, prompt_logprobs=2))["p"]
    lp = first.new_prompt_logprobs_tensors
    # One row per prompt token after the first: that token, then the top 2.
    assert lp.logprob_token_ids.shape == lp.logprobs.shape == (4, 3)
    assert lp.logprob_token_ids[:, 0].tolist() == prompt[1:]
    assert lp.selected_token_ranks.shape == (4,) and bool((lp.selected_token_ranks >= 1).all())
    # Row 1 predicts prompt[2] from prompt[:2]: its top-1 is what greedy generation
    # picks after prompt[:2], with the same logprob.
    (out,) = run(eng, req("g", prompt[:2], temperature=0.0, max_tokens=1, logprobs=1))["g"]
    assert lp.logprob_token_ids[1, 1].item() == out.new_token_ids[0]
    # (batch shapes differ, so equal up to float rounding)
    assert lp.logprobs[1, 1].item() == pytest.approx(
        float(out.new_logprobs.logprobs[0, 0]), abs=1e-4
    )
    # A one-token prompt has no rows; only the first output carries them.
    outs = run(eng, req("one", [5], temperature=0.0, max_tokens=2, prompt_logprobs=0))["one"]
    assert outs[0].new_prompt_logprobs_tensors.logprobs.shape == (0, 1)
    assert outs[1].new_prompt_logprobs_tensors is None
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        eng.add_request(req("bad", prompt_logprobs=21))


def test_sleep_follows_vllms_levels_and_modes() -> None:
    eng = ReferenceEngine(device="cpu")
    expected = gen(eng, "base", temperature=0.0, max_tokens=3)
    # Level 0 is a pause only; the "scheduling" tag ends it.
    assert eng.sleep(0, "keep") is None
    assert eng.is_sleeping() and eng.is_scheduler_paused() and eng._model is not None
    eng.wake_up(["scheduling"])
    assert not eng.is_sleeping()
    # "wait": the reply waits until the request in flight finished, then level 2
    # discards the weights; waking up rebuilds them and scheduling resumes.
    eng.add_request(req("inflight", temperature=0.0, max_tokens=3))
    slept = eng.sleep(2, "wait")
    assert isinstance(slept, concurrent.futures.Future) and not slept.done()
    outs = run(eng)
    assert slept.result(timeout=0) is None
    assert tokens(outs["inflight"]) == expected and eng._model is None and eng.is_sleeping()
    eng.wake_up()
    assert not eng.is_sleeping() and gen(eng, "again", temperature=0.0, max_tokens=3) == expected
    # "abort": running requests finish as ABORT before the model is released.
    eng.add_request(req("cut", temperature=0.0, max_tokens=50))
    eng.step()
    assert eng.sleep(1, "abort") is None
    (cut,) = run(eng)["cut"]
    assert cut.finish_reason == FinishReason.ABORT and eng.is_sleeping()
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2, got 3"):
        eng.sleep(3)
    with pytest.raises(ValueError, match="pause mode"):
        eng.sleep(1, "later")


def test_pause_modes_abort_and_wait() -> None:
    eng = ReferenceEngine(device="cpu", max_batch=2)
    for rid, n in (("a", 3), ("b", 5), ("queued", 2)):
        eng.add_request(req(rid, temperature=0.0, max_tokens=n))
    eng.step()
    # "abort": every request in flight or queued finishes now with ABORT.
    assert eng.pause_scheduler("abort") is None
    assert eng.has_unfinished_requests()  # the finishes are still owed
    finishes = eng.step()
    assert {o.request_id for o in finishes} == {"a", "b", "queued"}
    assert all(o.finish_reason == FinishReason.ABORT and not o.new_token_ids for o in finishes)
    assert not eng.has_unfinished_requests() and eng.is_scheduler_paused()
    assert eng.scheduler_stats()["num_running_reqs"] == 0
    eng.add_request(req("a", temperature=0.0, max_tokens=1))  # the id is free again
    eng.resume_scheduler()
    assert len(run(eng)["a"]) == 1

    # "wait": every request held at the call (running or queued) finishes; requests
    # that arrive later are held; the future resolves when the last held one finished.
    for rid, n in (("w1", 2), ("w2", 4), ("w3", 2)):
        eng.add_request(req(rid, temperature=0.0, max_tokens=n))
    eng.step()
    future = eng.pause_scheduler("wait")
    assert isinstance(future, concurrent.futures.Future) and not future.done()
    assert eng.is_scheduler_paused()
    eng.add_request(req("late", temperature=0.0, max_tokens=2))
    eng.add_request(
        EngineCoreRequest(
            request_id="late-pool", prompt_token_ids=[1], pooling_params=PoolingParams()
        )
    )
    outs = run(eng)
    assert future.done() and future.result() is None
    assert [len(tokens(outs[r])) for r in ("w1", "w2", "w3")] == [1, 3, 2]
    assert "late" not in outs and "late-pool" not in outs
    assert eng.scheduler_stats()["num_waiting_reqs"] == 2
    # Pausing a paused engine with "wait" resolves at once.
    assert eng.pause_scheduler("wait").done()
    eng.resume_scheduler()
    outs = run(eng)
    assert len(tokens(outs["late"])) == 2 and outs["late-pool"][0].pooling_output is not None
    # A drain whose requests are all aborted completes too.
    eng.add_request(req("gone", temperature=0.0, max_tokens=50))
    eng.step()
    future = eng.pause_scheduler("wait")
    eng.abort_requests(["gone"])
    assert future.done() and not eng.has_unfinished_requests()
    eng.resume_scheduler()
    with pytest.raises(ValueError, match="pause mode"):
        eng.pause_scheduler("later")


# ---------------------------------------------------------------------- utilities


def test_utility_methods(engine: ReferenceEngine, tmp_path: Path) -> None:
    assert engine.get_supported_tasks() == ["generate", "embed"]
    assert engine.echo({"a": [1]}) == {"a": [1]}
    assert engine.collective_rpc("echo", None, [1, 2]) == [[1, 2]]
    assert engine.collective_rpc("echo", args=[3]) == [3]
    assert engine.collective_rpc("dtype") == ["float32"]
    assert engine.collective_rpc("num_parameters")[0] > 500_000
    with pytest.raises(ValueError, match="public worker method"):
        engine.collective_rpc("_engine")
    assert engine.reset_prefix_cache() is True
    future = engine.delayed_echo("later", 0.05)
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(timeout=5) == "later"

    # Profiler: a real Chrome trace named by vLLM's profile_prefix, written only into
    # the engine's profile_dir; a prefix that is a path is refused.
    eng = ReferenceEngine(device="cpu", profile_dir=str(tmp_path))
    eng.profile(True, "run1")
    with pytest.raises(RuntimeError, match="already running"):
        eng.profile(True)
    gen(eng, temperature=0.0, max_tokens=2)
    path = Path(eng.profile(False))
    assert path.parent == tmp_path and path.name.startswith("run1-")
    assert "traceEvents" in json.loads(path.read_text())
    with pytest.raises(RuntimeError, match="not running"):
        eng.profile(False)
    for bad in ("../escape", str(tmp_path / "abs"), "", ".."):
        with pytest.raises(ValueError, match="file-name prefix, not a path"):
            eng.profile(True, bad)
    assert sorted(tmp_path.iterdir()) == [path]
    # Without a profile_dir: a private directory made on first use.
    engine.profile(True)
    prefixed = Path(engine.profile(False, "corewire-test-prefix"))
    try:
        assert prefixed.name.startswith("corewire-test-prefix-") and prefixed.is_file()
        assert prefixed.parent.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(prefixed.parent)


def test_fail_next_step_and_shutdown_cancels_pending_futures() -> None:
    from hook_engine import HookEngine

    eng = HookEngine(device="cpu")
    with pytest.raises(RuntimeError, match="boom"):
        eng.raise_error("boom")
    eng.fail_next_step("kaboom")
    eng.add_request(req("x", max_tokens=1))
    with pytest.raises(RuntimeError, match="kaboom"):
        eng.step()
    assert len(eng.step()) == 1  # only the next step fails
    pending = eng.delayed_echo(1, 30.0)
    eng.profile(True)
    eng.shutdown()
    assert pending.cancelled()
    with pytest.raises(RuntimeError, match="not running"):
        eng.profile(False)


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="dtype"):
        ReferenceEngine(device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="max_batch"):
        ReferenceEngine(device="cpu", max_batch=0)
    with pytest.raises(ValueError, match="eos_token_id"):
        ReferenceEngine(device="cpu", eos_token_id=4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_the_contract() -> None:
    eng = ReferenceEngine(device="auto")
    assert eng.device.type == "cuda"
    outs = run(
        eng,
        req("c1", temperature=0.0, max_tokens=8, logprobs=3),
        req("c2", top_k=20, top_p=0.9, seed=3, max_tokens=8),
        EngineCoreRequest(request_id="c3", prompt_token_ids=PROMPT, pooling_params=PoolingParams()),
    )
    assert len(tokens(outs["c1"])) == 8 and len(tokens(outs["c2"])) == 8
    assert outs["c1"][0].new_logprobs.logprobs.dtype == np.float32
    emb = outs["c3"][0].pooling_output
    assert emb.device.type == "cpu" and emb.shape == (128,)
    seeded = tokens(run(eng, req("c4", top_k=20, top_p=0.9, seed=3, max_tokens=8))["c4"])
    assert seeded == tokens(outs["c2"])
    for dtype in ("bfloat16", "float16"):
        low = ReferenceEngine(device="cuda", dtype=dtype)
        assert len(tokens(run(low, req("d", temperature=0.0, max_tokens=4))["d"])) == 4
    eng.sleep(1)
    eng.wake_up()
    assert tokens(run(eng, req("c5", temperature=0.0, max_tokens=8))["c5"]) == tokens(outs["c1"])


# ---------------------------------------------------------------------- loading & proc


def test_load_engine_specs() -> None:
    assert isinstance(load_engine(None, {"device": "cpu"}), ReferenceEngine)
    assert isinstance(load_engine("reference", {"device": "cpu"}), ReferenceEngine)
    eng = load_engine("corewire.engine.reference:ReferenceEngine", {"device": "cpu"})
    assert isinstance(eng, ReferenceEngine)
    with pytest.raises(ValueError, match="module:Class"):
        load_engine("no_colon")
    with pytest.raises(TypeError, match="does not implement the Engine interface"):
        load_engine("collections:OrderedDict")
    with pytest.raises(ModuleNotFoundError):
        load_engine("corewire_no_such_module:X")
    with pytest.raises(TypeError):
        Engine()  # type: ignore[abstract]


def test_proc_in_a_thread_reports_finished_sets(ipc_dir: Path) -> None:
    """``include_finished_set`` (used by data-parallel front-ends) reports every finished
    or aborted id, also while the engine is idle; driven in-process over real sockets."""
    from engine_support import FrontEnd

    fe = FrontEnd(ipc_dir, "thread")
    proc = EngineCoreProc(
        ReferenceEngine(device="cpu"),
        input_address=fe.input_address,
        output_address=fe.output_address,
        include_finished_set=True,
        idle_poll_s=0.05,
    )
    status: queue.SimpleQueue[int] = queue.SimpleQueue()
    thread = threading.Thread(target=lambda: status.put(proc.run()), name="test-engine-proc")
    thread.start()
    try:
        fe.wait_ready()
        fe.add(req("done", max_tokens=2, temperature=0.0))
        finished: set[str] = set()
        while "done" not in finished:
            msg = fe.recv()
            assert isinstance(msg, EngineCoreOutputs)
            finished |= msg.finished_requests or set()
        fe.add(req("aborted", max_tokens=2000, temperature=0.0))
        fe.recv()
        fe.abort(["aborted"])
        while True:
            msg = fe.recv()
            if msg.finished_requests:
                assert msg.finished_requests == {"aborted"}
                break
    finally:
        proc.request_stop()
        thread.join(20)
        fe.close()
    assert status.get_nowait() == 0
