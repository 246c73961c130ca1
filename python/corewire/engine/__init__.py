"""The engine side of corewire: the :class:`Engine` interface a user implements, the
:class:`EngineCoreProc` that serves it over the engine-core sockets, and the built-in
:class:`~corewire.engine.reference.ReferenceEngine` (a small torch language model).

An engine process is started with :func:`corewire.engine.launch.run_engine_core`
(by a client) or ``corewire engine`` (external engine mode, or joining a vLLM front-end
through vLLM's start-up handshake: :mod:`corewire.engine.handshake`). What an engine
reports about itself in its ready response is an :class:`EngineInfo`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from corewire.engine.core import EngineCoreProc
from corewire.engine.interface import Engine, EngineInfo

__all__ = [
    "Engine",
    "EngineCoreProc",
    "EngineInfo",
    "ReferenceEngine",
    "load_engine",
    "run_engine_core",
]

# Loaded on first use: the reference engine builds torch modules, the launcher is only
# needed inside engine processes.
_LAZY = {
    "ReferenceEngine": "corewire.engine.reference",
    "load_engine": "corewire.engine.launch",
    "run_engine_core": "corewire.engine.launch",
}

if TYPE_CHECKING:
    from corewire.engine.launch import load_engine, run_engine_core
    from corewire.engine.reference import ReferenceEngine


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'corewire.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
