"""Engines that fail to start or never say they are ready: clear errors, no leftovers."""

from __future__ import annotations

import time

import pytest

from client_support import CRASH_ON_START, NEVER_READY, no_leaks
from corewire import AsyncMPClient, SyncMPClient


@pytest.mark.parametrize("cls", [AsyncMPClient, SyncMPClient])
def test_engine_process_crashing_at_startup(cls: type) -> None:
    with (
        no_leaks(),
        pytest.raises(RuntimeError, match=r"corewire-engine-0 exited with code 1 before"),
    ):
        cls(engine_main=CRASH_ON_START, ready_timeout=60)


def test_engine_class_failing_to_build() -> None:
    with (
        no_leaks(grace=15),
        pytest.raises(RuntimeError, match="exited with code 1 before it was ready"),
    ):
        AsyncMPClient(engine="client_support:BrokenEngine", ready_timeout=120)


def test_unknown_engine_class() -> None:
    with no_leaks(grace=15), pytest.raises(RuntimeError, match="exited with code"):
        AsyncMPClient(engine="no_such_module_xyz:Engine", ready_timeout=120)


def test_ready_timeout_names_the_missing_engine() -> None:
    with no_leaks():
        start = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"engine\(s\) \[0\] sent no ready message within 1 s"
        ):
            SyncMPClient(engine_main=NEVER_READY, ready_timeout=1.0)
        assert time.monotonic() - start < 10  # the timeout, then terminating the process


def test_unknown_engine_main() -> None:
    with no_leaks(), pytest.raises(ModuleNotFoundError):
        AsyncMPClient(engine_main="no_such_module_xyz:main")
