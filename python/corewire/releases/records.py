"""The recorded wire records that ship with corewire (``data/vllm-<release>.json``).

Each file is what ``corewire.releases.derive.derive()`` read off one vLLM release
(``tools/record-vllm-release`` writes them); this module only finds and reads them.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["load", "releases"]

_PREFIX = "vllm-"
_SUFFIX = ".json"


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


@cache
def releases() -> tuple[str, ...]:
    """Every recorded release, oldest first (``("0.25.1", ...)``)."""
    data = resources.files(__package__) / "data"
    names = [
        p.name[len(_PREFIX) : -len(_SUFFIX)]
        for p in data.iterdir()
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX)
    ]
    return tuple(sorted(names, key=_key))


def load(release: str) -> dict[str, Any]:
    """The record of ``release`` (a fresh copy: callers may change it);
    ``KeyError`` for a release not recorded."""
    if release not in releases():
        raise KeyError(f"no recorded wire for vLLM {release!r}")
    path = resources.files(__package__) / "data" / f"{_PREFIX}{release}{_SUFFIX}"
    return json.loads(path.read_text(encoding="utf-8"))
