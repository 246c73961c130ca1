"""The wire layout of an importable vLLM, read off its own classes, as plain JSON data.

:func:`derive` walks vLLM's engine-core wire classes with ``msgspec.inspect`` (which
also describes dataclasses, named tuples and TypedDicts) from the roots in
:data:`ROOTS`, following every type a field names, and returns a *record*::

    {"vllm": "0.33.0",
     "roots": ["EngineCoreOutputs", ...],
     "structs": {Name: {"module", "kind", "array_like", "omit_defaults",
                        "forbid_unknown_fields", "tag_field", "tag",
                        "fields": [{"name", "encode_name", "type", "required",
                                    "default"?}, ...]}},
     "enums": {Name: {member: value}}}

``kind`` is ``"struct"`` (a ``msgspec.Struct``), ``"namedtuple"``, ``"dataclass"`` or
``"typeddict"``. Fields keep their declaration order, which is the wire order (an
array's positions, a map's key order); a TypedDict's fields are sorted by name, as
``msgspec.inspect`` gives them (its wire order is the order of each value's keys). A
field without ``default`` is required; a default made by a factory is
``{"factory": "list"}`` (the factory's name); an enum default is
``{"enum": Name, "member": member}``; bytes are ``{"bytes": hex}``. A dataclass field
that its ``__init__`` does not take has ``"init": false``.

Types are small trees (:func:`type_tree`): ``{"kind": "int"|"float"|"str"|"bool"|
"bytes"|"none"|"any"|...}``, ``{"kind": "union", "types": [...]}``, ``{"kind":
"list"|"set"|"frozenset", "item": ...}``, ``{"kind": "tuple", "items": [...]}``,
``{"kind": "tuple", "item": ..., "variadic": true}``, ``{"kind": "dict", "key": ...,
"value": ...}``, ``{"kind": "struct", "name": ...}``, ``{"kind": "enum", "name": ...}``,
``{"kind": "literal", "values": [...]}`` and ``{"kind": "custom", "class":
"numpy.ndarray"}`` for a class msgspec leaves to the encoder's hooks (ndarrays,
tensors, ``UtilityResult``...).

The same function serves a live vLLM and the recorder (``tools/record-vllm-release``):
nothing here knows one release from another. The output is deterministic: structs and
enums are sorted by name, everything else keeps vLLM's order.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import msgspec.inspect as mi

__all__ = ["ENUM_ROOTS", "ROOTS", "derive", "describe", "jsonable_default", "type_tree"]

#: Where the walk starts: (module, class). Every message of the protocol is one of
#: these or nested in one (a release without a class skips it).
ROOTS: tuple[tuple[str, str], ...] = (
    ("vllm.v1.engine", "EngineCoreOutputs"),
    ("vllm.v1.engine", "EngineCoreRequest"),
    ("vllm.v1.engine", "EngineCoreReadyResponse"),
    ("vllm.v1.engine", "UtilityOutput"),
)

#: Enums no struct field names but the protocol uses (first frames, utility results):
#: recorded too, where a release has them.
ENUM_ROOTS: tuple[tuple[str, str], ...] = (
    ("vllm.v1.engine", "EngineCoreRequestType"),
    ("vllm.v1.engine", "EEPNotificationType"),
    ("vllm.v1.engine", "EngineStatusType"),
)

_SCALARS: dict[type, str] = {
    mi.AnyType: "any",
    mi.NoneType: "none",
    mi.BoolType: "bool",
    mi.IntType: "int",
    mi.FloatType: "float",
    mi.StrType: "str",
    mi.BytesType: "bytes",
    mi.ByteArrayType: "bytearray",
    mi.MemoryViewType: "memoryview",
    mi.DateTimeType: "datetime",
    mi.TimeType: "time",
    mi.DateType: "date",
    mi.TimeDeltaType: "timedelta",
    mi.UUIDType: "uuid",
    mi.DecimalType: "decimal",
    mi.ExtType: "ext",
    mi.RawType: "raw",
}
_COLLECTIONS: dict[type, str] = {
    mi.ListType: "list",
    mi.SetType: "set",
    mi.FrozenSetType: "frozenset",
}
# msgspec describes frozendict (Python 3.15) only in its newer releases.
_DICTS = tuple(t for t in (mi.DictType, getattr(mi, "FrozenDictType", None)) if t is not None)
_COMPOUND = (mi.StructType, mi.DataclassType, mi.NamedTupleType, mi.TypedDictType)
_KIND = {
    mi.StructType: "struct",
    mi.DataclassType: "dataclass",
    mi.NamedTupleType: "namedtuple",
    mi.TypedDictType: "typeddict",
}


def derive(vllm_module: Any = None) -> dict[str, Any]:
    """The wire record of the importable vLLM (see the module docstring).

    ``vllm_module`` is the imported ``vllm`` package (imported here when None); raises
    ``ImportError`` without vLLM, or when its wire modules do not import.
    """
    vllm = vllm_module if vllm_module is not None else importlib.import_module("vllm")
    roots = [cls for cls in (_find(m, n) for m, n in ROOTS) if cls is not None]
    if not roots:
        raise ImportError(f"vLLM {vllm.__version__} has none of the wire classes {ROOTS}")
    enums = [cls for cls in (_find(m, n) for m, n in ENUM_ROOTS) if cls is not None]
    return {"vllm": str(vllm.__version__), **describe(roots, enums)}


def describe(roots: Sequence[type], enums: Sequence[type] = ()) -> dict[str, Any]:
    """``{"roots", "structs", "enums"}`` of a record for the classes ``roots`` and all
    they reach, plus the enums ``enums`` (any classes msgspec can describe, vLLM's or
    not); ``TypeError`` if two of them share a name."""
    walker = _Walker()
    for info in mi.multi_type_info(roots):
        walker.visit(info)
    for cls in enums:
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            walker.enum_ref(cls)
    return {
        "roots": [cls.__name__ for cls in roots],
        "structs": {k: walker.structs[k] for k in sorted(walker.structs)},
        "enums": {k: walker.enums[k] for k in sorted(walker.enums)},
    }


def type_tree(info: mi.Type) -> dict[str, Any]:
    """One ``msgspec.inspect`` type as a record's type tree (no struct is registered:
    a struct or enum is only named)."""
    return _Walker(register=False).tree(info)


def jsonable_default(value: Any) -> Any:
    """A field's default as record data (see the module docstring)."""
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__name__, "member": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # JSON has no inf or nan; a tagged string keeps them.
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [jsonable_default(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable_default(v) for v in value), key=repr)
    return {"repr": repr(value)}


def _find(module: str, name: str) -> Any:
    # A module that fails to import is an error (a broken environment would otherwise
    # read as a release without those messages); a missing class is a release without it.
    return getattr(importlib.import_module(module), name, None)


def _factory_name(factory: Any) -> str:
    module = getattr(factory, "__module__", None)
    name = getattr(factory, "__qualname__", None) or repr(factory)
    return name if module in (None, "builtins") else f"{module}.{name}"


class _Walker:
    """Collects every struct and enum reachable from the types it visits."""

    def __init__(self, *, register: bool = True) -> None:
        self.register = register
        self.structs: dict[str, dict[str, Any]] = {}
        self.enums: dict[str, dict[str, Any]] = {}
        # The class each name stands for: two classes of one name would be confused.
        self._names: dict[str, type] = {}

    def visit(self, info: mi.Type) -> None:
        self.tree(info)

    def _claim(self, cls: type) -> tuple[str, bool]:
        """``cls``'s record name, and whether it still needs recording."""
        name = cls.__name__
        known = self._names.get(name)
        if known is None:
            self._names[name] = cls
            return name, True
        if known is not cls:
            raise TypeError(
                f"two wire classes named {name}: {known.__module__}.{known.__qualname__} "
                f"and {cls.__module__}.{cls.__qualname__}"
            )
        return name, False

    def enum_ref(self, cls: type[enum.Enum]) -> dict[str, Any]:
        name, new = self._claim(cls)
        if new and self.register:
            self.enums[name] = {m.name: jsonable_default(m.value) for m in cls}
        return {"kind": "enum", "name": name}

    def struct_ref(self, info: Any) -> dict[str, Any]:
        cls = info.cls
        name, new = self._claim(cls)
        if new and self.register:
            config = getattr(cls, "__struct_config__", None)
            entry: dict[str, Any] = {
                "module": cls.__module__,
                "kind": _KIND[type(info)],
                "array_like": bool(
                    info.array_like if isinstance(info, mi.StructType) else _is_nt(info)
                ),
                "omit_defaults": bool(config.omit_defaults) if config is not None else False,
                "forbid_unknown_fields": bool(getattr(info, "forbid_unknown_fields", False)),
                "tag_field": getattr(info, "tag_field", None),
                "tag": getattr(info, "tag", None),
                "fields": [],
            }
            # Registered before its fields: a field may name this struct again.
            self.structs[name] = entry
            no_init = _no_init_fields(cls)
            entry["fields"] = [self._field(f, f.name in no_init) for f in info.fields]
        return {"kind": "struct", "name": name}

    def _field(self, f: mi.Field, no_init: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": f.name,
            "encode_name": f.encode_name,
            "type": self.tree(f.type),
            "required": bool(f.required),
        }
        if no_init:
            # msgspec writes such a field only once the instance has set it (a default
            # left on the class is not written).
            out["init"] = False
        if f.default_factory is not msgspec.NODEFAULT:
            out["default"] = {"factory": _factory_name(f.default_factory)}
        elif f.default is not msgspec.NODEFAULT:
            out["default"] = jsonable_default(f.default)
        return out

    def tree(self, info: mi.Type) -> dict[str, Any]:
        if isinstance(info, mi.Metadata):
            # Constraints and schema text only check values; the wire is the inner type.
            return self.tree(info.type)
        scalar = _SCALARS.get(type(info))
        if scalar is not None:
            return {"kind": scalar}
        collection = _COLLECTIONS.get(type(info))
        if collection is not None:
            return {"kind": collection, "item": self.tree(info.item_type)}
        if isinstance(info, mi.VarTupleType):
            return {"kind": "tuple", "item": self.tree(info.item_type), "variadic": True}
        if isinstance(info, mi.TupleType):
            return {"kind": "tuple", "items": [self.tree(t) for t in info.item_types]}
        if isinstance(info, _DICTS):
            kind = "dict" if isinstance(info, mi.DictType) else "frozendict"
            return {
                "kind": kind,
                "key": self.tree(info.key_type),
                "value": self.tree(info.value_type),
            }
        if isinstance(info, mi.UnionType):
            return {"kind": "union", "types": [self.tree(t) for t in info.types]}
        if isinstance(info, mi.LiteralType):
            return {"kind": "literal", "values": [jsonable_default(v) for v in info.values]}
        if isinstance(info, mi.EnumType):
            return self.enum_ref(info.cls)
        if isinstance(info, _COMPOUND):
            return self.struct_ref(info)
        if isinstance(info, mi.CustomType):
            cls = info.cls
            return {"kind": "custom", "class": f"{cls.__module__}.{cls.__qualname__}"}
        # A type msgspec.inspect gained after this was written: named, not guessed at.
        return {"kind": "unknown", "inspect": type(info).__name__}


def _no_init_fields(cls: type) -> frozenset[str]:
    if not dataclasses.is_dataclass(cls):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(cls) if not f.init)


def _is_nt(info: Any) -> bool:
    return isinstance(info, mi.NamedTupleType)
