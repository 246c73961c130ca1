"""Fuzz: mutated, truncated and spliced frames reach only ProtocolError or a correct decode.

Valid frames (from the Encoder) are mutated with a seeded RNG: bit flips, bytes replaced
by interesting msgpack markers, insertions, deletions, truncation, splicing two payloads,
and aux frames removed, resized, added or swapped. Each mutated message goes to the
decoder under test: it must raise ``ProtocolError`` or decode; when the NativeDecoder
accepts a message, the reference MsgspecDecoder must accept it too and decode the same
values; when it rejects one, the reference must reject it too (dtype spellings aside).
No other exception, no crash, no hang.

``COREWIRE_FUZZ_FRAMES`` sets the number of native frames per run (default 100000; the
reference decoder gets a tenth), ``COREWIRE_FUZZ_SEED`` the seed.

Checks ``docs/protocol.md`` §9.1 (what a decoder must refuse) on arbitrary input.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from codec_support import check_types, make_decoder, normalize
from corewire import ProtocolError
from corewire import protocol as p
from corewire.codec import Encoder

FUZZ_FRAMES = int(os.environ.get("COREWIRE_FUZZ_FRAMES", "100000"))
FUZZ_SEED = int(os.environ.get("COREWIRE_FUZZ_SEED", "1129"))

# Bytes that change the meaning of what follows in msgpack: container and string headers
# of every width, nil/bool, ext markers, and the unused 0xc1.
INTERESTING_BYTES = bytes.fromhex(
    "0001037f808f909fa0bfc0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d3d4d5d6d7d8d9dadbdcdddedfe0ff"
)
INTERESTING_WORDS = [
    b"\xff\xff",
    b"\x7f\xff",
    b"\x80\x00",
    b"\xff\xff\xff\xff",
    b"\x7f\xff\xff\xff",
    b"\x80\x00\x00\x00",
    b"\x00\x00\x01\x00",
    b"\xff" * 8,
    b"\x7f" + b"\xff" * 7,
    b"\x80" + b"\x00" * 7,
]

# A longer LogprobsLists/LogprobsTensors array is valid by the spec (unknown trailing
# fields are ignored) but msgspec's fixed-size named tuples reject it: not a native bug.
# Which dtype spellings beyond numpy's ``dtype.str`` and torch's canonical names a decoder
# accepts (aliases such as "int" or "<a4") is its own policy: not compared.
_DTYPE_POLICY = re.compile(r"dtype")
_SPEC_LENIENT = re.compile(
    r"Expected `array` of length 3 to 4, got \d+ - at `\$\[1\]\[\d+\]\[[23]\]`"
)


def _corpus() -> list[list[bytes]]:
    """Valid messages covering every field, inline and aux data, all as bytes frames."""
    rng = np.random.default_rng(7)
    lp = p.LogprobsLists(
        rng.integers(0, 50000, (3, 4)).astype("<i4"),
        rng.standard_normal((3, 4)).astype("<f4"),
        np.arange(3, dtype="<i4"),
        [0, 3],
    )
    prompt = p.LogprobsTensors(
        torch.arange(40, dtype=torch.int64).reshape(20, 2),
        torch.linspace(-5, 0, 40).reshape(20, 2),
        torch.arange(20, dtype=torch.int64),
    )
    messages = [
        p.EngineCoreOutputs(),
        p.EngineCoreOutputs(
            engine_index=1,
            outputs=[
                p.EngineCoreOutput("req-0", [1, 2, 3]),
                p.EngineCoreOutput("請求-1", [], finish_reason=p.FinishReason.STOP, stop_reason=7),
                p.EngineCoreOutput(
                    "req-2",
                    [2**40, 5],
                    finish_reason=p.FinishReason.LENGTH,
                    stop_reason="</s>",
                    events=[p.EngineCoreEvent(p.EngineCoreEventType.QUEUED, 1.5)],
                    num_nans_in_logits=2,
                ),
            ],
            timestamp=12.25,
            finished_requests={"req-9"},
        ),
        p.EngineCoreOutputs(
            outputs=[
                p.EngineCoreOutput(
                    "lp",
                    [9],
                    new_logprobs=lp,
                    routed_experts=rng.integers(0, 8, (4, 2)).astype("<i2"),
                    kv_transfer_params={"host": "h", "port": 1, "ids": [1, 2]},
                )
            ],
            scheduler_stats={"num_running_reqs": 1, "kv": 0.5, "nested": {"a": [None, True]}},
        ),
        p.EngineCoreOutputs(
            outputs=[
                p.EngineCoreOutput(
                    "aux",
                    [1],
                    new_prompt_logprobs_tensors=prompt,
                    pooling_output=torch.linspace(-1, 1, 160).bfloat16(),
                    routed_experts=rng.integers(0, 8, (40, 2)).astype("<i4"),
                    trace_headers={"traceparent": "00-1"},
                    prefill_stats={"cached": 3},
                )
            ],
            wave_complete=2,
            start_wave=3,
        ),
        p.EngineCoreOutputs(
            utility_output=p.UtilityOutput(2**64 - 1, None, p.UtilityResult({"a": [1, "b"]}))
        ),
        p.EngineCoreOutputs(
            utility_output=p.UtilityOutput(-1, None, p.UtilityResult(["SCALE", 1]))
        ),
        p.EngineCoreOutputs(utility_output=p.UtilityOutput(5, "Call to x method failed: e")),
        p.EngineCoreOutputs(
            outputs=[
                p.EngineCoreOutput(f"r{i}", [i], pooling_output=torch.full((2,), float(i)))
                for i in range(6)
            ]
        ),
    ]
    encoder = Encoder(release="0.25.1")
    return [[bytes(f) for f in encoder.encode(m)] for m in messages]


CORPUS = _corpus()


def _mutate_payload(rng: random.Random, data: bytearray) -> bytearray:
    op = rng.randrange(9)
    n = len(data)
    if n == 0:
        return bytearray([rng.choice(INTERESTING_BYTES)])
    pos = rng.randrange(n)
    if op == 0:  # bit flips
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(n)
            data[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # an interesting marker
        data[pos] = rng.choice(INTERESTING_BYTES)
    elif op == 2:  # random byte
        data[pos] = rng.randrange(256)
    elif op == 3:  # insert markers
        data[pos:pos] = bytes(rng.choice(INTERESTING_BYTES) for _ in range(rng.randint(1, 3)))
    elif op == 4:  # delete a range
        del data[pos : pos + rng.randint(1, 8)]
    elif op == 5:  # truncate
        del data[pos:]
    elif op == 6:  # overwrite with an interesting multi-byte value
        word = rng.choice(INTERESTING_WORDS)
        data[pos : pos + len(word)] = word
    elif op == 7:  # duplicate a chunk elsewhere
        start = rng.randrange(n)
        chunk = data[start : start + rng.randint(1, 16)]
        data[pos:pos] = chunk
    else:  # trailing garbage
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return data


def _mutate_aux(rng: random.Random, aux: list[bytes]) -> list[bytes]:
    op = rng.randrange(6)
    aux = list(aux)
    if op == 0 and aux:  # drop one
        del aux[rng.randrange(len(aux))]
    elif op == 1 and aux:  # shrink one
        i = rng.randrange(len(aux))
        aux[i] = aux[i][: rng.randrange(len(aux[i]) + 1)]
    elif op == 2 and aux:  # grow one
        i = rng.randrange(len(aux))
        aux[i] = aux[i] + bytes(rng.choice((1, 2, 4, 8, 256)))
    elif op == 3:  # an extra frame
        aux.append(bytes(rng.randrange(0, 600)))
    elif op == 4 and len(aux) > 1:  # swap two
        i, j = rng.sample(range(len(aux)), 2)
        aux[i], aux[j] = aux[j], aux[i]
    else:  # all gone
        aux = []
    return aux


def mutate(rng: random.Random) -> list[bytes]:
    """One mutated message from the corpus."""
    base = rng.choice(CORPUS)
    payload = bytearray(base[0])
    aux = base[1:]
    kind = rng.random()
    if kind < 0.08:  # splice two payloads
        other = rng.choice(CORPUS)[0]
        payload = payload[: rng.randrange(len(payload) + 1)] + other[rng.randrange(len(other)) :]
    elif kind < 0.18:
        aux = _mutate_aux(rng, aux)
        if rng.random() < 0.5:
            return [bytes(payload), *aux]
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        payload = _mutate_payload(rng, payload)
    return [bytes(payload), *aux]


def _describe(frames: list[bytes], what: str) -> str:
    return f"{what}; payload={frames[0][:120].hex()} aux_sizes={[len(f) for f in frames[1:]]}"


def _fuzz(decoder: Any, oracle: Any, count: int, seed: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        # numpy 2 still parses legacy dtype aliases ("<a4") with a DeprecationWarning; the
        # reference decoder then accepts the array (as vLLM's would). Not an error here.
        warnings.filterwarnings("ignore", "Data type alias", DeprecationWarning)
        return _fuzz_loop(decoder, oracle, count, seed)


def _fuzz_loop(decoder: Any, oracle: Any, count: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    good_frames = CORPUS[3]
    good = normalize(oracle.decode(good_frames))
    compare = oracle is not decoder
    stats: dict[str, Any] = {"accepted": 0, "rejected": 0, "lenient": 0, "problems": []}
    problems: list[str] = stats["problems"]
    for i in range(count):
        if len(problems) >= 20:
            break
        if i % 997 == 0 and normalize(decoder.decode(good_frames)) != good:
            problems.append(f"a good frame decoded wrongly after {i} fuzz frames")
        frames = mutate(rng)
        try:
            got = decoder.decode(frames)
        except ProtocolError as exc:
            stats["rejected"] += 1
            if not str(exc):
                problems.append(_describe(frames, "ProtocolError without a message"))
            elif compare and not _DTYPE_POLICY.search(str(exc)):
                _check_reference_rejects(oracle, frames, str(exc), problems)
            continue
        except Exception as exc:
            problems.append(_describe(frames, f"raised {type(exc).__name__}: {exc}"))
            continue
        stats["accepted"] += 1
        try:
            check_types(got)
            got_norm = normalize(got)
        except Exception as exc:
            problems.append(_describe(frames, f"bad decoded object: {type(exc).__name__} {exc}"))
            continue
        if not compare:
            continue
        try:
            expected = normalize(oracle.decode(frames))
        except ProtocolError as exc:
            if _SPEC_LENIENT.search(str(exc)):
                stats["lenient"] += 1
            else:
                problems.append(_describe(frames, f"accepted, reference says: {exc}"))
            continue
        if got_norm != expected:
            problems.append(_describe(frames, "decoded values differ from the reference"))
    return stats


def _check_reference_rejects(oracle: Any, frames: list[bytes], error: str, out: list[str]) -> None:
    """A frame the decoder rejects must be one the reference rejects too."""
    try:
        oracle.decode(frames)
    except ProtocolError:
        return
    out.append(_describe(frames, f"rejected ({error}) but the reference decodes it"))


def _report(name: str, count: int, stats: dict[str, Any]) -> None:
    print(
        f"\n{name} fuzz: {count} frames, {stats['accepted']} accepted, "
        f"{stats['rejected']} rejected with ProtocolError, "
        f"{stats['lenient']} accepted under spec-only leniency (seed {FUZZ_SEED})"
    )
    assert not stats["problems"], "\n".join(stats["problems"])


def test_corpus_is_valid() -> None:
    """Every corpus message decodes on the reference decoder (the fuzz starts from valid)."""
    reference = make_decoder("msgspec")
    for frames in CORPUS:
        reference.decode(frames)
    assert any(len(frames) > 1 for frames in CORPUS)


def test_fuzz_native_decoder() -> None:
    """COREWIRE_FUZZ_FRAMES mutated messages: ProtocolError or the reference's values."""
    native = make_decoder("native")
    stats = _fuzz(native, make_decoder("msgspec"), FUZZ_FRAMES, FUZZ_SEED)
    _report("NativeDecoder", FUZZ_FRAMES, stats)
    if FUZZ_FRAMES >= 1000:  # the mutations must exercise both outcomes
        assert stats["accepted"] > 0 and stats["rejected"] > 0


def test_fuzz_msgspec_decoder() -> None:
    """The reference decoder also raises nothing but ProtocolError on the same mutations."""
    count = max(1, FUZZ_FRAMES // 10)
    reference = make_decoder("msgspec")
    stats = _fuzz(reference, reference, count, FUZZ_SEED + 1)
    _report("MsgspecDecoder", count, stats)


@pytest.mark.parametrize("kind", ["msgspec", "native"])
def test_every_truncation_of_every_corpus_message(kind: str) -> None:
    """Every prefix of every valid payload: ProtocolError (only the whole one decodes)."""
    decoder = make_decoder(kind)
    for frames in CORPUS:
        payload, aux = frames[0], frames[1:]
        for cut in range(len(payload)):
            with pytest.raises(ProtocolError):
                decoder.decode([payload[:cut], *aux])
        decoder.decode(frames)
