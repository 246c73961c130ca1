"""Checks of NativeDecoder's own machinery (the codec tests cover the wire format).

The Rust decoder recycles output objects and ``new_token_ids`` lists, caches token ints,
predicts request ids from the previous message's order (per engine) and hands out
non-GC objects. These tests pin the behaviour that those tricks must not change: values
a caller kept are never touched again, every value is right whatever the order of ids,
and nothing decoded is tracked by the cyclic GC or leaks.
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref

import msgspec
import numpy as np
import pytest
import torch

from corewire import ProtocolError
from corewire import protocol as p
from corewire.codec import Encoder, MsgspecDecoder, NativeDecoder
from corewire.wire import layouts


def _frames(outputs: list[p.EngineCoreOutput], **fields: object) -> list[bytes]:
    message = p.EngineCoreOutputs(outputs=outputs, **fields)  # type: ignore[arg-type]
    return [bytes(f) for f in Encoder(release="0.25.1").encode(message)]


def _step(ids: list[str], token: int, engine: int = 0) -> list[bytes]:
    outs = [p.EngineCoreOutput(rid, [token + i]) for i, rid in enumerate(ids)]
    return _frames(outs, engine_index=engine)


def test_fields_mirror_the_protocol_structs() -> None:
    """corewire.protocol's field names in its order first (then those of vLLM 0.33.0)."""
    fields = NativeDecoder(release="0.25.1").decode(_step(["a"], 1)).__struct_fields__
    assert fields[: len(p.EngineCoreOutputs.__struct_fields__)] == (
        p.EngineCoreOutputs.__struct_fields__
    )
    out = NativeDecoder(release="0.25.1").decode(_step(["a"], 1)).outputs[0]
    out_fields = type(out).__struct_fields__
    assert out_fields[: len(p.EngineCoreOutput.__struct_fields__)] == (
        p.EngineCoreOutput.__struct_fields__
    )
    # every release's fields: 0.33.0's, and 0.34.0's watermarking
    assert set(out_fields) == {
        *layouts.V0_33_0_TYPES["EngineCoreOutput"].__struct_fields__,
        "watermarking",
    }
    assert type(out).__module__ == "corewire._native"
    assert "request_id='a'" in repr(out)
    with pytest.raises(TypeError):
        type(out)()
    with pytest.raises(AttributeError):
        out.request_id = "b"  # type: ignore[misc]


def test_the_fields_vllm_assigns_take_new_values_and_release_old_ones() -> None:
    """``new_logprobs`` and the out-of-line fields (``new_sampling_mask`` among them)
    take new values, as vLLM's output processor assigns them (0.32.0 on); the other
    fields stay read-only, no field can be deleted, and every value's reference is
    released once replaced or once the output dies."""
    # Every release decodes into the same output type, which has every release's fields.
    out = NativeDecoder(release="0.25.1").decode(_step(["a"], 1)).outputs[0]
    first, second, mask = object(), object(), object()
    base = [sys.getrefcount(x) for x in (first, second, mask)]
    out.new_logprobs = first
    out.new_sampling_mask = mask
    assert out.new_logprobs is first and out.new_sampling_mask is mask
    assert out.watermarking is None and out.error is None  # the other later fields
    out.new_logprobs = second
    assert out.new_logprobs is second
    counts = [sys.getrefcount(x) for x in (first, second, mask)]
    assert counts == [base[0], base[1] + 1, base[2] + 1]
    out.new_logprobs = None
    out.new_sampling_mask = None
    out.new_logprobs = None  # None held twice in a row is released right too
    assert out.new_logprobs is None and out.new_sampling_mask is None
    assert [sys.getrefcount(x) for x in (first, second, mask)] == base
    out.new_sampling_mask = mask
    out.new_logprobs = first
    del out  # the output's own references go with it
    assert [sys.getrefcount(x) for x in (first, second, mask)] == base
    out = NativeDecoder(release="0.25.1").decode(_step(["b"], 3)).outputs[0]
    for name in ("new_logprobs", "new_sampling_mask"):
        with pytest.raises(TypeError, match="cannot be deleted"):
            delattr(out, name)
    with pytest.raises(AttributeError):
        out.finish_reason = None  # type: ignore[misc]


def test_decoded_objects_are_not_gc_tracked() -> None:
    """The message and its outputs are invisible to the cyclic GC."""
    message = NativeDecoder(release="0.25.1").decode(_step(["a", "b"], 7))
    assert not gc.is_tracked(message)
    assert not any(gc.is_tracked(o) for o in message.outputs)


def test_kept_token_lists_are_never_reused() -> None:
    """A new_token_ids list the caller keeps stays as it was after later decodes."""
    decoder = NativeDecoder(release="0.25.1")
    kept = []
    for step in range(50):
        message = decoder.decode(_step(["a", "b", "c"], 1000 * step))
        kept.append(message.outputs[1].new_token_ids)
        del message
    for step, ids in enumerate(kept):
        assert ids == [1000 * step + 1]


def test_mutated_token_lists_do_not_leak_into_later_outputs() -> None:
    """Lists the caller grew, shrank or refilled come back right (or not at all)."""
    decoder = NativeDecoder(release="0.25.1")
    for step in range(30):
        message = decoder.decode(_step(["a", "b", "c", "d"], step))
        assert [o.new_token_ids for o in message.outputs] == [[step + i] for i in range(4)]
        message.outputs[0].new_token_ids.append(99)
        message.outputs[1].new_token_ids.clear()
        message.outputs[2].new_token_ids[0] = object()
        del message


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        [0],
        [2**18 - 1, 2**18, 2**31, 2**32 - 1],
        [2**32, 2**63, 2**64 - 1, -1, -(2**63)],
        list(range(9)),
        list(range(150_000, 150_020)),
    ],
    ids=["empty", "zero", "cache_edges", "wide", "nine", "twenty"],
)
def test_token_ids_of_every_width(tokens: list[int]) -> None:
    """Token ids decode exactly, cached range or not, pooled length or not."""
    decoder = NativeDecoder(release="0.25.1")
    for _ in range(3):  # again through the caches and pools
        out = decoder.decode(_frames([p.EngineCoreOutput("r", tokens)])).outputs[0]
        assert out.new_token_ids == tokens
        assert all(type(t) is int for t in out.new_token_ids)


def test_order_prediction_survives_any_order_and_engine_interleaving() -> None:
    """Ids in shuffled, shrinking and growing orders, from interleaved engines, stay
    right and are the same str objects throughout."""
    decoder = NativeDecoder(release="0.25.1")
    reference = MsgspecDecoder(p.EngineCoreOutputs)
    ids = [f"cmpl-{i:04d}-0" for i in range(40)]
    first = {o.request_id: o.request_id for o in decoder.decode(_step(ids, 0)).outputs}
    orders = [
        ids,
        ids[5:],
        ids[::-1],
        [*ids[:10], "new-1", *ids[10:]],
        ids[::2] + ids[1::2],
        [ids[3]] * 3,
    ]
    for n, order in enumerate(orders * 3):
        for engine in (0, 1):
            frames = _step(order, n, engine)
            got = decoder.decode(frames)
            want = reference.decode(frames)
            assert [o.request_id for o in got.outputs] == [o.request_id for o in want.outputs]
            for o in got.outputs:
                if o.request_id in first:
                    assert o.request_id is first[o.request_id]


def test_live_ids_keep_their_object_while_many_others_come_and_go() -> None:
    """Ids predicted from the previous message skip the intern cache; they must still
    stay cached while alive, so that a later change of order finds the same object."""
    decoder = NativeDecoder(intern_capacity=64, release="0.25.1")
    live = ["live-a", "live-b", "live-c"]
    first = {o.request_id: o.request_id for o in decoder.decode(_step(live, 0)).outputs}
    for n in range(200):  # 20 short-lived ids per step: the cache retires many generations
        decoder.decode(_step(live + [f"tmp-{n}-{k}" for k in range(20)], n))
        assert decoder.interned <= decoder.intern_capacity
    for order in (live[::-1], live[1:], [live[0]]):
        for out in decoder.decode(_step(order, 1)).outputs:
            assert out.request_id is first[out.request_id]


def test_finished_requests_share_the_interned_ids() -> None:
    """finished_requests holds the very str objects of the outputs' request ids."""
    decoder = NativeDecoder(release="0.25.1")
    out = p.EngineCoreOutput("req-x", [1], finish_reason=p.FinishReason.ABORT)
    message = decoder.decode(_frames([out], finished_requests={"req-x"}))
    (finished,) = message.finished_requests
    assert finished is message.outputs[0].request_id
    assert message.outputs[0].finished
    assert message.outputs[0].finish_reason is p.FinishReason.ABORT


def test_tensor_from_read_only_bytes_raises_no_warning() -> None:
    """bytes frames are read-only: torch's warning about that is silenced, nothing else."""
    pooling = torch.arange(300, dtype=torch.float32).bfloat16()
    frames = _frames([p.EngineCoreOutput("r", [1], pooling_output=pooling)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = NativeDecoder(release="0.25.1").decode(frames).outputs[0]
        # An unrelated warning raised by the caller right after still surfaces.
        with pytest.raises(UserWarning, match="still raised"):
            warnings.warn("still raised", UserWarning, stacklevel=1)
    assert torch.equal(out.pooling_output, pooling)


def test_tensor_over_writable_frame_shares_it() -> None:
    """A tensor decoded from a writable frame is a view: writes show in the frame."""
    pooling = torch.zeros(128, dtype=torch.float32)
    frames = [bytearray(f) for f in _frames([p.EngineCoreOutput("r", [1], pooling_output=pooling)])]
    out = NativeDecoder(release="0.25.1").decode(frames).outputs[0]
    out.pooling_output[0] = 1.0
    assert np.frombuffer(frames[1], np.float32)[0] == 1.0


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16]
)
@pytest.mark.parametrize("shape", [(63, 6), (300,), (2, 3, 50)])
def test_tensors_of_every_dtype_share_their_frame(dtype: torch.dtype, shape: tuple) -> None:
    """Aux-frame tensors (prompt logprobs, pooling output) of every common dtype and
    shape: right values, C-contiguous, pointing into their frame, alive after the frames
    and the message are gone, no warning for read-only frames."""
    gen = torch.Generator().manual_seed(3)
    tensor = (torch.rand(shape, generator=gen) * 100).to(dtype)
    frames = _frames([p.EngineCoreOutput("r", [1], pooling_output=tensor)])
    storage = bytes(frames[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = NativeDecoder(release="0.25.1").decode([frames[0], storage]).outputs[0].pooling_output
    assert got.dtype == dtype and got.shape == tensor.shape and got.is_contiguous()
    address = np.frombuffer(storage, np.uint8).ctypes.data
    assert got.data_ptr() == address
    del frames, storage
    gc.collect()
    assert torch.equal(got, tensor)


def test_inline_tensor_at_any_offset() -> None:
    """Inline tensors sit at any offset of the payload, aligned or not: right values."""
    for pad in range(8):
        tensor = torch.arange(5, dtype=torch.float32) + pad
        out = p.EngineCoreOutput("r" * (pad + 1), [1], pooling_output=tensor)
        got = NativeDecoder(release="0.25.1").decode(_frames([out])).outputs[0].pooling_output
        assert torch.equal(got, tensor)


def test_frame_released_with_its_last_array() -> None:
    """An aux frame given as a memoryview stays pinned by its array, then is freed."""

    class Storage(bytearray):
        pass

    experts = np.arange(1024, dtype="<i4").reshape(256, 4)
    frames = _frames([p.EngineCoreOutput("r", [1], routed_experts=experts)])
    storage = Storage(frames[1])
    ref = weakref.ref(storage)
    view = memoryview(storage)
    arr = NativeDecoder(release="0.25.1").decode([frames[0], view]).outputs[0].routed_experts
    del storage, view
    gc.collect()
    assert ref() is not None
    with pytest.raises(BufferError):
        ref().append(0)  # type: ignore[union-attr]  # pinned: cannot resize under the array
    assert np.array_equal(arr, experts)
    assert type(arr.base).__name__ == "FrameBuffer"
    del arr
    gc.collect()
    assert ref() is None


def test_errors_name_the_place_and_leave_the_decoder_usable() -> None:
    """A bad frame raises ProtocolError with a path; the next good frame decodes."""
    decoder = NativeDecoder(release="0.25.1")
    good = _step(["a", "b"], 5)
    decoder.decode(good)
    bad = msgspec.msgpack.encode([0, [["a", [5]], ["b", [6, "x"]]]])
    with pytest.raises(ProtocolError, match=r"outputs\[1\]\.new_token_ids\[1\]: expected int"):
        decoder.decode([bad])
    assert [o.new_token_ids for o in decoder.decode(good).outputs] == [[5], [6]]


def test_no_reference_leaks_over_many_messages() -> None:
    """Decoding the same frames many times leaves refcounts and live objects flat."""
    decoder = NativeDecoder(release="0.25.1")
    frames = _step([f"r{i}" for i in range(64)], 123)
    for _ in range(200):
        decoder.decode(frames)
    gc.collect()
    before_objects = len(gc.get_objects())
    before_refs = sys.getrefcount(frames[0])
    for _ in range(2000):
        message = decoder.decode(frames)
        for out in message.outputs:
            out.new_token_ids  # noqa: B018
    del message
    gc.collect()
    after_refs = sys.getrefcount(frames[0])  # (not inside assert: rewriting holds a ref)
    assert after_refs == before_refs
    assert len(gc.get_objects()) - before_objects < 50


def test_interned_ids_and_cached_token_ints_keep_flat_refcounts() -> None:
    """The decoder's own reference counting (inlined on the hot path) balances: the
    request id strs and token ints it hands out again and again end with the counts
    they started with, whether the outputs are dropped or kept a while."""
    decoder = NativeDecoder(release="0.25.1")
    ids = [f"req-{i}-with-a-longer-id" for i in range(32)]
    frames = _step(ids, 100_000)
    first = decoder.decode(frames).outputs
    rid, token = first[5].request_id, first[5].new_token_ids[0]
    del first
    # Recycled token lists keep their last item until refilled: refill every one with
    # other ints (a step with more outputs than lists were ever pooled here).
    flush = _step([f"other-{i}" for i in range(64)], 7)
    NativeDecoder(release="0.25.1").decode(flush)
    gc.collect()
    before = (sys.getrefcount(rid), sys.getrefcount(token))
    kept = []
    for i in range(3000):
        message = decoder.decode(frames)
        if i % 7 == 0:
            kept.append(message.outputs[5])
        if len(kept) > 10:
            del kept[:-1]
    assert kept[-1].request_id is rid and kept[-1].new_token_ids[0] is token
    del message, kept
    NativeDecoder(release="0.25.1").decode(flush)
    gc.collect()
    after = (sys.getrefcount(rid), sys.getrefcount(token))
    assert after == before


def _lists_step(rows: list[tuple[list[int], list[float], int]], **kw: object) -> list[bytes]:
    """One output per row, with sampled-token logprobs as small inline arrays."""
    dtype_ids = kw.pop("dtype_ids", np.int32)
    outs = [
        p.EngineCoreOutput(
            f"r{i}",
            [ids[0]],
            new_logprobs=p.LogprobsLists(
                np.array([ids], dtype_ids),
                np.array([lps], np.float32),
                np.array([rank], np.int64),
            ),
        )
        for i, (ids, lps, rank) in enumerate(rows)
    ]
    return _frames(outs, **kw)


def _rows(
    seed: int, n: int, k: int = 5, vocab: int = 150_000
) -> list[tuple[list[int], list[float], int]]:
    rng = np.random.default_rng(seed)
    return [
        (
            [int(x) for x in rng.integers(0, vocab, k + 1)],
            [float(np.float32(x)) for x in -rng.random(k + 1) * 10],
            int(rng.integers(1, 20)),
        )
        for _ in range(n)
    ]


def _lists_values(message: object) -> list[tuple[list[int], list[float], list[int]]]:
    return [
        (
            out.new_logprobs.logprob_token_ids.tolist()[0],
            out.new_logprobs.logprobs.tolist()[0],
            out.new_logprobs.sampled_token_ranks.tolist(),
        )
        for out in message.outputs  # type: ignore[attr-defined]
    ]


def _expected(rows: list[tuple[list[int], list[float], int]]) -> list[tuple]:
    return [(ids, lps, [rank]) for ids, lps, rank in rows]


def test_inline_logprobs_arrays_are_owned_numpy_arrays() -> None:
    """Inline LogprobsLists arrays are exact ndarrays holding a copy of their bytes (the
    payload is not kept alive by them); they index, slice and convert like any other."""
    frames = _lists_step(_rows(1, 3))
    lp = NativeDecoder(release="0.25.1").decode(frames).outputs[1].new_logprobs
    assert type(lp) is p.LogprobsLists
    ids, lps, ranks, cu = lp
    assert cu is None
    for arr, dtype, shape in ((ids, "<i4", (1, 6)), (lps, "<f4", (1, 6)), (ranks, "<i8", (1,))):
        assert type(arr) is np.ndarray
        assert (arr.dtype.str, arr.shape) == (dtype, shape)
        assert arr.base is None and arr.flags.owndata and arr.flags.c_contiguous
        assert not np.shares_memory(arr, np.frombuffer(frames[0], np.uint8))
    ids_row, lps_row, rank = _expected(_rows(1, 3))[1]
    assert ids.tolist() == [ids_row] and ids[0].tolist() == ids_row
    assert ids[0, 1:3].tolist() == ids_row[1:3] and int(ids[0, -1]) == ids_row[-1]
    assert lps[:, 0].tolist() == [lps_row[0]] and ranks.tolist() == rank
    # Arrays and None only: no cycle possible, so not tracked (as CPython does for
    # exact tuples of such items).
    assert not gc.is_tracked(lp)


def test_logprobs_with_a_list_are_gc_tracked() -> None:
    """A LogprobsLists whose cu_num_generated_tokens is a list can be part of a cycle:
    tracked by the GC, also when a recycled tuple is handed out with one."""
    decoder = NativeDecoder(release="0.25.1")
    rows = _rows(2, 2)
    plain_frames = _lists_step(rows)
    cu = p.LogprobsLists(
        *NativeDecoder(release="0.25.1").decode(plain_frames).outputs[0].new_logprobs[:3], [0]
    )
    cu_frames = _frames([p.EngineCoreOutput("a", [1], new_logprobs=cu)])
    for _ in range(3):
        message = decoder.decode(plain_frames)
        assert not any(gc.is_tracked(o.new_logprobs) for o in message.outputs)
        del message
        lp = decoder.decode(cu_frames).outputs[0].new_logprobs
        assert gc.is_tracked(lp) and lp.cu_num_generated_tokens == [0]
        del lp


def test_recycled_logprobs_carry_each_message_values() -> None:
    """Messages decoded one after the other (each dropped before the next, so their
    LogprobsLists are recycled) carry their own values, also when k, the dtype or the
    batch size change between messages."""
    decoder = NativeDecoder(release="0.25.1")
    steps = [
        (_rows(10, 8), {}),
        (_rows(11, 8), {}),
        (_rows(12, 3, k=2), {}),
        (_rows(15, 5, k=0), {}),
        (_rows(16, 5, k=1, vocab=30_000), {"dtype_ids": np.int16}),
        (_rows(13, 12), {"dtype_ids": np.int64}),
        (_rows(14, 12), {}),
    ]
    for rows, kw in steps * 3:
        message = decoder.decode(_lists_step(rows, **kw))
        assert _lists_values(message) == _expected(rows)
        del message


@pytest.mark.parametrize("keep", ["tuple", "array", "view", "weakref", "message"])
def test_kept_logprobs_are_never_reused(keep: str) -> None:
    """A LogprobsLists, or one of its arrays, that the caller still holds in any way
    (the tuple, an array, a view of an array, a weak reference, the message) keeps its
    values through later decodes."""
    decoder = NativeDecoder(release="0.25.1")
    first = _rows(20, 4)
    message = decoder.decode(_lists_step(first))
    lp = message.outputs[2].new_logprobs
    kept: object = {
        "tuple": lp,
        "array": lp.logprobs,
        "view": lp.logprob_token_ids[0, 1:],
        "weakref": weakref.ref(lp.sampled_token_ranks),
        "message": message,
    }[keep]
    ids, lps, rank = _expected(first)[2]
    del lp  # (first: the message's death is what recycles its tuples)
    del message
    for seed in range(21, 25):
        later = decoder.decode(_lists_step(_rows(seed, 4)))
        assert _lists_values(later) == _expected(_rows(seed, 4))
        del later
    if keep == "tuple":
        assert _lists_values(p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("x", [], kept)])) == [
            (ids, lps, rank)
        ]
    elif keep == "array":
        assert kept.tolist() == [lps]  # type: ignore[attr-defined]
    elif keep == "view":
        assert kept.tolist() == ids[1:]  # type: ignore[attr-defined]
    elif keep == "weakref":
        # Weakly referenced only: freed with its tuple, never recycled under the ref.
        assert kept() is None  # type: ignore[operator]
    else:
        assert _lists_values(kept) == _expected(first)


def test_recycled_logprobs_leak_nothing() -> None:
    """Many messages with logprobs: refcounts, live objects and GC-tracked objects flat,
    and a recycled LogprobsLists stays invisible to the GC."""
    decoder = NativeDecoder(release="0.25.1")
    frames = _lists_step(_rows(30, 64))
    for _ in range(200):
        decoder.decode(frames)
    gc.collect()
    before_objects = len(gc.get_objects())
    before_refs = sys.getrefcount(frames[0])
    for _ in range(2000):
        message = decoder.decode(frames)
        for out in message.outputs:
            out.new_logprobs.logprobs  # noqa: B018
    assert not any(gc.is_tracked(o.new_logprobs) for o in message.outputs)
    del message
    gc.collect()
    after_refs = sys.getrefcount(frames[0])
    assert after_refs == before_refs
    assert len(gc.get_objects()) - before_objects < 50
