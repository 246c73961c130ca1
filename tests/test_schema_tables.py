"""The Rust decoder's wire tables against ``corewire.protocol``: one schema, two languages.

The Rust core declares each struct it decodes once, as a table (``rust/src/core/wire.rs``);
its wire order for the protocol version it speaks is exposed read-only as
``_native.wire_fields``. ``corewire.protocol`` declares the same structs for Python. These
tests fail as soon as the two disagree on a name or a position, and check that the
decoded objects' attributes, ``__struct_fields__`` and repr come from those tables.

Checks ``docs/protocol.md`` §5.2-§5.4 and §5.6-§5.7 (the decoded structs' field positions,
in both languages) and §11 (the decoder speaks the 0.25.1 layout).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from corewire import _native
from corewire import protocol as p
from corewire.codec import Encoder, NativeDecoder

#: Every struct of ``corewire.protocol`` that the engine -> front-end decoder reads.
DECODED = (
    "EngineCoreOutputs",
    "EngineCoreOutput",
    "UtilityOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "EngineCoreEvent",
)


def _wire_names(cls: Any) -> tuple[str, ...]:
    """The names a struct's fields have on the wire, in order."""
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return tuple(cls.__struct_encode_fields__)
    # the NamedTuples (LogprobsLists, LogprobsTensors) travel as arrays in field order
    return tuple(cls._fields)


def test_the_rust_tables_cover_every_decoded_struct() -> None:
    assert set(_native.wire_structs()) == set(DECODED)


@pytest.mark.parametrize("name", DECODED)
def test_rust_wire_order_equals_protocol_py(name: str) -> None:
    assert _native.wire_fields(name) == _wire_names(getattr(p, name))


def test_the_decoder_speaks_vllm_0_25_1() -> None:
    assert _native.wire_version() == "0.25.1"


def test_a_struct_without_a_table_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="SamplingParams"):
        _native.wire_fields("SamplingParams")


@pytest.mark.parametrize("name", ["EngineCoreOutputs", "EngineCoreOutput"])
def test_native_objects_are_built_from_the_tables(name: str) -> None:
    native = getattr(_native, name)
    fields = _native.wire_fields(name)
    assert native.__struct_fields__ == fields
    for field in fields:
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
    decoded = NativeDecoder().decode([bytes(f) for f in Encoder().encode(message)])
    got = decoded.outputs[0]
    for field in _native.wire_fields("EngineCoreOutput"):
        assert getattr(got, field) == getattr(out, field), field
    shown = repr(got)
    assert shown.startswith("EngineCoreOutput(request_id='r-1', new_token_ids=[3, 4], ")
    positions = [shown.index(f"{field}=") for field in _native.wire_fields("EngineCoreOutput")]
    assert positions == sorted(positions)
    assert "num_nans_in_logits=2)" in shown
    assert repr(decoded).startswith("EngineCoreOutputs(engine_index=1, outputs=[")
