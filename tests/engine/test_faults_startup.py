"""Engines that fail to start or never say they are ready: clear errors, no leftovers."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest

from client_support import CRASH_ON_START, NEVER_READY
from corewire import AsyncMPClient, SyncMPClient
from leak_support import no_leaks


@pytest.mark.parametrize("cls", [AsyncMPClient, SyncMPClient])
def test_engine_process_crashing_at_startup(cls: type) -> None:
    # The exception names the process's own error, not only its exit code.
    with (
        no_leaks(),
        pytest.raises(
            RuntimeError,
            match=r"corewire-engine-0 exited with code 1 before it was ready: "
            r"RuntimeError: engine failed to start \(on purpose\)$",
        ),
    ):
        cls(engine_main=CRASH_ON_START, ready_timeout=60)


def test_engine_class_failing_to_build() -> None:
    # The constructor raises in the engine process: only the process can tell, and does.
    with (
        no_leaks(grace=15),
        pytest.raises(
            RuntimeError,
            match=r"exited with code 1 before it was ready: "
            r"RuntimeError: engine constructor failed \(on purpose\)$",
        ),
    ):
        AsyncMPClient(engine="client_support:BrokenEngine", ready_timeout=120)


def test_misspelt_reference_engine_argument_names_the_engines_error() -> None:
    # The reference engine is not imported in the client (torch takes seconds), so its
    # constructor's own TypeError comes back from the engine process.
    with (
        no_leaks(grace=15),
        pytest.raises(
            RuntimeError,
            match=r"before it was ready: TypeError: .*unexpected keyword argument 'no_such_arg'",
        ),
    ):
        AsyncMPClient(engine_args={"no_such_arg": 1}, ready_timeout=120)


def _fails_before_any_process(cls: type[BaseException], match: str, **kwargs: Any) -> None:
    """The client raises ``cls`` at once, without starting (or waiting for) a process."""
    children_before = set(multiprocessing.active_children())
    start = time.monotonic()
    with no_leaks(), pytest.raises(cls, match=match):
        AsyncMPClient(ready_timeout=120, **kwargs)
    # Starting an engine process alone takes seconds (a spawned interpreter); failing
    # in the parent takes milliseconds.
    assert time.monotonic() - start < 2.0
    assert set(multiprocessing.active_children()) <= children_before


def test_unknown_engine_module_fails_in_the_parent() -> None:
    _fails_before_any_process(
        ModuleNotFoundError, "No module named 'no_such_module_xyz'", engine="no_such_module_xyz:E"
    )


def test_unknown_engine_class_fails_in_the_parent() -> None:
    _fails_before_any_process(
        AttributeError,
        "'client_support' has no attribute 'NoSuchEngine'",
        engine="client_support:NoSuchEngine",
    )


def test_a_class_that_is_no_engine_fails_in_the_parent() -> None:
    _fails_before_any_process(
        TypeError,
        r"'collections:OrderedDict' is not an Engine: .* \(it lacks add_request, abort_requests, "
        r"step, has_unfinished_requests\)",
        engine="collections:OrderedDict",
    )


def test_misspelt_engine_argument_fails_in_the_parent() -> None:
    _fails_before_any_process(
        TypeError,
        r"'client_support:FailingEngine' does not take these engine_args: "
        r".*unexpected keyword argument 'fail_afterr'",
        engine="client_support:FailingEngine",
        engine_args={"fail_afterr": 2},
    )


def test_malformed_engine_spec_fails_in_the_parent() -> None:
    _fails_before_any_process(ValueError, "engine must be 'module:Class'", engine="no_colon")


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
