"""``corewire bench serve --engine vllm``: the serve benchmark's stacks over vLLM's real
engine core (its CPU build), run as a user runs it.

Each stack is ``vllm serve`` on the tiny llama with random weights the benchmark writes,
vLLM's own engine core under it; the load is a handful of short streams, so that the run
takes a couple of minutes. What is checked: every stack answered every request with all
its tokens, the front-end's CPU was measured, the JSON names the engine, and a stack the
installed release cannot run (native output processing under 0.32.0) is refused by name
before anything starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 16
STREAMS = 4


def _bench(*argv: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    # In a fresh interpreter, as `corewire bench serve ...` runs.
    code = textwrap.dedent(
        f"""
        import sys
        from corewire.cli import main
        sys.exit(main(["bench", "serve", *{list(argv)!r}]))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1"),
    )


def test_stacks_over_vllms_own_engine(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    proc = _bench(
        "--engine", "vllm", "--clients", "vllm,corewire", "--streams", str(STREAMS),
        "--logprobs", "0", "--max-tokens", str(MAX_TOKENS), "--quick", "--no-profile",
        "--json", str(out),
        cwd=tmp_path, timeout=800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "vLLM's engine (a tiny llama" in proc.stdout
    # The synthetic engine's paced scenario has no meaning over a real engine.
    assert "--engine vllm: no one-token-per-chunk scenario" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["options"]["engine"] == "vllm" and doc["goals"] == []
    assert doc["options"]["step_delay"] == 0 and doc["options"]["chunk_streams"] == 0
    cases = {case["client"]: case for case in doc["cases"]}
    assert set(cases) == {"vllm", "corewire"}
    for client, case in cases.items():
        # --quick: one request per stream, at least 32 in all; every token of each.
        assert case["errors"] == 0 and case["requests"] >= 32, (client, case)
        assert case["tokens"] == MAX_TOKENS * case["requests"], (client, case)
        assert case["api_server_cpu_s"] > 0 and case["tokens_per_api_server_cpu_s"] > 0
    assert cases["corewire"]["vs_vllm"]["tokens_per_api_server_cpu_s"] > 0


def test_a_stack_the_release_cannot_run_is_refused_first(tmp_path: Path) -> None:
    proc = _bench(
        "--engine", "vllm", "--clients", "vllm,corewire+output", cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--clients corewire+output: corewire's native output processing runs under" in (
        proc.stderr
    )
    assert "vllm serve" not in proc.stdout
