"""Engines' outputs are complete on the wire: every map-encoded struct (vLLM's dataclasses:
``SchedulerStats`` with the ``PrefixCacheStats`` in it, ``PrefillStats``, ``RequestError``)
carries every key its release declares, and every positional struct that vLLM writes in
full has every element.

vLLM's Python front-end fills in what a map leaves out; its Rust front-end (``vllm-rs``,
``VLLM_USE_RUST_FRONTEND=1``) does not, and refused corewire's two-key ``SchedulerStats``
(``missing field step_counter``) until engines wrote them whole. What each release
declares is its record (``corewire.releases``, read off that vLLM's own classes), so this
runs without vLLM: for every recorded release the output conversion an engine core runs
(``corewire.wire.outputs.output_converter``), and under 0.25.1 a real engine process, read
back as raw msgpack and walked against the record. The engines behind the Rust front-end
itself: ``test_vllm_rust_frontend.py``.

Checks ``docs/protocol.md`` §5 (outputs) and §11 (each release's layout).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from client_support import request
from corewire import releases
from corewire.codec import Encoder
from corewire.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason
from corewire.releases import records
from corewire.wire.layouts import RequestError
from corewire.wire.outputs import StepOutputs, finish_output, output_converter
from engine_support import LIGHT_REFERENCE, FrontEnd

RECORDED = [r for r in releases.SUPPORTED if r.name in records.releases()]


def missing(record: dict[str, Any], kind: dict[str, Any], value: Any, where: str) -> list[str]:
    """Where raw msgpack ``value`` of the record's type ``kind`` lacks a key or an element
    its release writes (paths, empty when complete)."""
    if value is None:
        return []
    if kind["kind"] == "union":
        members = [m for m in kind["types"] if m["kind"] != "none"]
        return min((missing(record, m, value, where) for m in members), key=len, default=[])
    if kind["kind"] in ("list", "set") and isinstance(value, list):
        return [
            p
            for i, v in enumerate(value)
            for p in missing(record, kind["item"], v, f"{where}[{i}]")
        ]
    if kind["kind"] == "dict" and isinstance(value, dict):
        return [
            p
            for k, v in value.items()
            for p in missing(record, kind["value"], v, f"{where}[{k!r}]")
        ]
    if kind["kind"] != "struct":
        return []
    entry = record["structs"][kind["name"]]
    fields = entry["fields"]
    gaps: list[str] = []
    if entry["array_like"]:
        if not isinstance(value, list):
            return [f"{where}: not an array"]
        # vLLM itself leaves trailing defaults out of an omit_defaults struct.
        if not entry["omit_defaults"] and len(value) < len(fields):
            gaps.append(f"{where}: {len(value)} of {len(fields)} elements")
        present = list(zip(fields, value, strict=False))
    else:
        if not isinstance(value, dict):
            return [f"{where}: not a map"]
        if not entry["omit_defaults"]:
            gaps += [f"{where}.{f['encode_name']}" for f in fields if f["encode_name"] not in value]
        present = [(f, value[f["encode_name"]]) for f in fields if f["encode_name"] in value]
    for field, item in present:
        gaps += missing(record, field["type"], item, f"{where}.{field['name']}")
    return gaps


def incomplete(release: Any, frames: list[Any]) -> list[str]:
    """What an encoded ``EngineCoreOutputs`` of ``release`` lacks (see :func:`missing`)."""
    record = records.load(release.name)
    raw = msgspec.msgpack.decode(bytes(frames[0]))
    return missing(record, {"kind": "struct", "name": "EngineCoreOutputs"}, raw, "outputs")


def engine_message(release: Any) -> Any:
    """What an engine core queues for a step under ``release``: engine-built structs with
    the stats a corewire engine reports (a few keys, one vLLM does not know), a request's
    first output with its ``PrefillStats``, and a refusal (``RequestError`` where the
    release has it)."""
    outputs = [
        EngineCoreOutput(
            "r1", [5], prefill_stats={"num_prompt_tokens": 3, "num_computed_tokens": 3}
        ),
        finish_output(
            release, "r2", FinishReason.ERROR, "too long", error=RequestError("bad", "no")
        ),
    ]
    stats = {"num_running_reqs": 1, "num_waiting_reqs": 2, "step_counter": 7, "corewire_own": 1}
    message = EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)
    # Stamped with the weight version where the release has one, as the core does.
    return StepOutputs(message, "default") if release.weight_versions else message


@pytest.mark.parametrize("release", RECORDED, ids=str)
def test_every_release_writes_its_stats_whole(release: Any) -> None:
    """For every recorded release, a step's message after the engine core's conversion
    has every key of the release's ``SchedulerStats`` (nested ``PrefixCacheStats``
    included), ``PrefillStats`` and ``RequestError``, in the release's order; the engine's
    values stay, a key vLLM does not know follows them."""
    convert = output_converter(release)
    assert convert is not None
    message = convert(engine_message(release))
    frames = Encoder(release=release).encode(message)
    assert incomplete(release, frames) == []
    record = records.load(release.name)
    stats = message.scheduler_stats
    declared = list(records.defaults(record, "SchedulerStats"))
    assert list(stats) == [*declared, "corewire_own"]
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"], stats["step_counter"]) == (
        1,
        2,
        7,
    )
    prefill = message.outputs[0].prefill_stats
    assert list(prefill) == list(records.defaults(record, "PrefillStats"))
    assert prefill["num_prompt_tokens"] == 3


def test_the_check_finds_what_a_two_key_stats_map_lacks() -> None:
    """The walk itself: the two-key ``SchedulerStats`` corewire's engines once sent is
    found lacking (``step_counter`` among the rest), as vLLM's Rust front-end found it."""
    release = releases.get("0.25.1")
    message = EngineCoreOutputs(scheduler_stats={"num_running_reqs": 1, "num_waiting_reqs": 0})
    gaps = incomplete(release, Encoder(release=release).encode(message))
    assert "outputs.scheduler_stats.step_counter" in gaps
    assert len(gaps) == len(records.defaults(records.load("0.25.1"), "SchedulerStats")) - 2


def test_a_complete_map_goes_out_as_it_is() -> None:
    """Stats an engine reports whole are not copied (the per-step cost is a key check)."""
    release = releases.get("0.34.0")
    full = records.defaults(records.load(release.name), "SchedulerStats")
    convert = output_converter("0.25.1")
    assert convert is not None
    message = EngineCoreOutputs(scheduler_stats=full)
    assert convert(message) is message and message.scheduler_stats is full


@pytest.fixture
def front(tmp_path: Path) -> Iterator[FrontEnd]:
    """A raw 0.25.1 front-end."""
    fe = FrontEnd(tmp_path)
    try:
        yield fe
    finally:
        fe.close()


def test_a_0_25_1_engine_process_sends_complete_outputs(front: FrontEnd) -> None:
    """A reference engine process under 0.25.1 (stats on, as by default): every message
    of a request with logprobs, and the reply to a utility call, as read off the socket,
    is complete by vLLM 0.25.1's record."""
    front.start_engine(engine_args=LIGHT_REFERENCE)
    front.wait_ready()
    release = releases.get("0.25.1")
    front.add(request("r", 4, sampling={"logprobs": 2}))
    seen = 0
    stats_seen = 0
    while True:
        frames = front.recv_raw()
        assert incomplete(release, frames) == []
        raw = msgspec.msgpack.decode(bytes(frames[0]))
        stats_seen += raw[2] is not None
        seen += 1
        if any(out[5] is not None for out in raw[1]):
            break
    assert seen >= 1 and stats_seen == seen
    front.send(b"\x03", [0, 99, "is_sleeping", []])
    assert incomplete(release, front.recv_raw()) == []
