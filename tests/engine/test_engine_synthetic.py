"""SyntheticEngine: the model-free engine behind the serve benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from client_support import DEFAULT_SAMPLING, request
from corewire.engine.synthetic import SyntheticEngine
from corewire.protocol import FinishReason


def _add(engine: SyntheticEngine, request_id: str, prompt: list[int], **params: object) -> None:
    engine.add_request(request(request_id, prompt=prompt, sampling={**DEFAULT_SAMPLING, **params}))


def _drain(engine: SyntheticEngine) -> dict[str, list]:
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_same_prompt_same_tokens_and_max_tokens() -> None:
    engine = SyntheticEngine()
    _add(engine, "a", [10, 11], max_tokens=7, ignore_eos=True)
    _add(engine, "b", [10, 11], max_tokens=7, ignore_eos=True)
    _add(engine, "c", [12], max_tokens=3, ignore_eos=True)
    seen = _drain(engine)
    tokens = {rid: [o.new_token_ids[0] for o in outs] for rid, outs in seen.items()}
    assert tokens["a"] == tokens["b"] and len(tokens["a"]) == 7
    assert tokens["c"] != tokens["a"][:3]
    assert all(4 <= t < 4096 for t in tokens["a"])
    assert [o.finish_reason for o in seen["a"]] == [None] * 6 + [FinishReason.LENGTH]


def test_stop_token_after_min_tokens() -> None:
    engine = SyntheticEngine()
    _add(engine, "probe", [100], max_tokens=6, ignore_eos=True)
    sequence = [o.new_token_ids[0] for o in _drain(engine)["probe"]]
    engine = SyntheticEngine()
    _add(engine, "s", [100], max_tokens=6, stop_token_ids=[sequence[1], sequence[3]], min_tokens=3)
    outs = _drain(engine)["s"]
    assert len(outs) == 4  # the stop at token 2 comes before min_tokens
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == sequence[3]


def test_logprobs_are_well_formed() -> None:
    engine = SyntheticEngine()
    _add(engine, "l", [1, 2, 3], max_tokens=2, logprobs=5)
    for out in _drain(engine)["l"]:
        lp = out.new_logprobs
        assert lp.logprob_token_ids.shape == (1, 6) and lp.logprob_token_ids.dtype == np.int32
        assert lp.logprob_token_ids[0, 0] == out.new_token_ids[0]
        assert lp.logprobs.dtype == np.float32 and np.all(np.diff(lp.logprobs[0, 1:]) < 0)
        assert lp.sampled_token_ranks.tolist() == [1]


def test_abort_and_batch_limit() -> None:
    engine = SyntheticEngine(max_batch=2)
    for i in range(3):
        _add(engine, f"r{i}", [i + 5], max_tokens=50, ignore_eos=True)
    assert {o.request_id for o in engine.step()} == {"r0", "r1"}
    engine.abort_requests(["r0", "unknown"])
    assert {o.request_id for o in engine.step()} == {"r1", "r2"}
    assert engine.scheduler_stats() == {"num_running_reqs": 2, "num_waiting_reqs": 0}


@pytest.mark.parametrize(
    ("prompt", "params"),
    [([], {}), ([5000], {}), ([1] * 2048, {}), ([1, 2], {"max_tokens": 1})],
)
def test_bad_requests_are_refused(prompt: list[int], params: dict) -> None:
    engine = SyntheticEngine()
    if params:
        _add(engine, "dup", [1], **params)
        prompt, request_id = [1], "dup"
    else:
        request_id = "x"
    with pytest.raises(ValueError):
        _add(engine, request_id, prompt, **params)
