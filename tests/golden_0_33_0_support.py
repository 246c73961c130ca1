"""The vLLM 0.33.0 golden frames (``tests/data/vllm-0.33.0``) and what corewire makes of them.

Shared by the golden test (main environment, vLLM 0.25.1) and the live test (vLLM 0.33.0
installed): loading the checked-in frames, and turning corewire's decoded objects back into
``corewire.wire.layouts`` structs to re-encode.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from corewire.wire import layouts

DATA = Path(__file__).resolve().parent / "data" / "vllm-0.33.0"


@cache
def expected() -> dict[str, Any]:
    """``expected.json``: per case, its frame count and vLLM's decoded value."""
    data = json.loads((DATA / "expected.json").read_text())
    data.pop("vllm")
    return data


def frames(case: str) -> list[bytes]:
    """The golden frames of ``case`` (payload first)."""
    n = expected()[case]["frames"]
    return [(DATA / f"{case}.{i}.bin").read_bytes() for i in range(n)]


def to_structs(message: Any, release: str) -> Any:
    """A decoded ``EngineCoreOutputs`` as ``protocol``'s structs (for an ``Encoder``)."""
    types = layouts.types_for(release)
    output_cls = types["EngineCoreOutput"]
    outputs = [
        output_cls(**{f: getattr(o, f) for f in output_cls.__struct_fields__})
        for o in message.outputs
    ]
    message_cls = types["EngineCoreOutputs"]
    fields = {f: getattr(message, f) for f in message_cls.__struct_fields__}
    fields["outputs"] = outputs
    return message_cls(**fields)
