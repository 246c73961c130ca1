"""Helpers for the tests that run vLLM's API server over corewire engines.

What they need, and why a test skips without it: vLLM itself, the project's CPU platform
plugin (``pip install ./tools/vllm-cpu-platform``; without it vLLM cannot pick a platform
on a GPU-less machine), engines that can join through vLLM's handshake, and, for the cases
with corewire's client inside vLLM, corewire's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx

from corewire.vllm.model_dir import write_model_dir
from corewire.vllm.stack import ServeStack, plugin_installed

MODEL = "corewire-tiny"
# The reference engine's defaults (vocab 4096, eos 2, pad 0); a shorter context keeps the
# long requests of the abort and kill tests bounded.
MAX_MODEL_LEN = 1024
# Every engine step sleeps this long: long requests stay in flight for seconds (abort and
# kill tests) while short greedy requests still take a fraction of a second.
STEP_DELAY = 0.01
# What corewire's plugin logs in the API server when it switches the client.
PLUGIN_LOG_LINE = "uses corewire's engine-core client"


def missing_prerequisite() -> str | None:
    """Why the serve tests cannot run here, or ``None`` when they can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if importlib.util.find_spec("tokenizers") is None:
        return "tokenizers is not installed"
    if not any(ep.name == "corewire_cpu" for ep in entry_points(group="vllm.platform_plugins")):
        return "the CPU platform plugin is missing: pip install ./tools/vllm-cpu-platform"
    if not engine_can_join():
        return "corewire engine has no --handshake-address"
    return None


def engine_can_join() -> bool:
    """Whether ``corewire engine`` accepts ``--handshake-address`` (vLLM's start-up handshake)."""
    from corewire.engine import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    _, unknown = parser.parse_known_args(["--handshake-address", "tcp://127.0.0.1:1"])
    return not unknown


def plugin_missing() -> str | None:
    """Why corewire's client cannot run inside vLLM here, or ``None`` when it can."""
    if importlib.util.find_spec("corewire.vllm.plugin") is None:
        return "corewire.vllm.plugin does not exist yet"
    if not plugin_installed():
        return "corewire's vllm.general_plugins entry point is not installed"
    return None


def engine_args(**overrides: Any) -> dict[str, Any]:
    """Reference engine arguments shared by the serve tests."""
    args: dict[str, Any] = {
        "max_model_len": MAX_MODEL_LEN,
        "step_delay": STEP_DELAY,
        "num_threads": 1,
    }
    args.update(overrides)
    return args


@contextlib.contextmanager
def running_stack(
    workdir: Path,
    *,
    client: str,
    engines: int = 1,
    engine_overrides: Mapping[str, Any] | None = None,
    server_env: Mapping[str, str] | None = None,
    api_servers: int = 1,
    timeout: float = 90.0,
) -> Iterator[ServeStack]:
    """A started stack with its model directory and logs under ``workdir``; stopped on exit."""
    model_dir = write_model_dir(workdir / "model", max_model_len=MAX_MODEL_LEN)
    stack = ServeStack(
        model_dir,
        port=0,
        engines=engines,
        client=client,  # type: ignore[arg-type]
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        engine_args=engine_args(**(engine_overrides or {})),
        log_dir=workdir / "logs",
        server_env=server_env,
        api_servers=api_servers,
    )
    stack.start(timeout=timeout)
    try:
        yield stack
    finally:
        stack.stop()


def server_log(stack: ServeStack) -> str:
    """The API server's output so far."""
    assert stack.log_dir is not None
    return (stack.log_dir / "api-server.log").read_text(errors="replace")


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of Prometheus metric ``name`` in ``text``: ``(labels, value)`` pairs."""
    samples = []
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", re.MULTILINE)
    for labels, value in pattern.findall(text):
        pairs = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        samples.append((pairs, float(value)))
    return samples


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``data: [DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")
