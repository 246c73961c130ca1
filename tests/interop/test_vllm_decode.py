"""corewire's NativeDecoder against vLLM 0.25.1's own decoder, field by field.

Frames are made by vLLM's real ``MsgpackEncoder`` from vLLM's real ``EngineCoreOutputs``,
in the shapes vLLM's scheduler sends: per-output ``LogprobsLists`` sliced from the step's
arrays (tiny, inline), several rows per output (speculative decoding), rows large enough
to travel as aux frames, and prompt logprobs as ``LogprobsTensors``. Each frame is decoded
by vLLM's ``MsgpackDecoder`` and by corewire's decoder; every field of every output must
be equal (arrays by dtype, shape and bytes), and so must what vLLM's logprobs processing
makes of the arrays. Messages are decoded one after another with the previous one
dropped, so corewire's recycled logprobs tuples are exercised too.

Checks ``docs/protocol.md`` §5.2-§5.3 (outputs), §5.7 (``LogprobsLists`` and
``LogprobsTensors``) and §6.1-§6.2 (arrays inline and as aux frames).
"""

from __future__ import annotations

import enum
import random
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import LogprobsLists, LogprobsTensors
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from corewire.codec import NativeDecoder
from vllm_support import require_vllm_0_25_1

require_vllm_0_25_1()

VOCAB = 151_000


def plain(v: Any) -> Any:
    """Comparable form of a decoded value: arrays and tensors by dtype, shape and bytes,
    enums by name and value, named tuples by class name and items."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape), v.contiguous().numpy().tobytes())
    if isinstance(v, enum.Enum):
        return ("enum", v.name, v.value)
    if isinstance(v, tuple):
        return (type(v).__name__, *(plain(x) for x in v))
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return (type(v).__name__, v)


def processed(message: Any) -> list[Any]:
    """What vLLM's LogprobsProcessor takes from the arrays (its unpacking, row iteration
    and ``tolist`` calls), for every output."""
    got = []
    for out in message.outputs:
        lp = out.new_logprobs
        if lp is not None:
            token_ids, logprobs, ranks, _ = lp
            for rank, row, ids in zip(ranks, logprobs, token_ids, strict=True):
                got.append((rank.tolist(), row.tolist(), ids.tolist()))
        lp = out.new_prompt_logprobs_tensors
        if lp is not None:
            token_ids, logprobs, ranks, _ = lp
            got.append((ranks.tolist(), logprobs.tolist(), token_ids.flatten().tolist()))
    return got


def step(rng: random.Random, batch: int, *, k: int, rows: int, prompt: int) -> EngineCoreOutputs:
    """One engine step: ``rows`` tokens per output with top-``k`` logprobs sliced from the
    step's arrays (``k < 0``: none), and prompt logprobs of ``prompt`` tokens on every
    third output (0: none)."""
    n = batch * rows
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    ids = np.array([[t] + [rng.randrange(VOCAB) for _ in range(k)] for t in tokens], np.int32)
    lps = -np.array(
        [[rng.random() * 9 for _ in range(max(k, 0) + 1)] for _ in range(n)], np.float32
    )
    ranks = np.array([rng.randrange(1, 30) for _ in range(n)], np.int64)
    step_lists = LogprobsLists(ids, lps, ranks)
    outputs = []
    for i in range(batch):
        prompt_lp = None
        if prompt and i % 3 == 0:
            prompt_lp = LogprobsTensors(
                torch.randint(0, VOCAB, (prompt, k + 1), dtype=torch.int32),
                -torch.rand((prompt, k + 1), dtype=torch.float32),
                torch.randint(1, 30, (prompt,), dtype=torch.int64),
            )
        finished = rng.random() < 0.1
        outputs.append(
            EngineCoreOutput(
                request_id=f"cmpl-{rng.getrandbits(64):016x}-0",
                new_token_ids=tokens[i * rows : (i + 1) * rows],
                new_logprobs=None if k < 0 else step_lists.slice_request(i * rows, rows),
                new_prompt_logprobs_tensors=prompt_lp,
                finish_reason=FinishReason.LENGTH if finished else None,
                stop_reason=None,
            )
        )
    return EngineCoreOutputs(engine_index=0, outputs=outputs, timestamp=1.5)


def writable(frames: list[Any]) -> list[bytearray]:
    """The frames as writable buffers: vLLM's decoder hands inline tensor bytes to
    ``torch.frombuffer``, which warns on read-only memory."""
    return [bytearray(f) for f in frames]


def assert_same(expected: Any, got: Any) -> None:
    fields = EngineCoreOutputs.__struct_fields__
    out_fields = EngineCoreOutput.__struct_fields__
    for name in fields:
        if name != "outputs":
            assert plain(getattr(got, name)) == plain(getattr(expected, name)), name
    assert len(got.outputs) == len(expected.outputs)
    for i, (x, y) in enumerate(zip(expected.outputs, got.outputs, strict=True)):
        for name in out_fields:
            assert plain(getattr(y, name)) == plain(getattr(x, name)), f"outputs[{i}].{name}"
    assert processed(got) == processed(expected)


SHAPES = {
    # name: (k, rows per output, prompt tokens)
    "plain": (-1, 1, 0),
    "top-5 inline": (5, 1, 0),
    "top-0 inline": (0, 1, 0),
    "top-20 inline": (20, 1, 0),
    "spec decode, 3 rows": (5, 3, 0),
    "rows over 256 bytes: aux frames": (20, 4, 0),
    "prompt logprobs, aux tensors": (5, 1, 63),
    "prompt logprobs, inline tensors": (2, 1, 4),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_every_field_equals_vllm(shape: str, batch: int) -> None:
    k, rows, prompt = SHAPES[shape]
    rng = random.Random(f"{shape}-{batch}")
    torch.manual_seed(batch)
    encoder = MsgpackEncoder()
    frames = writable(encoder.encode(step(rng, batch, k=k, rows=rows, prompt=prompt)))
    assert_same(MsgpackDecoder(EngineCoreOutputs).decode(frames), NativeDecoder().decode(frames))


def test_consecutive_messages_with_changing_shapes() -> None:
    """One decoder over a run of steps whose logprobs change shape and placement from
    step to step, each message dropped before the next (the usual front-end pattern), some
    kept: every message equals vLLM's, the kept ones too at the end."""
    rng = random.Random(7)
    torch.manual_seed(7)
    encoder = MsgpackEncoder()
    vllm_decoder = MsgpackDecoder(EngineCoreOutputs)
    native = NativeDecoder()
    kept = []
    for i in range(60):
        k, rows, prompt = SHAPES[rng.choice(list(SHAPES))]
        message = step(rng, rng.randrange(1, 70), k=k, rows=rows, prompt=prompt)
        frames = writable(encoder.encode(message))
        expected = vllm_decoder.decode(frames)
        got = native.decode(frames)
        assert_same(expected, got)
        if i % 10 == 0:
            kept.append((expected, got))
        del got
    for expected, got in kept:
        assert_same(expected, got)
