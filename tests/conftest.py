"""Shared fixtures: private ipc directories and leak checks after every test."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from zmq.utils.garbage import GarbageCollectorThread

# Helper processes that Python's multiprocessing keeps for the whole session by design
# (pyzmq's zero-copy garbage-collector thread is the same kind of helper: one per process,
# started by the first zero-copy send).
_SESSION_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")
_LEAK_GRACE_S = 5.0


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A fresh private (0700) directory for this test's ``ipc://`` endpoints."""
    with tempfile.TemporaryDirectory(prefix="corewire-test-") as path:
        os.chmod(path, 0o700)
        yield Path(path)


def _stray_children() -> list[psutil.Process]:
    strays = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if not any(helper in cmdline for helper in _SESSION_HELPERS):
            strays.append(child)
    return strays


def _stray_threads(before: set[int]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.is_alive() and not isinstance(t, GarbageCollectorThread)
    ]


@pytest.fixture(autouse=True)
def no_leaked_processes_or_threads() -> Iterator[None]:
    """Fail a test that leaves a child process or a thread of its own running."""
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + _LEAK_GRACE_S
    while time.monotonic() < deadline:
        if not _stray_children() and not _stray_threads(threads_before):
            return
        time.sleep(0.05)
    children = _stray_children()
    threads = _stray_threads(threads_before)
    leaks = [f"process {c.pid} {_describe(c)}" for c in children]
    leaks += [f"thread {t.name!r}" for t in threads]
    for child in children:  # do not let one leak poison the tests after it
        child.kill()
    psutil.wait_procs(children, timeout=5)
    if leaks:
        pytest.fail("test leaked " + ", ".join(leaks), pytrace=False)


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:4])
    except psutil.Error:
        return "(gone)"
