"""msgspec types built from a wire record (``corewire.releases.derive``), for any release.

:func:`build_structs` turns each recorded struct into a type that decodes and encodes
the same bytes as the vLLM class it was read from: a ``msgspec.Struct`` (array or map,
``omit_defaults``, field order, wire names and defaults as recorded) for vLLM's structs,
dataclasses and TypedDicts, a ``NamedTuple`` for its named tuples, and an enum per
recorded enum. Classes msgspec leaves to hooks become corewire's: ``numpy.ndarray``
stays ``np.ndarray``, ``torch.Tensor`` is ``corewire.protocol.Tensor``, vLLM's
``UtilityResult`` is ``corewire.protocol.UtilityResult`` (``corewire.codec``'s encoder and
decoder handle all three); any other class is ``Any`` (decoded as plain msgpack data).

``as_maps`` names structs (or kinds: ``"dataclass"``, ``"typeddict"``) to keep as
``dict[str, Any]`` instead, as ``corewire.protocol`` keeps vLLM's statistics. A struct
that holds an array or tensor at any depth (``PlaceholderRange.is_embed``) stays typed:
in a plain map those would read as their raw ``[dtype, shape, data]`` and be written
back as something else.

A field the wire may lack without it meaning the default, a TypedDict's optional key or
a dataclass field its ``__init__`` does not take (msgspec writes one only once an
instance has assigned it: vLLM's ``StructuredOutputsParams._backend_was_auto``), decodes
as ``msgspec.UNSET`` when absent, where vLLM's class reads its default, so that writing
it again leaves it out as the sender did.

What a vLLM class does beyond its layout (``__post_init__`` checks and normalisations,
properties) is not built: these types read and write what is on the wire, nothing more.
"""

from __future__ import annotations

import enum
import math
import typing
from collections.abc import Collection
from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np

from corewire.protocol import Tensor, UtilityResult

__all__ = ["CUSTOM_CLASSES", "TypeReader", "build_structs", "type_reader"]

#: Recorded custom classes -> the type corewire decodes them as.
CUSTOM_CLASSES: dict[str, Any] = {
    "numpy.ndarray": np.ndarray,
    "torch.Tensor": Tensor,
    "vllm.v1.serial_utils.UtilityResult": UtilityResult,
}

_SCALARS: dict[str, Any] = {
    "any": Any,
    "none": None,
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "bytes": bytes,
    "bytearray": bytearray,
    "memoryview": memoryview,
    "ext": msgspec.msgpack.Ext,
    "raw": msgspec.Raw,
}
_COLLECTIONS: dict[str, Any] = {"list": list, "set": set, "frozenset": frozenset}


def build_structs(
    record: dict[str, Any],
    *,
    as_maps: Collection[str] = (),
    given: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record's structs and enums as types, by recorded name (see the module
    docstring). A struct that names itself, directly or through others, is built with
    that reference as ``Any``.

    ``given`` maps struct names to classes of the caller's to use instead of building
    them, where the class has the recorded fields in the recorded order (its wire names:
    a msgspec struct's encode names, a named tuple's fields); a class whose fields differ
    is not used, and the struct is built. So every release's messages decode into the
    same classes wherever their layout did not change."""
    return _Builder(record, frozenset(as_maps), given or {}).run()


class TypeReader(typing.Protocol):
    """What :func:`type_reader` gives: a record's field types and defaults read as the
    types :func:`build_structs` builds."""

    def type_of(self, t: dict[str, Any]) -> Any:
        """The type of the recorded type descriptor ``t``."""

    def default(self, value: Any) -> Any:
        """The recorded default ``value`` as a Python value."""

    def adopt(self, name: str, cls: Any) -> None:
        """Use ``cls`` for the recorded struct ``name`` from now on."""


def type_reader(
    record: dict[str, Any], *, as_maps: Collection[str] = (), given: dict[str, Any] | None = None
) -> TypeReader:
    """A reader of ``record``'s type descriptors (its enums built, its structs built when
    first reached, ``given`` and adopted classes used where named): for a layer that
    builds its own classes of some structs and needs the types of the rest."""
    builder = _Builder(record, frozenset(as_maps), given or {})
    for name, members in builder.enums.items():
        builder.built[name] = _enum(name, members)
    return builder


def wire_names(cls: Any) -> tuple[str, ...] | None:
    """The field names ``cls`` writes, in order: a msgspec struct's encode names, a named
    tuple's fields; None for any other class."""
    names = getattr(cls, "__struct_encode_fields__", None)
    if names is None:
        names = getattr(cls, "_fields", None)
    return None if names is None else tuple(names)


class _Builder:
    def __init__(
        self, record: dict[str, Any], as_maps: frozenset[str], given: dict[str, Any]
    ) -> None:
        self.structs: dict[str, Any] = record["structs"]
        self.enums: dict[str, Any] = record["enums"]
        self.as_maps = as_maps
        self.built: dict[str, Any] = {}
        self._building: set[str] = set()
        self.given = {
            name: cls
            for name, cls in given.items()
            if name in self.structs
            and wire_names(cls) == tuple(f["encode_name"] for f in self.structs[name]["fields"])
        }

    def adopt(self, name: str, cls: Any) -> None:
        self.built[name] = cls
        self.given[name] = cls

    def run(self) -> dict[str, Any]:
        for name, members in self.enums.items():
            self.built[name] = _enum(name, members)
        for name in self.structs:
            self.struct(name)
        return self.built

    def _mapped(self, name: str) -> bool:
        selected = name in self.as_maps or self.structs[name]["kind"] in self.as_maps
        return selected and not self._holds_custom(name, set())

    def _holds_custom(self, name: str, seen: set[str]) -> bool:
        """Whether struct ``name`` holds, at any depth, a class left to hooks."""
        if name in seen:
            return False
        seen.add(name)

        def holds(t: dict[str, Any]) -> bool:
            if t["kind"] == "custom":
                return True
            if t["kind"] == "struct":
                return self._holds_custom(t["name"], seen)
            subs = [t[k] for k in ("item", "key", "value") if k in t]
            subs += [*t.get("types", ()), *t.get("items", ())]
            return any(holds(sub) for sub in subs)

        return any(holds(f["type"]) for f in self.structs[name]["fields"])

    def struct(self, name: str) -> Any:
        if name in self.built:
            return self.built[name]
        if name in self.given:
            self.built[name] = self.given[name]
            return self.given[name]
        if name in self._building:
            return Any  # a cycle: the back reference decodes as plain data
        self._building.add(name)
        try:
            entry = self.structs[name]
            fields = entry["fields"]
            if entry["kind"] == "namedtuple":
                cls = self._namedtuple(name, fields)
            else:
                cls = self._struct(name, entry)
        finally:
            self._building.discard(name)
        self.built[name] = cls
        return cls

    def type_of(self, t: dict[str, Any]) -> Any:
        kind = t["kind"]
        if kind in _SCALARS:
            return _SCALARS[kind]
        if kind in _COLLECTIONS:
            return _COLLECTIONS[kind][self.type_of(t["item"])]
        if kind == "tuple":
            if t.get("variadic"):
                return tuple[self.type_of(t["item"]), ...]  # type: ignore[misc]
            items = tuple(self.type_of(i) for i in t["items"])
            return tuple[items] if items else tuple[()]  # type: ignore[valid-type]
        if kind in ("dict", "frozendict"):
            return dict[self.type_of(t["key"]), self.type_of(t["value"])]  # type: ignore[misc]
        if kind == "union":
            members = tuple(self.type_of(m) for m in t["types"])
            if Any in members:
                return Any
            return typing.Union[members]  # noqa: UP007 - built from a runtime tuple
        if kind == "literal":
            return Literal[tuple(self.default(v) for v in t["values"])]  # type: ignore[valid-type]
        if kind == "enum":
            return self.built[t["name"]]
        if kind == "struct":
            if t["name"] in self.given:
                return self.struct(t["name"])
            if self._mapped(t["name"]):
                return dict[str, Any]
            return self.struct(t["name"])
        if kind == "custom":
            return CUSTOM_CLASSES.get(t["class"], Any)
        raise ValueError(f"a field type of kind {kind!r} cannot be built")

    def default(self, value: Any) -> Any:
        if isinstance(value, dict):
            if "enum" in value:
                return self.built[value["enum"]][value["member"]]
            if "bytes" in value:
                return bytes.fromhex(value["bytes"])
            if "float" in value:
                return float(value["float"])
            raise ValueError(f"a default {value!r} cannot be built")
        if isinstance(value, list):
            return [self.default(v) for v in value]
        return value

    def _factory(self, name: str) -> Any:
        factories = {"list": list, "dict": dict, "set": set, "frozenset": frozenset, "tuple": tuple}
        if name in factories:
            return factories[name]
        # A recorded class as its own factory (SchedulerStats' PrefixCacheStats()).
        module, _, cls = name.rpartition(".")
        entry = self.structs.get(cls)
        if entry is not None and entry["module"] == module:
            return dict if self._mapped(cls) else self.struct(cls)
        raise ValueError(f"a default factory {name!r} cannot be built")

    def _struct(self, name: str, entry: dict[str, Any]) -> Any:
        typeddict = entry["kind"] == "typeddict"
        fields: list[tuple[Any, ...]] = []
        for f in entry["fields"]:
            ftype = self.type_of(f["type"])
            rename = {} if f["encode_name"] == f["name"] else {"name": f["encode_name"]}
            if (typeddict and not f["required"]) or f.get("init") is False:
                # A key a TypedDict value may lack, or a dataclass field its __init__ does
                # not take (written only once assigned): absent unless set, so that what
                # was left out stays out when written again.
                fields.append(
                    (
                        f["name"],
                        ftype | msgspec.UnsetType,
                        msgspec.field(default=msgspec.UNSET, **rename),
                    )
                )
            elif "default" in f:
                d = f["default"]
                if isinstance(d, dict) and "factory" in d:
                    spec = msgspec.field(default_factory=self._factory(d["factory"]), **rename)
                else:
                    spec = msgspec.field(default=self.default(d), **rename)
                fields.append((f["name"], ftype, spec))
            elif rename:
                fields.append((f["name"], ftype, msgspec.field(**rename)))
            else:
                fields.append((f["name"], ftype))
        return msgspec.defstruct(
            name,
            fields,
            module=__name__,
            # Keyword-only keeps the recorded order even where a required field follows
            # one with a default (a dataclass's init=False fields...).
            kw_only=True,
            array_like=entry["array_like"],
            omit_defaults=entry["omit_defaults"],
            forbid_unknown_fields=entry["forbid_unknown_fields"],
            tag_field=entry["tag_field"],
            tag=entry["tag"],
        )

    def _namedtuple(self, name: str, fields: list[dict[str, Any]]) -> Any:
        cls = NamedTuple(name, [(f["name"], self.type_of(f["type"])) for f in fields])  # type: ignore[misc]
        defaults = {f["name"]: self.default(f["default"]) for f in fields if "default" in f}
        if defaults:
            cls.__new__.__defaults__ = tuple(defaults.values())
            cls._field_defaults = defaults  # type: ignore[misc]
        cls.__module__ = __name__
        return cls


def _enum(name: str, members: dict[str, Any]) -> type[enum.Enum]:
    values = list(members.values())
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return enum.IntEnum(name, members, module=__name__)  # type: ignore[return-value]
    if all(isinstance(v, str) for v in values):
        return enum.Enum(name, members, module=__name__, type=str)  # type: ignore[call-overload]
    # bytes (the request types) and other values: read back as recorded
    decoded = {
        k: bytes.fromhex(v["bytes"]) if isinstance(v, dict) and "bytes" in v else v
        for k, v in members.items()
    }
    if any(isinstance(v, float) and not math.isfinite(v) for v in decoded.values()):
        raise ValueError(f"enum {name} has a value JSON cannot hold")
    return enum.Enum(name, decoded, module=__name__)  # type: ignore[return-value]
