"""Helpers for tests that put ``corewire engine`` processes behind vLLM 0.25.1's own
front-end classes (imported only by modules that skip without vllm).

- :func:`frontend_platform`: vLLM's front-end code needs a platform; on a machine
  without a GPU (and without the project's CPU platform plugin installed) it resolves to
  an unspecified one, so the tests set vLLM's CPU platform in this process only.
- :func:`vllm_config`: the smallest real ``VllmConfig`` built offline: a model directory
  with just a llama-style ``config.json`` and ``skip_tokenizer_init``.
- :class:`EngineProcs`: ``corewire engine`` command-line processes, their logs, and a
  clean stop (SIGTERM, then SIGKILL).
- :func:`reference_run`: the same requests through an in-process ``ReferenceEngine``,
  the expected tokens and logprobs of a run behind vLLM.
- :func:`vllm_request`: a request of vLLM's own type, as its input processor hands it
  to the engine-core client (corewire's type comes from ``client_support.request``).
- :func:`close_client`: vLLM's engine-core client shut down on its own loop, the loop
  closed.
- :func:`factory_after_plugins`: which client factory vLLM's plugin loader leaves in
  place (corewire's plugin switched on or off).
- :class:`HandEngine`, :func:`hand_output`: an engine written by hand (a thread's sockets,
  no process) that joins a vLLM client and sends exactly the frames a test gives it, in
  vLLM 0.25.1's layout (the client fault tests of ``test_vllm_client_faults.py`` and
  ``test_metrics.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from client_support import DEFAULT_SAMPLING, request
from corewire.engine.interface import EngineInfo
from corewire.engine.ready import ready_response
from corewire.engine.reference import ReferenceEngine

#: Engine arguments shared by the vLLM interop tests: a light CPU engine whose steps
#: take a few milliseconds (so that an abort lands mid-request).
ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "num_threads": 1,
    "max_model_len": 512,
    "step_delay": 0.004,
}
#: The front-end's own limit; the engine's smaller one must win.
FRONTEND_MAX_MODEL_LEN = 1024

_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def offline_environment() -> None:
    """No network for vLLM or Hugging Face in this process."""
    os.environ.update(_OFFLINE_ENV)


def frontend_platform() -> None:
    """Make vLLM's platform resolve in this process (its CPU platform where none
    would: the engines are corewire's, the front-end needs no device).
    :func:`vllm_config` does this first."""
    import vllm.platforms as platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()


def write_model_dir(path: Path, vocab_size: int = 4096) -> Path:
    """A model directory with only a tiny llama ``config.json`` (nothing downloaded)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def vllm_config(model_dir: Path, **parallel: Any) -> Any:
    """A real ``VllmConfig`` for the front-end side (a platform resolved first);
    ``parallel`` goes to ``ParallelConfig`` (data-parallel size, rpc port ...)."""
    frontend_platform()
    # Building the config imports torch modules that warn about their own deprecated
    # APIs (torch.jit); those are not this project's to fix.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.config import ModelConfig, ParallelConfig, VllmConfig

        model = ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=FRONTEND_MAX_MODEL_LEN,
            enforce_eager=True,
        )
        return VllmConfig(model_config=model, parallel_config=ParallelConfig(**parallel))


class EngineProcs:
    """``corewire engine`` processes started from the command line, with logs in
    ``log_dir``; :meth:`stop` ends them (SIGTERM, then SIGKILL) and returns their
    exit codes."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, engine_args: dict[str, Any] | None = None) -> subprocess.Popen:
        """Start ``corewire engine ARGS --engine-args JSON --parent-pid <this pid>``."""
        command = [
            sys.executable,
            "-m",
            "corewire.cli",
            "engine",
            *args,
            "--engine-args",
            json.dumps(ENGINE_ARGS if engine_args is None else engine_args),
            "--parent-pid",
            str(os.getpid()),
        ]
        log = open(self.log_dir / f"engine-{len(self.procs)}.log", "wb")  # noqa: SIM115
        env = {**os.environ, **_OFFLINE_ENV, "COREWIRE_LOG_LEVEL": "INFO"}
        try:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()  # the child holds its own copy
        self.procs.append(proc)
        return proc

    @property
    def pids(self) -> set[int]:
        """Process ids of the engines started so far."""
        return {p.pid for p in self.procs}

    def logs(self) -> str:
        """Every engine's log, for assertion messages."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.log")))

    def stop(self, timeout: float = 15.0) -> list[int | None]:
        """SIGTERM every engine, wait, SIGKILL what is left; the exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
                codes.append(None)
        return codes


def reference_run(
    requests: list[tuple[str, list[int], dict[str, Any]]],
    engine_args: dict[str, Any] | None = None,
) -> dict[str, tuple[list[int], list[np.ndarray]]]:
    """Run ``(request_id, prompt, sampling kwargs)`` requests through an in-process
    reference engine; per request, the tokens and each token's logprob rows."""
    args = {k: v for k, v in (ENGINE_ARGS if engine_args is None else engine_args).items()}
    args["step_delay"] = 0.0
    engine = ReferenceEngine(**args)
    for rid, prompt, sp in requests:
        engine.add_request(request(rid, prompt=prompt, sampling={**DEFAULT_SAMPLING, **sp}))
    result: dict[str, tuple[list[int], list[np.ndarray]]] = {r[0]: ([], []) for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = result[out.request_id]
            tokens.extend(out.new_token_ids)
            if out.new_logprobs is not None:
                logprobs.append(np.asarray(out.new_logprobs.logprobs))
    engine.shutdown()
    return result


def vllm_request(rid: str, prompt: list[int], **sp: Any) -> Any:
    """vLLM's ``EngineCoreRequest`` as its input processor hands it to the engine-core
    client; ``sp`` are vLLM ``SamplingParams`` fields (vLLM's defaults otherwise)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=SamplingParams(**sp),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def close_client(client: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Shut vLLM's async engine-core ``client`` (None: never built) down on ``loop``, its
    ZeroMQ context too, and close the loop."""
    if client is not None:
        client.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        # vLLM's client leaves its ZeroMQ context to the process exit.
        client.resources.ctx.destroy(linger=0)
    loop.close()


# Loads the plugins the way vLLM's processes do ({loads} times: vLLM calls it more than
# once per process), then reports which factory AsyncLLM would call.
_PLUGIN_PROBE = """
from vllm.plugins import load_general_plugins
for _ in range({loads}):
    load_general_plugins()
from vllm.v1.engine.core_client import EngineCoreClient
factory = EngineCoreClient.make_async_mp_client
import sys
kept = getattr(sys.modules.get("corewire.vllm.adapters.classes"), "vllm_factory", None)
if kept is not None:
    print("kept " + kept.__module__ + "." + kept.__qualname__)
print(factory.__module__ + "." + factory.__qualname__)
"""


def factory_after_plugins(switch: str | None, loads: int = 1) -> str:
    """The qualified name of vLLM's client factory in a fresh interpreter after vLLM's
    plugin loader ran ``loads`` times, corewire's plugin switch set to ``switch`` (None:
    unset); the plugin patches a vLLM class for the whole process, hence the process."""
    from corewire.vllm.plugin import ENV_SWITCH

    env = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
    if switch is not None:
        env[ENV_SWITCH] = switch
    done = subprocess.run(
        [sys.executable, "-c", _PLUGIN_PROBE.format(loads=loads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def factory_kept_by_plugin() -> str | None:
    """The qualified name of the factory corewire's plugin kept for the servers it
    declines (``corewire.vllm.adapters.classes.vllm_factory``), in a fresh interpreter with the
    switch on; None when it kept none."""
    from corewire.vllm.plugin import ENV_SWITCH

    done = subprocess.run(
        [sys.executable, "-c", _PLUGIN_PROBE.format(loads=2)],
        env={**os.environ, ENV_SWITCH: "1"},
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    kept = [line for line in done.stdout.splitlines() if line.startswith("kept ")]
    return kept[-1][len("kept ") :] if kept else None


def require_vllm_0_25_1() -> None:
    """Skip the calling module (at module level) unless the installed vLLM is 0.25.1.

    For the modules that hold corewire to vLLM 0.25.1's wire itself (its structs
    compared with corewire's, frames written by hand in its layout): under another
    release the installed vLLM's encoder writes that release's layout. Every other
    release's wire is held to frames recorded from it (``tests/releases/test_releases.py``) and,
    for the releases with a live venv, to its own encoder (``test_vllm_0_33_0_live.py``).
    """
    import pytest

    vllm = pytest.importorskip("vllm")
    if vllm.__version__.split("+")[0] != "0.25.1":
        pytest.skip(
            f"holds corewire to vLLM 0.25.1's wire (found {vllm.__version__})",
            allow_module_level=True,
        )


class HandEngine:
    """Connects to a client, sends its ready map, then sends the frames it is given."""

    def __init__(self, input_address: str, output_address: str) -> None:
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.DEALER)
        # Engine 0's identity, written by hand like every frame here (docs/protocol.md §2).
        self.requests.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self.requests.connect(input_address)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(output_address)
        ready = ready_response(EngineInfo(max_model_len=512), engine_index=0)
        self.requests.send(msgspec.msgpack.encode(ready))

    def push(self, payload: object) -> None:
        self.outputs.send(msgspec.msgpack.encode(payload))

    def close(self) -> None:
        self.requests.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()


def hand_output(request_id: str, tokens: list[int], finish: int | None = None) -> list:
    """One ``EngineCoreOutput`` as vLLM 0.25.1's array, for :class:`HandEngine` to send."""
    return [request_id, tokens, None, None, None, finish, None, None, None, None, None, None, 0]
