"""Deeply nested values in EngineCoreOutputs frames, for tests/codec/test_decoder_depth.py and
the child process it starts (plain code over bytes, importable without test machinery).

"Levels" counts the containers in a field's value: ``[[]]`` is 2 levels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SHAPES = ("arrays", "maps", "key_tuples", "mixed")


def deep(shape: str, levels: int) -> bytes:
    """msgpack of a value of ``levels`` nested containers (levels >= 2)."""
    if shape == "arrays":  # [[...[]]]
        return b"\x91" * (levels - 1) + b"\x90"
    if shape == "maps":  # {"k": {"k": ... {}}}
        return b"\x81\xa1k" * (levels - 1) + b"\x80"
    if shape == "key_tuples":  # {((...(),),): 1}: arrays as map keys become tuples
        return b"\x81" + b"\x91" * (levels - 2) + b"\x90\x01"
    if shape == "mixed":  # [{"k": [{"k": ...}]}]
        out = b"".join(b"\x91" if i % 2 == 0 else b"\x81\xa1k" for i in range(levels - 1))
        return out + (b"\x90" if levels % 2 else b"\x80")
    raise ValueError(shape)


def in_kv_transfer_params(value: bytes) -> bytes:
    """EngineCoreOutputs(outputs=[EngineCoreOutput("r", [], kv_transfer_params={"k": value})])."""
    return b"\x92\x00\x91\x99\xa1r\x90" + b"\xc0" * 6 + b"\x81\xa1k" + value


def in_utility_result(value: bytes) -> bytes:
    """EngineCoreOutputs(utility_output=UtilityOutput(1, None, UtilityResult(value)))."""
    return b"\x95\x00\x90\xc0\xcb" + bytes(8) + b"\x93\x01\xc0\x92\xc0" + value


def kv_value(message: Any) -> Any:
    """The deep value of an in_kv_transfer_params frame, decoded."""
    return message.outputs[0].kv_transfer_params["k"]


def utility_value(message: Any) -> Any:
    """The deep value of an in_utility_result frame, decoded."""
    return message.utility_output.result.result


# place name -> (frame maker, value getter, error path of the value)
PLACES: dict[str, tuple[Callable[[bytes], bytes], Callable[[Any], Any], str]] = {
    "kv_transfer_params": (in_kv_transfer_params, kv_value, 'outputs[0].kv_transfer_params["k"]'),
    "utility_result": (in_utility_result, utility_value, "utility_output.result[1]"),
}


def chain(value: Any) -> list[str]:
    """The container types along a chain of one-element containers, outermost first
    (walked without recursion: comparing or printing such values would recurse)."""
    kinds = []
    while isinstance(value, (list, tuple, dict)):
        kinds.append(type(value).__name__)
        if not value:
            break
        if isinstance(value, dict):
            ((key, item),) = value.items()
            value = key if isinstance(key, tuple) else item
        else:
            (value,) = value
    return kinds
