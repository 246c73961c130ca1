"""The recorded wire records that ship with corewire (``data/vllm-<release>.json``).

Each file is what ``corewire.releases.derive.derive()`` read off one vLLM release
(``tools/record-vllm-release`` writes them); this module only finds and reads them.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

__all__ = [
    "MISSING",
    "add_live",
    "defaults",
    "defaults_or_missing",
    "load",
    "reachable",
    "releases",
    "shipped",
]

_PREFIX = "vllm-"
_SUFFIX = ".json"


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


#: Records read off an installed vLLM newer than every shipped one, by release (JSON
#: text: each load is a fresh copy), for this process only (:func:`add_live`).
_LIVE: dict[str, str] = {}


@cache
def shipped() -> tuple[str, ...]:
    """Every release whose record ships with corewire, oldest first (``("0.25.1",
    ...)``)."""
    data = resources.files(__package__) / "data"
    names = [
        p.name[len(_PREFIX) : -len(_SUFFIX)]
        for p in data.iterdir()
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX)
    ]
    return tuple(sorted(names, key=_key))


def releases() -> tuple[str, ...]:
    """Every release with a record, oldest first: those shipped, then any read live."""
    return tuple(sorted({*shipped(), *_LIVE}, key=_key))


def add_live(record: dict[str, Any]) -> str:
    """Keep ``record`` (``corewire.releases.derive.derive()`` of the installed vLLM) as
    the record of its release for this process; returns the release's name."""
    name = str(record["vllm"]).strip().split("+", 1)[0]
    _LIVE[name] = json.dumps(record)
    return name


def load(release: str) -> dict[str, Any]:
    """The record of ``release`` (a fresh copy: callers may change it);
    ``KeyError`` for a release not recorded."""
    if release in _LIVE:
        return json.loads(_LIVE[release])
    if release not in shipped():
        raise KeyError(f"no recorded wire for vLLM {release!r}")
    path = resources.files(__package__) / "data" / f"{_PREFIX}{release}{_SUFFIX}"
    return json.loads(path.read_text(encoding="utf-8"))


_FACTORIES: dict[str, Any] = {"list": list, "dict": dict, "set": set, "tuple": tuple}


#: A field without a default, in :func:`defaults_or_missing`.
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()


def defaults_or_missing(record: dict[str, Any], name: str) -> dict[str, Any]:
    """As :func:`defaults`, with :data:`MISSING` for a field that has no default."""
    entry = record["structs"][name]
    out: dict[str, Any] = {}
    for field in entry["fields"]:
        if "default" not in field:
            out[field["encode_name"]] = MISSING
            continue
        out.update(_default_of(record, field))
    return out


def _default_of(record: dict[str, Any], field: dict[str, Any]) -> dict[str, Any]:
    value = field["default"]
    if isinstance(value, dict) and "factory" in value:
        factory = value["factory"]
        if factory in _FACTORIES:
            value = _FACTORIES[factory]()
        else:
            value = defaults(record, factory.rpartition(".")[2])
    elif isinstance(value, (dict, list)):
        value = json.loads(json.dumps(value))  # a copy, for the caller to change
    return {field["encode_name"]: value}


def defaults(record: dict[str, Any], name: str) -> dict[str, Any]:
    """A fresh map of every field of recorded struct ``name`` at its default, in the
    record's order, as the release's own engines write an instance made without
    arguments (``SchedulerStats()``): a default factory that is a recorded class gives
    that class's defaults, nested. ``KeyError`` for a struct not recorded, ``ValueError``
    for one with a field that has no default."""
    entry = record["structs"][name]
    out: dict[str, Any] = {}
    for field in entry["fields"]:
        if "default" not in field:
            raise ValueError(f"{name}.{field['name']} has no default")
        out.update(_default_of(record, field))
    return out


def reachable(record: dict[str, Any], name: str) -> dict[str, Any]:
    """Struct ``name``'s layout and that of every struct and enum it reaches, from
    ``record``, by ``"struct:Name"`` / ``"enum:Name"`` (the defining module left out: a
    class that moved does not change the wire)."""
    found: dict[str, Any] = {}
    pending = [("struct", name)]
    while pending:
        kind, current = pending.pop()
        key = f"{kind}:{current}"
        if key in found:
            continue
        table = record["structs" if kind == "struct" else "enums"]
        entry = table.get(current)
        found[key] = None if entry is None else {k: v for k, v in entry.items() if k != "module"}
        if kind == "struct" and entry is not None:
            stack: list[Any] = [f["type"] for f in entry["fields"]]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if node.get("kind") in ("struct", "enum") and "name" in node:
                        pending.append((node["kind"], node["name"]))
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    return found
