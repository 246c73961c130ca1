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


@pytest.mark.parametrize("cls", [AsyncMPClient, SyncMPClient])
@pytest.mark.parametrize("host", ["0.0.0.0", "*", "192.0.2.1"])
def test_address_reachable_from_other_hosts_is_refused(cls: type, host: str) -> None:
    # The plain clients have no CURVE: binding a non-loopback address would let anyone who
    # reaches the port inject requests, so the bind is refused before anything starts.
    addresses = {"input_address": f"tcp://{host}:0", "output_address": f"tcp://{host}:0"}
    with no_leaks(), pytest.raises(ValueError, match="exposes engines to other hosts"):
        cls(client_addresses=addresses, ready_timeout=1.0)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_tcp_addresses_are_bound(host: str) -> None:
    addresses = {"input_address": f"tcp://{host}:0", "output_address": f"tcp://{host}:0"}
    # Nothing connects, so the bind succeeds and the ready wait is what fails.
    with no_leaks(), pytest.raises(TimeoutError, match="sent no ready message"):
        SyncMPClient(client_addresses=addresses, ready_timeout=0.5)
