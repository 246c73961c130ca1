"""Zero copy: arrays and tensors from aux frames are views that keep their frame alive.

A decoded aux ndarray shares memory with its frame and a decoded tensor points into it;
the array stays valid after the frame list and the decoded message are dropped; the frame
is freed once the last array is gone, with no leak over 10,000 frames. Frames are
``bytes``, ``memoryview`` and real ``zmq.Frame`` objects received over a PAIR socket with
``copy=False``.

Checks ``docs/protocol.md`` §6.2 (aux frames) on the receiving side.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import zmq

from codec_support import make_decoder, nd, outputs_msg, pack
from corewire import protocol as p
from corewire.codec import Encoder

DECODERS = ["msgspec", "native"]


class Storage(bytearray):
    """Frame memory that can be weakly referenced, to see when it is freed."""


@pytest.fixture(params=DECODERS)
def decoder(request: pytest.FixtureRequest) -> Any:
    """Each decoder under test: the reference MsgspecDecoder and the Rust NativeDecoder."""
    return make_decoder(request.param)


@pytest.fixture
def pair(ipc_dir: Path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A connected PUSH-like PAIR of sockets over ipc:// in this test's private dir."""
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PAIR)
    receiver = ctx.socket(zmq.PAIR)
    sender.linger = receiver.linger = 0
    endpoint = f"ipc://{ipc_dir}/zero-copy"
    receiver.bind(endpoint)
    sender.connect(endpoint)
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def _address_range(frame: Any) -> tuple[int, int]:
    buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
    view = np.frombuffer(buf, dtype=np.uint8)
    return view.ctypes.data, view.nbytes


def _frame_bytes(frame: Any) -> np.ndarray:
    return np.frombuffer(frame.buffer if isinstance(frame, zmq.Frame) else frame, np.uint8)


def _message(seed: int = 0) -> tuple[list[bytes], dict[str, Any]]:
    """Frames with an aux ndarray (routed_experts), aux logprobs and an aux bf16 tensor."""
    experts = (np.arange(1024, dtype="<i4") + seed).reshape(256, 4)
    ids = np.arange(64 * 6, dtype="<i8").reshape(64, 6) - seed
    vals = -np.arange(64 * 6, dtype="<f4").reshape(64, 6)
    ranks = np.arange(64, dtype="<i4")
    pooling = (torch.arange(512, dtype=torch.float32) + seed).bfloat16()
    out = [
        "req",
        [1],
        [nd("<i8", [64, 6], 2), nd("<f4", [64, 6], 3), nd("<i4", [64], 4)],
        None,
        nd("bfloat16", [512], 5),
        None,
        None,
        None,
        None,
        None,
        None,
        nd("<i4", [256, 4], 1),
        0,
    ]
    frames = [
        pack(outputs_msg(outputs=[out])),
        experts.tobytes(),
        ids.tobytes(),
        vals.tobytes(),
        ranks.tobytes(),
        pooling.view(torch.uint8).numpy().tobytes(),
    ]
    expected = {"experts": experts, "ids": ids, "vals": vals, "pooling": pooling}
    return frames, expected


def _as_kind(frames: list[bytes], kind: str) -> list[Any]:
    if kind == "bytes":
        return list(frames)
    return [memoryview(Storage(f)) for f in frames]


@pytest.mark.parametrize("kind", ["bytes", "memoryview"])
def test_aux_arrays_share_frame_memory(decoder: Any, kind: str) -> None:
    """Every aux ndarray is a view of its own frame; the tensor's data lies inside its frame."""
    frames = _as_kind(_message()[0], kind)
    out = decoder.decode(frames).outputs[0]
    assert np.shares_memory(out.routed_experts, _frame_bytes(frames[1]))
    assert np.shares_memory(out.new_logprobs.logprob_token_ids, _frame_bytes(frames[2]))
    assert np.shares_memory(out.new_logprobs.logprobs, _frame_bytes(frames[3]))
    assert np.shares_memory(out.new_logprobs.sampled_token_ranks, _frame_bytes(frames[4]))
    start, size = _address_range(frames[5])
    assert out.pooling_output.data_ptr() == start
    assert out.pooling_output.untyped_storage().nbytes() <= size


def test_bytes_frames_give_read_only_arrays(decoder: Any) -> None:
    """Views of immutable ``bytes`` frames must not be writable."""
    out = decoder.decode(_message()[0]).outputs[0]
    assert not out.routed_experts.flags.writeable
    assert not out.new_logprobs.logprobs.flags.writeable
    with pytest.raises(ValueError):
        out.routed_experts[0, 0] = 1


@pytest.mark.parametrize("field", ["experts", "pooling"])
def test_array_outlives_frames_and_message(decoder: Any, field: str) -> None:
    """Kept alone, an aux array holds its frame; dropping it frees the frame."""
    frames_bytes, expected = _message(seed=3)
    storage = [Storage(f) for f in frames_bytes]
    refs = [weakref.ref(s) for s in storage]
    frames = [memoryview(s) for s in storage]
    decoded = decoder.decode(frames)
    out = decoded.outputs[0]
    kept = out.routed_experts if field == "experts" else out.pooling_output
    index = 1 if field == "experts" else 5
    del frames, storage, decoded, out
    gc.collect()
    # Churn the allocator so that freed memory would be reused and show up as corruption.
    junk = [bytearray(b"\xee" * 4096) for _ in range(200)]
    if field == "experts":
        assert np.array_equal(kept, expected["experts"])
    else:
        assert torch.equal(kept, expected["pooling"])
    del junk
    assert refs[index]() is not None, "the array's frame was freed under it"
    assert all(r() is None for i, r in enumerate(refs) if i != index), "unused frames kept"
    del kept
    gc.collect()
    assert refs[index]() is None, "the frame outlived its last array"


def test_no_frame_leak_over_10000_messages(decoder: Any) -> None:
    """10,000 decoded messages whose arrays were read then dropped leave no frame alive."""
    experts = (np.arange(1024, dtype="<i4")).reshape(256, 4).tobytes()
    payload = _experts_payload(nd("<i4", [256, 4], 1))
    refs = []
    checksum = 0
    for _ in range(10_000):
        storage = Storage(experts)
        refs.append(weakref.ref(storage))
        out = decoder.decode([payload, memoryview(storage)]).outputs[0]
        checksum += int(out.routed_experts[1, 0])
        del storage, out
    assert checksum == 10_000 * 4
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of 10000 frames still alive"


def _experts_payload(experts: list[Any]) -> bytes:
    """A payload with one output whose only array is ``routed_experts``."""
    out = ["req", [1], None, None, None, None, None, None, None, None, None, experts, 0]
    return pack(outputs_msg(outputs=[out]))


def test_no_memory_growth_over_10000_bytes_frames(decoder: Any) -> None:
    """RSS stays flat over 10,000 messages with 32 KiB ``bytes`` aux frames (no leak)."""
    payload = _experts_payload(nd("<i8", [4096], 1))
    process = psutil.Process()

    def run(count: int) -> None:
        for i in range(count):
            aux = i.to_bytes(8, "little") * 4096  # a fresh 32 KiB bytes object each time
            out = decoder.decode([payload, aux]).outputs[0]
            if out.routed_experts[7] != i:
                raise AssertionError("wrong value decoded")

    run(1000)  # warm up allocator pools and caches
    gc.collect()
    before = process.memory_info().rss
    run(10_000)
    gc.collect()
    grown = process.memory_info().rss - before
    # A leaked frame per message would be 320 MiB; allow allocator noise.
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 10000 frames"


# --------------------------------------------------------------------------- zmq frames


def _send(sender: zmq.Socket, message: p.EngineCoreOutputs) -> None:
    sender.send_multipart(Encoder(release="0.25.1").encode(message), copy=False)


def _experts_message(i: int) -> p.EngineCoreOutputs:
    experts = np.full((64, 8), i, dtype="<i4")  # 2 KiB: aux frame
    pooling = torch.full((300,), float(i % 256)).bfloat16()  # 600 bytes: aux frame
    return p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput(f"r{i}", [i], pooling_output=pooling, routed_experts=experts)]
    )


def test_zmq_frames_zero_copy(decoder: Any, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    """Arrays from received ``zmq.Frame`` objects are views of the frames' own memory."""
    sender, receiver = pair
    _send(sender, _experts_message(5))
    frames = receiver.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    assert len(frames) == 3
    out = decoder.decode(frames).outputs[0]
    aux = {np.shares_memory(out.routed_experts, _frame_bytes(f)) for f in frames[1:]}
    assert aux == {True, False}
    starts = [_address_range(f)[0] for f in frames[1:]]
    assert out.pooling_output.data_ptr() in starts
    assert int(out.routed_experts[3, 3]) == 5
    assert out.pooling_output.float().tolist() == [5.0] * 300


def test_zmq_frame_freed_after_last_array(
    decoder: Any, pair: tuple[zmq.Socket, zmq.Socket]
) -> None:
    """A zmq.Frame lives as long as an array decoded from it, and no longer."""
    sender, receiver = pair
    _send(sender, _experts_message(9))
    frames = receiver.recv_multipart(copy=False)
    refs = [weakref.ref(f) for f in frames]
    decoded = decoder.decode(frames)
    experts = decoded.outputs[0].routed_experts
    del frames, decoded
    gc.collect()
    assert int(experts.sum()) == 9 * 64 * 8
    assert sum(r() is not None for r in refs) == 1
    del experts
    gc.collect()
    assert all(r() is None for r in refs)


def test_zmq_no_frame_leak_over_10000_messages(
    decoder: Any, pair: tuple[zmq.Socket, zmq.Socket]
) -> None:
    """10,000 messages received and decoded over a socket leave no zmq.Frame alive."""
    sender, receiver = pair
    refs: list[weakref.ref] = []
    kept: list[Any] = []
    for i in range(10_000):
        _send(sender, _experts_message(i))
        frames = receiver.recv_multipart(copy=False)
        refs.extend(weakref.ref(f) for f in frames)
        out = decoder.decode(frames).outputs[0]
        if out.request_id != f"r{i}" or int(out.routed_experts[0, 0]) != i:
            raise AssertionError(f"message {i} decoded wrongly")
        if i % 1000 == 0:
            kept.append(out.routed_experts)  # a few arrays outlive their messages
        del frames, out
    for j, array in enumerate(kept):
        assert int(array[63, 7]) == j * 1000
    del kept, array
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} zmq frames still alive"
