"""The Rust decoder's wire tables against ``corewire.protocol``: one schema, two languages.

The Rust core declares each struct it decodes once, as a table (``rust/src/core/wire.rs``),
and each protocol version's wire order as a layout, exposed read-only as
``_native.wire_fields(name, protocol)``. ``corewire.protocol`` (0.25.1) and
``corewire.wire.layouts`` (0.33.0) declare the same structs for Python. These tests fail as soon
as the two disagree on a name or a position in either version, and check that the decoded
objects' attributes, ``__struct_fields__`` and repr come from those tables.

Checks ``docs/protocol.md`` §5.2-§5.4 and §5.6-§5.7 (the decoded structs' field positions,
in both languages) and §11 (the layouts of both versions).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import msgspec
import pytest

from corewire import _native, releases
from corewire import protocol as p
from corewire.codec import Encoder, NativeDecoder, native_decoder
from corewire.wire import layouts

#: Every struct that the engine -> front-end decoder reads, by version.
DECODED = {
    "0.25.1": (
        "EngineCoreOutputs",
        "EngineCoreOutput",
        "UtilityOutput",
        "LogprobsLists",
        "LogprobsTensors",
        "EngineCoreEvent",
    ),
    "0.33.0": (
        "EngineCoreOutputs",
        "EngineCoreOutput",
        "UtilityOutput",
        "LogprobsLists",
        "LogprobsTensors",
        "SamplingMaskLists",
        "EngineCoreEvent",
    ),
}
# 0.34.0 has a compiled walk too (the newest release: speed), its Python structs built
# from its record.
DECODED["0.34.0"] = DECODED["0.33.0"]
PAIRS = [(version, name) for version, names in DECODED.items() for name in names]


def _wire_names(cls: Any) -> tuple[str, ...]:
    """The names a struct's fields have on the wire, in order."""
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return tuple(cls.__struct_encode_fields__)
    # the NamedTuples (LogprobsLists, LogprobsTensors) travel as arrays in field order
    return tuple(cls._fields)


def test_both_languages_name_the_same_versions() -> None:
    # The releases with compiled Rust tables: those corewire declares by hand in Python
    # (corewire.protocol, corewire.wire.layouts) and the newest; every other release is read
    # off its record at run time (NativeDecoder(layout=...)).
    compiled = _native.wire_versions()
    assert compiled == tuple(DECODED) == ("0.25.1", "0.33.0", "0.34.0")
    assert compiled[-1] == releases.NEWEST
    assert set(compiled) <= set(releases.SUPPORTED)
    assert _native.wire_version() == "0.25.1"


@pytest.mark.parametrize("version", tuple(DECODED))
def test_the_rust_tables_cover_every_decoded_struct(version: str) -> None:
    assert set(_native.wire_structs(version)) == set(DECODED[version])
    assert set(layouts.types_for(version)) >= set(DECODED[version])


@pytest.mark.parametrize("version", releases.SUPPORTED)
def test_every_release_lays_out_what_the_native_decoder_reads(version: str) -> None:
    # Compiled or not, each release hands the decoder the positions its record gives, and
    # a compiled release's are its Rust table's.
    layout = releases.get(version).native_layout
    assert {"EngineCoreOutputs", "EngineCoreOutput", "UtilityOutput"} <= set(layout)
    for name, fields in layout.items():
        assert fields == _wire_names(layouts.types_for(version)[name])
        if version in DECODED and name in DECODED[version]:
            assert fields == _native.wire_fields(name, version)
    assert native_decoder(version) is not None


@pytest.mark.parametrize(("version", "name"), PAIRS)
def test_rust_wire_order_equals_the_python_struct(version: str, name: str) -> None:
    assert _native.wire_fields(name, version) == _wire_names(layouts.types_for(version)[name])


@pytest.mark.parametrize("name", DECODED["0.25.1"])
def test_0_25_1_structs_are_those_of_protocol_py(name: str) -> None:
    assert layouts.types_for("0.25.1")[name] is getattr(p, name)
    assert _native.wire_fields(name) == _wire_names(getattr(p, name))


def test_0_33_0_inserts_ec_transfer_params_at_9() -> None:
    fields = _native.wire_fields("EngineCoreOutput", "0.33.0")
    assert len(fields) == 19
    assert fields[8:11] == ("kv_transfer_params", "ec_transfer_params", "trace_headers")
    assert fields[-1] == "error"
    assert _native.wire_fields("EngineCoreOutputs", "0.33.0")[-1] == "weight_version"
    assert len(_native.wire_fields("LogprobsTensors", "0.33.0")) == 5


def test_0_33_0_structs_are_0_25_1_edited_as_the_records_say() -> None:
    """The 0.33.0 classes have no table of their own: each has its record's wire names,
    keeps 0.25.1's class where the layout it reaches did not change, keeps 0.25.1's
    attribute names for the fields it kept, and keeps what a record cannot say (0.33.0's
    normalisations)."""
    from corewire.releases import records
    from corewire.releases.structs import wire_names

    old, new = records.load("0.25.1"), records.load("0.33.0")
    base, table = layouts.types_for("0.25.1"), layouts.types_for("0.33.0")
    edited = []
    for name, cls in table.items():
        recorded = tuple(f["encode_name"] for f in new["structs"][name]["fields"])
        assert wire_names(cls) == recorded, name
        if name not in base:
            continue
        if records.reachable(old, name) == records.reachable(new, name):
            assert cls is base[name], name
            continue
        edited.append(name)
        if hasattr(cls, "__struct_fields__"):
            kept = {f.encode_name: f.name for f in msgspec.structs.fields(base[name])}
            for f in msgspec.structs.fields(cls):
                assert kept.get(f.encode_name, f.name) == f.name, (name, f.name)
    assert set(edited) == {
        "EngineCoreOutputs",
        "EngineCoreOutput",
        "LogprobsTensors",
        "EngineCoreRequest",
        "SamplingParams",
        "PoolingParams",
        "LoRARequest",
    }
    sampling = table["SamplingParams"](all_stop_token_ids=set(), stop_token_ids=[2, 2, 3])
    assert sampling.stop_token_ids == [2, 3] and sampling.all_stop_token_ids == {2, 3}
    assert msgspec.structs.fields(table["PoolingParams"])[0].name == "normalize"


def test_the_old_layouts_name_still_imports_and_warns() -> None:
    sys.modules.pop("corewire.layouts", None)
    try:
        with pytest.warns(DeprecationWarning, match=r"corewire\.wire\.layouts"):
            old = importlib.import_module("corewire.layouts")
        assert old.types_for is layouts.types_for and old.V0_33_0_TYPES is layouts.V0_33_0_TYPES
    finally:
        sys.modules.pop("corewire.layouts", None)


def test_a_struct_without_a_table_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="SamplingParams"):
        _native.wire_fields("SamplingParams")
    with pytest.raises(KeyError, match="SamplingMaskLists"):
        _native.wire_fields("SamplingMaskLists", "0.25.1")
    with pytest.raises(ValueError, match=r"0\.26\.0"):
        _native.wire_fields("EngineCoreOutput", "0.26.0")  # no compiled table: run time


@pytest.mark.parametrize("name", ["EngineCoreOutputs", "EngineCoreOutput"])
def test_native_objects_are_built_from_the_tables(name: str) -> None:
    native = getattr(_native, name)
    # The attributes: 0.25.1's fields in its wire order, then those later releases added
    # (0.33.0's in its order, then the rest of the table).
    old = _native.wire_fields(name, "0.25.1")
    new = _native.wire_fields(name, "0.33.0")
    added = tuple(f for f in new if f not in old)
    assert added
    later = native.__struct_fields__[len(old) :]
    assert native.__struct_fields__[: len(old)] == old
    assert later[: len(added)] == added
    for field in native.__struct_fields__:
        member = native.__dict__[field]
        assert member.__doc__, f"{name}.{field} has no doc"


def test_repr_and_attributes_follow_the_table() -> None:
    out = p.EngineCoreOutput(
        request_id="r-1",
        new_token_ids=[3, 4],
        finish_reason=p.FinishReason.LENGTH,
        stop_reason="</s>",
        num_nans_in_logits=2,
    )
    message = p.EngineCoreOutputs(engine_index=1, outputs=[out], timestamp=2.5)
    decoded = NativeDecoder(release="0.25.1").decode(
        [bytes(f) for f in Encoder(release="0.25.1").encode(message)]
    )
    got = decoded.outputs[0]
    for field in _native.wire_fields("EngineCoreOutput"):
        assert getattr(got, field) == getattr(out, field), field
    # the fields 0.25.1 lacks take the defaults 0.33.0 gives them
    assert got.ec_transfer_params is got.error is None
    assert decoded.weight_version is None
    shown = repr(got)
    assert shown.startswith("EngineCoreOutput(request_id='r-1', new_token_ids=[3, 4], ")
    positions = [shown.index(f"{field}=") for field in type(got).__struct_fields__]
    assert positions == sorted(positions)
    assert "num_nans_in_logits=2, " in shown
    assert shown.endswith("error=None, watermarking=None)")
    assert repr(decoded).startswith("EngineCoreOutputs(engine_index=1, outputs=[")
