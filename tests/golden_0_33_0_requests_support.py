"""The vLLM 0.33.0 golden requests (``tests/data/vllm-0.33.0/request_*``): loading them.

Shared by the request golden test (main environment) and the live test (vLLM 0.33.0).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from golden_0_33_0_support import DATA


@cache
def expected_requests() -> dict[str, Any]:
    """``expected_requests.json``: per case, its frame count and vLLM's decoded value
    (structs keyed by wire name)."""
    data = json.loads((DATA / "expected_requests.json").read_text())
    data.pop("vllm")
    return data


def request_frames(case: str) -> list[bytes]:
    """The golden frames of request ``case`` (payload first)."""
    n = expected_requests()[case]["frames"]
    return [(DATA / f"request_{case}.{i}.bin").read_bytes() for i in range(n)]
