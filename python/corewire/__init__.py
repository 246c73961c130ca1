"""corewire: a fast engine-core IPC client for LLM serving front-ends.

Requests go to engine-core processes over ZeroMQ, outputs come back decoded by a Rust
decoder (zero-copy tensors), utility calls resolve futures by call id, and the death of
an engine reaches every waiting caller. The wire format is vLLM's engine-core protocol,
byte for byte, in every release from 0.25.1 to 0.34.0 (:mod:`corewire.releases`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from corewire.errors import (
    EngineDeadError,
    EngineLostError,
    InputBacklogTimeout,
    ProtocolError,
    UtilityError,
)

# The version is written once, in Cargo.toml; maturin writes it into the installed
# distribution's metadata, and __getattr__ reads it from there on first use.
__version__: str

# Public name -> module that defines it. Imported on first use so that `import corewire`
# stays cheap (no zmq or torch) for users who only want the codec.
_LAZY = {
    "Encoder": "corewire.codec",
    "MsgspecDecoder": "corewire.codec",
    "NativeDecoder": "corewire.codec",
    "MPClient": "corewire.client",
    "SyncMPClient": "corewire.client",
    "AsyncMPClient": "corewire.client",
    "DPAsyncMPClient": "corewire.client",
    "DPLBAsyncMPClient": "corewire.client",
    "Engine": "corewire.engine",
    "EngineCoreProc": "corewire.engine",
    "EngineInfo": "corewire.engine",
    "RayPlacement": "corewire.client.ray_engines",
}

__all__ = [
    "AsyncMPClient",
    "DPAsyncMPClient",
    "DPLBAsyncMPClient",
    "Encoder",
    "Engine",
    "EngineCoreProc",
    "EngineDeadError",
    "EngineInfo",
    "EngineLostError",
    "InputBacklogTimeout",
    "MPClient",
    "MsgspecDecoder",
    "NativeDecoder",
    "ProtocolError",
    "RayPlacement",
    "SyncMPClient",
    "UtilityError",
    "__version__",
]

if TYPE_CHECKING:
    from corewire.client import (
        AsyncMPClient,
        DPAsyncMPClient,
        DPLBAsyncMPClient,
        MPClient,
        SyncMPClient,
    )
    from corewire.client.ray_engines import RayPlacement
    from corewire.codec import Encoder, MsgspecDecoder, NativeDecoder
    from corewire.engine import Engine, EngineCoreProc, EngineInfo


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        globals()[name] = value = version("corewire")
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'corewire' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
