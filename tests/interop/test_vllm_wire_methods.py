"""The methods vLLM's front-end calls on decoded wire objects, on corewire's decoded ones.

corewire's client hands vLLM's front-end its own classes of the output structs
(``corewire.protocol.LogprobsLists``, ``corewire.wire.layouts.SamplingMaskLists`` and the
native ``EngineCoreOutput``). Where vLLM's output processor calls a method on them or
assigns a field (0.32.0 on: ``_trim_surplus_tokens`` cuts a step's tokens, logprobs and
sampling masks where a stop string ends the text; ``make_request_output`` lists a
request's masks), corewire's must answer as vLLM's classes do: compared here with the
installed vLLM's, on random arrays, and through ``_trim_surplus_tokens`` itself.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1 import outputs as vllm_outputs
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.serial_utils import MsgpackEncoder

from corewire import protocol
from corewire.vllm.adapters.client import make_output_decoder
from corewire.wire import layouts

VLLM_MASKS = getattr(vllm_outputs, "SamplingMaskLists", None)


def _same(ours: Any, theirs: Any) -> None:
    """Equal field by field (arrays by dtype, shape and values)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype
            assert a.shape == b.shape and np.array_equal(a, b)
        else:
            assert a == b


def _lists(rng: random.Random, rows: int, width: int) -> tuple[np.ndarray, ...]:
    ids = np.array([[rng.randrange(1000) for _ in range(width)] for _ in range(rows)])
    values = np.array([[rng.uniform(-9, 0) for _ in range(width)] for _ in range(rows)])
    ranks = np.array([rng.randrange(1, 50) for _ in range(rows)])
    return ids.astype(np.int32), values.astype(np.float32), ranks.astype(np.int64)


@pytest.mark.parametrize("seed", range(20))
def test_logprobs_lists_slice_as_vllms(seed: int) -> None:
    rng = random.Random(seed)
    rows = rng.randrange(1, 12)
    arrays = _lists(rng, rows, rng.randrange(1, 6))
    cu = None
    if rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, rows + 1), rng.randrange(0, min(rows, 4))))
        cu = [0, *cuts]
    ours = protocol.LogprobsLists(*arrays, cu)
    theirs = vllm_outputs.LogprobsLists(*arrays, cu)
    for _ in range(5):
        req = rng.randrange(len(cu)) if cu else rng.randrange(rows)
        start = cu[req] if cu else req
        count = rng.randrange(0, rows - start + 1)
        cut = ours.slice_request(req, count)
        assert type(cut) is protocol.LogprobsLists
        _same(cut, theirs.slice_request(req, count))
        assert all(np.shares_memory(a, b) for a, b in zip(cut[:3], arrays, strict=True) if a.size)


@pytest.mark.skipif(VLLM_MASKS is None, reason="the installed vLLM has no sampling masks")
@pytest.mark.parametrize("seed", range(20))
def test_sampling_masks_slice_and_list_as_vllms(seed: int) -> None:
    rng = random.Random(seed)
    positions = rng.randrange(1, 8)
    sizes = [rng.randrange(0, 5) for _ in range(positions)]
    offsets = np.cumsum([0, *sizes]).astype(np.int64)
    ids = np.array([rng.randrange(1000) for _ in range(int(offsets[-1]))], dtype=np.int32)
    cu = [0, *sorted(rng.sample(range(1, positions + 1), min(positions, 2)))]
    for cu_ids in (None, cu):
        ours = layouts.SamplingMaskLists(ids, offsets, cu_ids)
        theirs = VLLM_MASKS(ids, offsets, cu_ids)
        assert ours.to_nested_list() == theirs.to_nested_list()
        starts = cu_ids or range(positions)
        req = rng.choice([i for i, at in enumerate(starts) if at < positions])
        start = starts[req]
        count = rng.randrange(1, positions - start + 1)
        cut = ours.slice_request(req, count)
        expected = theirs.slice_request(req, count)
        assert type(cut) is layouts.SamplingMaskLists
        assert (cut.offsets is None) == (expected.offsets is None)
        _same(cut[:1], expected[:1])
        if cut.offsets is not None:
            _same(cut[1:2], expected[1:2])
        assert cut.to_nested_list() == expected.to_nested_list()
    single = layouts.SamplingMaskLists(ids[:3])
    assert single.to_nested_list() == VLLM_MASKS(ids[:3]).to_nested_list()
    with pytest.raises(ValueError, match="one position"):
        single.slice_request(0, 1)


@pytest.mark.skipif(
    not hasattr(OutputProcessor, "_trim_surplus_tokens"),
    reason="the installed vLLM does not trim surplus tokens (before 0.32.0)",
)
@pytest.mark.parametrize("kept", [0, 1, 2])
def test_trim_surplus_tokens_on_a_decoded_output(kept: int) -> None:
    """vLLM's own ``_trim_surplus_tokens`` on corewire's decoded output (assigning
    ``new_logprobs`` and, 0.33.0 on, ``new_sampling_mask``) leaves what it leaves on
    vLLM's struct."""
    rng = random.Random(kept)
    arrays = _lists(rng, 3, 4)
    fields: dict[str, Any] = {"new_logprobs": vllm_outputs.LogprobsLists(*arrays)}
    if VLLM_MASKS is not None:
        offsets = np.array([0, 2, 3, 5], dtype=np.int64)
        fields["new_sampling_mask"] = VLLM_MASKS(np.arange(5, dtype=np.int32), offsets)
    theirs = EngineCoreOutput(request_id="r", new_token_ids=[7, 8, 9], **fields)
    frames = MsgpackEncoder().encode(EngineCoreOutputs(outputs=[theirs]))
    message = make_output_decoder().decode([bytes(f) for f in frames])
    ours = message.outputs[0]
    # The request's state as _trim_surplus_tokens reads it: its detokenizer's count of
    # output tokens after this step (the stop string ends `kept` tokens in).
    state = SimpleNamespace(
        detokenizer=SimpleNamespace(num_output_tokens=lambda: 10 + kept),
        routed_experts_chunks=[],
    )
    for output in (ours, theirs):
        OutputProcessor._trim_surplus_tokens(state, output, 10)
    assert ours.new_token_ids == theirs.new_token_ids == [7, 8, 9][:kept]
    _same(ours.new_logprobs, theirs.new_logprobs)
    if VLLM_MASKS is not None:
        assert ours.new_sampling_mask.to_nested_list() == (
            theirs.new_sampling_mask.to_nested_list()
        )
