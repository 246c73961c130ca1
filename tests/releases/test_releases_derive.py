"""``corewire.releases.derive`` on classes made here: what a record says of each kind of
type, default and struct option (no vLLM needed), and ``build_structs`` writing the same
bytes as the classes it was read from."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np
import pytest

from corewire.releases.derive import describe
from corewire.releases.structs import build_structs


class Colour(enum.IntEnum):
    RED = 1
    BLUE = 2


class Pair(NamedTuple):
    ids: np.ndarray
    offsets: list[int] | None = None


@dataclasses.dataclass
class Stats:
    count: int
    ratio: float = 0.5
    seen: list[str] = dataclasses.field(default_factory=list)
    backend: str | None = dataclasses.field(default=None, init=False)


class Inner(msgspec.Struct, array_like=True):
    x: int
    colour: Colour = Colour.BLUE


class Outer(msgspec.Struct, omit_defaults=True, kw_only=True):
    name: str
    private: int = msgspec.field(default=0, name="_private")
    inner: Inner | None = None
    pair: Pair | None = None
    stats: Stats | None = None
    tags: set[str] = msgspec.field(default_factory=set)
    kind: Literal["a", "b"] = "a"
    span: tuple[int, float] | None = None
    rest: tuple[int, ...] = ()
    extra: dict[str, Any] | None = None
    blob: bytes = b"\x00\x01"


def test_describe_records_each_kind() -> None:
    record = describe([Outer])
    assert record["roots"] == ["Outer"]
    assert list(record["structs"]) == ["Inner", "Outer", "Pair", "Stats"]
    assert record["enums"] == {"Colour": {"RED": 1, "BLUE": 2}}
    outer = record["structs"]["Outer"]
    assert (outer["kind"], outer["array_like"], outer["omit_defaults"]) == ("struct", False, True)
    fields = {f["name"]: f for f in outer["fields"]}
    assert [f["name"] for f in outer["fields"]] == list(Outer.__struct_fields__)
    assert fields["private"]["encode_name"] == "_private"
    assert fields["name"] == {
        "name": "name",
        "encode_name": "name",
        "type": {"kind": "str"},
        "required": True,
    }
    assert fields["inner"]["type"] == {
        "kind": "union",
        "types": [{"kind": "struct", "name": "Inner"}, {"kind": "none"}],
    }
    assert fields["tags"]["default"] == {"factory": "set"}
    assert fields["kind"]["type"] == {"kind": "literal", "values": ["a", "b"]}
    assert fields["span"]["type"]["types"][0] == {
        "kind": "tuple",
        "items": [{"kind": "int"}, {"kind": "float"}],
    }
    assert fields["rest"]["type"] == {"kind": "tuple", "item": {"kind": "int"}, "variadic": True}
    assert fields["extra"]["type"]["types"][0] == {
        "kind": "dict",
        "key": {"kind": "str"},
        "value": {"kind": "any"},
    }
    assert fields["blob"]["default"] == {"bytes": "0001"}
    inner = record["structs"]["Inner"]
    assert inner["array_like"] and inner["fields"][1]["default"] == {
        "enum": "Colour",
        "member": "BLUE",
    }
    pair = record["structs"]["Pair"]
    assert pair["kind"] == "namedtuple" and pair["array_like"]
    assert pair["fields"][0]["type"] == {"kind": "custom", "class": "numpy.ndarray"}
    stats = {f["name"]: f for f in record["structs"]["Stats"]["fields"]}
    assert record["structs"]["Stats"]["kind"] == "dataclass"
    assert stats["backend"]["init"] is False and "init" not in stats["count"]


def test_two_classes_of_one_name_are_refused() -> None:
    other = msgspec.defstruct("Inner", [("y", str)])
    holder = msgspec.defstruct("Holder", [("a", Inner), ("b", other)])
    with pytest.raises(TypeError, match="two wire classes named Inner"):
        describe([holder])


def test_built_structs_write_the_same_bytes() -> None:
    built = build_structs(describe([Outer]))
    stats = Stats(3, seen=["x"])
    stats.backend = "set"
    values = [
        Outer(name="n"),
        Outer(
            name="n",
            private=4,
            inner=Inner(7, Colour.RED),
            pair=Pair(np.arange(3, dtype=np.int32), [0, 3]),
            stats=stats,
            tags={"t"},
            kind="b",
            span=(1, 2.5),
            rest=(1, 2),
            extra={"k": [1, None]},
            blob=b"zz",
        ),
        Outer(name="n", stats=Stats(1)),  # backend never assigned: not written
    ]

    def enc_hook(obj: Any) -> Any:
        return obj.tolist()

    def dec_hook(t: type, obj: Any) -> Any:
        return np.asarray(obj, dtype=np.int32)

    for value in values:
        wire = msgspec.msgpack.encode(value, enc_hook=enc_hook)
        again = msgspec.msgpack.decode(wire, type=built["Outer"], dec_hook=dec_hook)
        assert msgspec.msgpack.encode(again, enc_hook=enc_hook) == wire
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(values[2]), type=built["Outer"]).stats.backend
        is msgspec.UNSET
    )
