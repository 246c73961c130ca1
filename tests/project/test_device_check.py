"""``tools/device_check.py``, the checks ``scripts/device-check`` runs on a GPU machine: run
here on the CPU so that they keep working between the sessions lent a GPU, and on CUDA
wherever this suite finds one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from paths_support import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "device_check.py"
#: Each run starts several engine processes (each imports torch): minutes on a busy machine.
pytestmark = pytest.mark.timeout(660)
CHECKS = ("check_generation", "check_pooling", "check_codec", "check_data_parallel")


def _run(device: str) -> tuple[int, list[str]]:
    """The tool's exit status and its lines about checks (and about the device)."""
    done = subprocess.run(
        [sys.executable, str(TOOL), "--device", device],
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = done.stdout.splitlines()
    return done.returncode, [line for line in said if " check_" in line or "device" in line]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ),
    ],
)
def test_every_device_check_passes(device: str) -> None:
    status, lines = _run(device)
    checks = [line.split()[:2] for line in lines if " check_" in line]
    assert checks == [["PASS", c] for c in CHECKS], lines
    assert status == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_asking_for_cuda_without_one_fails_with_a_reason() -> None:
    status, lines = _run("cuda")
    assert status == 1
    assert lines == ["FAIL no CUDA device here (torch.cuda.is_available() is False)"]
