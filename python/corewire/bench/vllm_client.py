"""vLLM's own ``AsyncMPClient`` over an engine process a benchmark starts: the baseline
the client benchmark (``corewire bench client``) and its request flood
(:mod:`corewire.bench.flood`) measure corewire's client against."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["VllmClient", "private_dir"]


def private_dir() -> tempfile.TemporaryDirectory[str]:
    """A temporary directory only this user can enter (the benchmark's ipc endpoints)."""
    tmp = tempfile.TemporaryDirectory(prefix="corewire-bench-")
    os.chmod(tmp.name, 0o700)
    return tmp


class VllmClient:
    """The installed vLLM's own ``AsyncMPClient`` over a bench engine process speaking
    ``release`` (the installed vLLM's): built with ``client_addresses`` (as vLLM's API
    server builds it for engines it does not launch) from a real ``VllmConfig`` of a tiny
    local model directory. Create it inside the running loop (its output task belongs to
    that loop). ``start_engine(input_address, output_address, protocol)`` starts the engine
    process it drives (the client benchmark's replay engine, the flood's corewire engine).

    The same positional call builds 0.25.1's and 0.33.0's client: 0.33.0 added only
    keywords with defaults (``renderer=None``: no multimodal warm-up to start)."""

    def __init__(self, release: str, start_engine: Callable[[str, str, str], Any]) -> None:
        # vLLM reads these at import: no network, no usage reports.
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
            os.environ.setdefault(key, "1")
        import vllm.platforms as platforms
        from vllm.config import ModelConfig, VllmConfig
        from vllm.v1.engine.core_client import AsyncMPClient as VllmAsyncMPClient
        from vllm.v1.executor.abstract import Executor

        from corewire.vllm.serve.model_dir import write_model_dir

        if platforms.current_platform.is_unspecified():
            # No GPU here: vLLM's CPU platform for the front-end (the engine is ours).
            from vllm.platforms.cpu import CpuPlatform

            platforms.current_platform = CpuPlatform()
        self.tmp = private_dir()
        addresses = {
            "input_address": f"ipc://{self.tmp.name}/in",
            "output_address": f"ipc://{self.tmp.name}/out",
        }
        self.proc = start_engine(addresses["input_address"], addresses["output_address"], release)
        model = ModelConfig(
            model=str(write_model_dir(os.path.join(self.tmp.name, "model"))),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=2048,
            enforce_eager=True,
        )
        config = VllmConfig(model_config=model)
        self.client = VllmAsyncMPClient(config, Executor, False, client_addresses=addresses)
        self.get_output_async = self.client.get_output_async
        self.call_utility_async = self.client.call_utility_async

    def shutdown(self) -> None:
        self.client.shutdown()
        # vLLM's client leaves its ZeroMQ context to the process exit.
        self.client.resources.ctx.destroy(linger=0)
        self.proc.terminate()
        self.proc.join(10)
        self.proc.close()
        self.tmp.cleanup()
