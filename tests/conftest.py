"""Shared fixtures: private ipc directories and leak checks after every test."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from leak_support import no_leaks


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A fresh private (0700) directory for this test's ``ipc://`` endpoints."""
    with tempfile.TemporaryDirectory(prefix="corewire-test-") as path:
        os.chmod(path, 0o700)
        yield Path(path)


@pytest.fixture(autouse=True)
def no_leaked_processes_or_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a child process or a thread of its own running.

    A module whose processes outlive single tests on purpose (an engine shared by the
    module) names them in a module-level ``LEAK_ALLOWED_PIDS``: a set it keeps up to date,
    or a function returning one, asked at the end of each test. Their own clean exit is
    that module's to check.
    """
    allowed = getattr(request.module, "LEAK_ALLOWED_PIDS", ())
    with no_leaks(fds=False, allowed=allowed):
        yield
