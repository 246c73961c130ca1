"""The recorded wire of every vLLM release (``corewire.releases``), checked four ways.

- The live derivation of the installed vLLM equals its record (skipped without vLLM).
- Every record loads, names only what it records, and builds into msgspec types.
- Every release's golden frames (``tests/data/vllm-<release>/recorded``, written by
  ``tools/record-vllm-release`` with that release's own encoder) decode through the types
  built from its record (``corewire.codec.MsgspecDecoder``) to exactly what that release's
  own decoder made of them, and ``corewire.codec.Encoder`` writes them back byte for byte.
- ``NativeDecoder``, laid out by each record, reads every release's recorded frames as it did.
- The records of 0.25.1 and 0.33.0 have the field names and order of corewire's
  hand-kept tables (``corewire.wire.layouts``, ``corewire.engine.ready_layouts``).
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from typing import Any

import msgspec
import pytest

from corewire.codec import Encoder, MsgspecDecoder, native_decoder
from corewire.releases import records
from corewire.releases.structs import build_structs
from golden_support import jsonable
from paths_support import DATA_DIR as DATA
from release_support import FOLLOWED

RELEASES = records.releases()


@cache
def built(release: str) -> dict[str, Any]:
    return build_structs(records.load(release))


@cache
def expected(release: str) -> dict[str, Any]:
    path = DATA / f"vllm-{release}" / "recorded" / "expected.json"
    return json.loads(path.read_text())


def frames(release: str, case: str) -> list[bytes]:
    folder = DATA / f"vllm-{release}" / "recorded"
    count = expected(release)[case]["frames"]
    return [(folder / f"{case}.{i}.bin").read_bytes() for i in range(count)]


def golden_cases() -> list[tuple[str, str]]:
    return [
        (release, case)
        for release in RELEASES
        for case in sorted(expected(release))
        if isinstance(expected(release)[case], dict)
    ]


def test_every_followed_release_is_recorded() -> None:
    assert set(FOLLOWED) <= set(RELEASES)
    assert list(RELEASES) == sorted(RELEASES, key=lambda r: tuple(map(int, r.split("."))))


def test_live_derivation_equals_the_record() -> None:
    """What ``derive`` reads off the installed vLLM is, to the byte of JSON, its record."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    import vllm

    from corewire.releases.derive import derive

    release = vllm.__version__.split("+", 1)[0]
    if release not in RELEASES:
        pytest.skip(f"vLLM {vllm.__version__} is not a recorded release")
    live = json.loads(json.dumps(derive(vllm)))
    assert live == records.load(release)


def _named(t: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of every struct and enum a type tree names."""
    kind = t["kind"]
    if kind in ("struct", "enum"):
        return [(kind, t["name"])]
    out: list[tuple[str, str]] = []
    for key in ("item", "key", "value"):
        if key in t:
            out += _named(t[key])
    for key in ("types", "items"):
        for sub in t.get(key, ()):
            out += _named(sub)
    return out


def _problems(record: dict[str, Any]) -> list[str]:
    """What is wrong with a record: every struct and enum a field names must be recorded,
    field and wire names unique, a default exactly where a field is not required."""
    out = []
    if not {"EngineCoreOutputs", "EngineCoreRequest", "UtilityOutput"} <= set(record["roots"]):
        out.append(f"roots {record['roots']}")
    out += [f"root {r} not recorded" for r in record["roots"] if r not in record["structs"]]
    out += [f"{n} is a struct and an enum" for n in set(record["structs"]) & set(record["enums"])]
    for name, entry in record["structs"].items():
        if entry["kind"] not in ("struct", "namedtuple", "dataclass", "typeddict"):
            out.append(f"{name}: kind {entry['kind']}")
        for key in ("name", "encode_name"):
            names = [f[key] for f in entry["fields"]]
            if len(set(names)) != len(names):
                out.append(f"{name}: repeated {key}")
        for f in entry["fields"]:
            if f["required"] == ("default" in f):
                out.append(f"{name}.{f['name']}: required={f['required']} with default")
            for kind, ref in _named(f["type"]):
                if ref not in (record["structs"] if kind == "struct" else record["enums"]):
                    out.append(f"{name}.{f['name']} names {kind} {ref}, not recorded")
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_record_is_self_consistent(release: str) -> None:
    record = records.load(release)
    assert record["vllm"].split("+", 1)[0] == release
    assert _problems(record) == []
    assert set(built(release)) == set(record["structs"]) | set(record["enums"])


def test_a_broken_record_is_caught() -> None:
    """The consistency check can fail: a field naming an unrecorded struct, a struct
    recorded twice over, a required field with a default."""
    record = records.load(RELEASES[0])
    record["structs"]["UtilityOutput"]["fields"][0]["type"] = {"kind": "struct", "name": "Nope"}
    record["structs"]["UtilityOutput"]["fields"][0]["default"] = 0
    record["enums"]["UtilityOutput"] = {}
    assert _problems(record) == [
        "UtilityOutput is a struct and an enum",
        "UtilityOutput.call_id: required=True with default",
        "UtilityOutput.call_id names struct Nope, not recorded",
    ]
    del record["enums"]["UtilityOutput"]
    with pytest.raises(KeyError, match="Nope"):
        build_structs(record)


CASES = golden_cases()


def _decoder(release: str, root: str) -> MsgspecDecoder:
    return MsgspecDecoder(built(release)[root])


def _without_unassigned(want: Any, got: Any, names: frozenset[str]) -> Any:
    """``want`` less the fields named in ``names`` wherever ``got`` lacks them: a dataclass
    field never assigned is absent on the wire, which vLLM reads as the class's default
    and the built struct as ``msgspec.UNSET`` (left out by ``jsonable``)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {
            k: _without_unassigned(v, got.get(k), names)
            for k, v in want.items()
            if k in got or k not in names
        }
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [_without_unassigned(w, g, names) for w, g in zip(want, got, strict=True)]
    return want


def _unassigned_names(release: str) -> frozenset[str]:
    record = records.load(release)
    return frozenset(
        f["encode_name"]
        for entry in record["structs"].values()
        for f in entry["fields"]
        if f.get("init") is False
    )


@pytest.mark.parametrize(("release", "case"), CASES)
def test_golden_decodes_to_what_the_release_decoded(release: str, case: str) -> None:
    want = expected(release)[case]
    decoded = _decoder(release, want["root"]).decode(frames(release, case))
    got = jsonable(decoded, wire_names=True)
    if case.endswith("_unassigned"):
        # only where a field was left unassigned does the built struct read it as absent
        assert got != want["decoded"]
        want = {
            **want,
            "decoded": _without_unassigned(want["decoded"], got, _unassigned_names(release)),
        }
    assert got == want["decoded"]


@pytest.mark.parametrize(("release", "case"), CASES)
def test_golden_reencodes_byte_for_byte(release: str, case: str) -> None:
    golden = frames(release, case)
    decoded = _decoder(release, expected(release)[case]["root"]).decode(golden)
    assert [bytes(f) for f in Encoder().encode(decoded)] == golden


def test_golden_cases_cover_each_direction() -> None:
    for release in RELEASES:
        cases = expected(release)
        roots = {c["root"] for c in cases.values() if isinstance(c, dict)}
        assert {"EngineCoreOutputs", "EngineCoreRequest", "EngineCoreReadyResponse"} <= roots
        # inline and aux arrays both: some case of each direction has aux frames
        for root in ("EngineCoreOutputs", "EngineCoreRequest"):
            assert any(
                c["root"] == root and c["frames"] > 1 for c in cases.values() if isinstance(c, dict)
            ), (release, root)


def test_a_changed_frame_is_caught() -> None:
    """The byte comparison can fail: one flipped field value re-encodes differently."""
    release, case = next((r, c) for r, c in CASES if c == "outputs_full")
    golden = frames(release, case)
    decoded = _decoder(release, "EngineCoreOutputs").decode(golden)
    decoded.engine_index += 1
    assert [bytes(f) for f in Encoder().encode(decoded)] != golden


def _subset(got: Any, want: Any) -> bool:
    """Whether ``got`` has every field of ``want`` with its value (extra fields allowed)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return all(k in got and _subset(got[k], v) for k, v in want.items())
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_subset(g, w) for g, w in zip(got, want, strict=True))
    return type(got) is type(want) and got == want


NATIVE_CASES = [(r, c) for r, c in CASES if expected(r)[c]["root"] == "EngineCoreOutputs"]


@pytest.mark.parametrize(("release", "case"), NATIVE_CASES)
def test_native_decoder_reads_the_recorded_frames(release: str, case: str) -> None:
    """The Rust decoder of every release, laid out by that release's record, reads its
    recorded frames as the release did (its objects carry every version's fields: only
    the release's are compared)."""
    decoded = native_decoder(release).decode(frames(release, case))
    assert _subset(jsonable(decoded), expected(release)[case]["decoded"])


def _wire_fields(cls: Any) -> list[str]:
    if hasattr(cls, "__struct_encode_fields__"):
        return list(cls.__struct_encode_fields__)
    return list(cls._fields)


@pytest.mark.parametrize("release", ["0.25.1", "0.33.0"])
def test_records_agree_with_the_hand_tables(release: str) -> None:
    """Field names (on the wire) and order of each struct corewire keeps by hand."""
    from corewire.wire import layouts

    record = records.load(release)
    for name, cls in layouts.types_for(release).items():
        entry = record["structs"][name]
        assert _wire_fields(cls) == [f["encode_name"] for f in entry["fields"]], name
        if hasattr(cls, "__struct_config__"):
            assert cls.__struct_config__.array_like == entry["array_like"], name
        else:
            assert entry["kind"] == "namedtuple", name


@pytest.mark.parametrize(
    ("release", "ready"), [("0.25.1", "ReadyResponse0251"), ("0.33.0", "ReadyResponse0330")]
)
def test_ready_records_agree_with_the_hand_tables(release: str, ready: str) -> None:
    from corewire.engine import ready_layouts

    cls = getattr(ready_layouts, ready)
    entry = records.load(release)["structs"]["EngineCoreReadyResponse"]
    recorded = [(f["name"], f["required"]) for f in entry["fields"]]
    assert [(f.name, f.required) for f in msgspec.structs.fields(cls)] == recorded


@pytest.mark.parametrize("release", RELEASES)
def test_golden_with_dataclasses_kept_as_maps(release: str) -> None:
    """``as_maps``: vLLM's dataclasses (statistics, the ready response's parts) read as
    plain maps, as corewire.protocol keeps them, decode to the same values (a never
    assigned field aside) and write the same bytes."""
    types = build_structs(records.load(release), as_maps=("dataclass",))
    assert types["EngineCoreOutputs"].__annotations__["scheduler_stats"] == dict[str, Any] | None
    # a dataclass holding a tensor (PlaceholderRange.is_embed) stays typed
    features = types["EngineCoreRequest"].__annotations__["mm_features"]
    spec = types["MultiModalFeatureSpec"]
    assert features == list[spec] | None
    for case, want in expected(release).items():
        if not isinstance(want, dict) or want["root"] == "EngineCoreReadyResponse":
            continue
        golden = frames(release, case)
        decoded = MsgspecDecoder(types[want["root"]]).decode(golden)
        got = jsonable(decoded, wire_names=True)
        names = _unassigned_names(release) if case.endswith("_unassigned") else frozenset()
        assert got == _without_unassigned(want["decoded"], got, names), case
        assert [bytes(f) for f in Encoder().encode(decoded)] == golden, case
