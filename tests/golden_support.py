"""A decoded engine message as plain JSON data, the same for vLLM's objects and corewire's.

The golden-frame generator (``tests/data/vllm-0.33.0/make_golden.py``, run with vLLM
0.33.0 installed) dumps what vLLM's own decoder made of each frame through
:func:`jsonable`; the tests pass what corewire's decoder made of the same frame through it
and compare. It imports neither vLLM nor corewire, so both sides run the very same code.

Structs become ``{field: value}`` over all their fields (msgspec's ``__struct_fields__``,
a dataclass's fields, a named tuple's ``_fields``); ndarrays and tensors become
``{"dtype", "shape", "data"}``; enums their values; sets sorted lists; ``UtilityResult``
``{"result": ...}``; floats stay floats (JSON keeps them exactly); a struct field left
``msgspec.UNSET`` (absent on the wire) is left out. With
``wire_names=True`` a msgspec struct's keys are its wire names (``__struct_encode_fields__``:
vLLM's ``_eos_token_id`` is corewire's ``eos_token_id``), for requests.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


def jsonable(obj: Any, *, wire_names: bool = False) -> Any:
    """``obj`` as JSON-compatible data (see the module docstring)."""
    return _jsonable(obj, wire_names)


def _jsonable(obj: Any, wire_names: bool) -> Any:
    def jsonable(value: Any) -> Any:  # the public one's recursion, keeping wire_names
        return _jsonable(value, wire_names)

    if isinstance(obj, enum.Enum):  # first: a str or int enum is a str or int too
        return jsonable(obj.value)
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(obj).hex()}
    if hasattr(obj, "__array_interface__") or type(obj).__name__ == "Tensor":
        return _array(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {f: jsonable(getattr(obj, f)) for f in obj._fields}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(jsonable(v) for v in obj)
    if isinstance(obj, dict):
        return {str(jsonable(k)): jsonable(v) for k, v in obj.items()}
    if type(obj).__name__ == "UtilityResult":
        return {"result": jsonable(obj.result)}
    fields = getattr(type(obj), "__struct_fields__", None)
    if fields is not None:
        names = type(obj).__struct_encode_fields__ if wire_names else fields
        return {
            n: jsonable(getattr(obj, f))
            for f, n in zip(fields, names, strict=True)
            if not _unset(getattr(obj, f))
        }
    if dataclasses.is_dataclass(obj):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    raise TypeError(f"no JSON form for {type(obj).__name__}")


def _unset(value: Any) -> bool:
    # msgspec.UNSET, by name: this module imports neither side's libraries
    return type(value).__name__ == "UnsetType"


def _array(obj: Any) -> dict[str, Any]:
    if type(obj).__name__ == "Tensor":
        dtype = str(obj.dtype).removeprefix("torch.")
        return {"dtype": dtype, "shape": list(obj.shape), "data": obj.flatten().tolist()}
    return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.flatten().tolist()}
