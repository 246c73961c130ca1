"""corewire's engine-core client outside vLLM's server, over vLLM's real engine core.

No HTTP and no ``AsyncLLM``: a ``VllmConfig`` from vLLM's own ``AsyncEngineArgs``, the
engine core launched by vLLM's launcher through the client factory, and the engine-core
client API itself (requests with logprobs, seeds and stop token ids, an abort, utility
calls). :mod:`real_engine_client_probe` runs the same script once with vLLM's
``AsyncMPClient`` and once with corewire's, each in a process of its own (vLLM spawns its
engine from a plain ``__main__``); everything both saw must be the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paths_support import TESTS_DIR
from real_engine_support import require_cpu_build, server_env, write_real_model

require_cpu_build()

from serve_support import first_difference  # noqa: E402

PROBE = TESTS_DIR / "real_engine_client_probe.py"

pytestmark = pytest.mark.timeout(600)


def _probe(model_dir: Path, client: str, cwd: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(PROBE), str(model_dir), client],
        env=server_env("vllm"),  # the switch off: each script names its client itself
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(results[-1][len("RESULT ") :])


def test_corewires_client_sees_what_vllms_sees(tmp_path: Path) -> None:
    model = write_real_model(tmp_path / "model")
    seen = {client: _probe(model, client, tmp_path) for client in ("vllm", "corewire")}
    assert seen["corewire"]["client"].startswith("corewire."), seen["corewire"]["client"]
    assert seen["vllm"]["client"].startswith("vllm."), seen["vllm"]["client"]
    mine, theirs = (
        {k: v for k, v in seen[c].items() if k != "client"} for c in ("corewire", "vllm")
    )
    assert mine == theirs, first_difference(mine, theirs)
    requests = theirs["requests"]
    # Not vacuous: the model answered, logprobs came, the stop id and the abort worked.
    assert len(requests["greedy"]["tokens"]) == 10 and len(requests["greedy"]["logprobs"]) == 10
    assert requests["stop-id"]["tokens"][-1] == 79 and len(requests["stop-id"]["tokens"]) == 4
    assert requests["aborted"]["stopped_early"]
    assert theirs["utilities"]["supported_tasks"] == ["generate"]
