"""Shared fixtures: private ipc directories, leak checks after every test, and no
complaint from asyncio (a future's exception never retrieved, a task destroyed while
pending) anywhere in the run."""

from __future__ import annotations

import gc
import logging
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


class _AsyncioComplaints(logging.Handler):
    """Collects what asyncio logs at WARNING or above: each one is a bug (an exception
    nobody read, a task dropped unfinished, a callback that raised)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({record.exc_info[1]!r})"
        # Bounded: the text quotes the object's repr, which may be large.
        self.seen.append(text[:2000])


_ASYNCIO_COMPLAINTS = _AsyncioComplaints()
logging.getLogger("asyncio").addHandler(_ASYNCIO_COMPLAINTS)


@pytest.fixture(autouse=True)
def no_asyncio_complaints() -> Iterator[None]:
    """Fail a test during which asyncio logged a complaint (see :class:`_AsyncioComplaints`).

    asyncio logs "never retrieved" and "destroyed but it is pending" when the object is
    freed; without a cycle that is at once, else at a collection: the young generations
    are collected here (microseconds; a full collection costs half a second with vLLM
    imported), and :func:`pytest_sessionfinish` collects everything once at the end so
    that none goes unseen.
    """
    seen = _ASYNCIO_COMPLAINTS.seen
    start = len(seen)
    yield
    gc.collect(1)
    complaints = seen[start:]
    if complaints:
        pytest.fail("asyncio complained during this test:\n" + "\n".join(complaints))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Collect garbage once more; a complaint logged then fails the run."""
    before = len(_ASYNCIO_COMPLAINTS.seen)
    gc.collect()
    late = _ASYNCIO_COMPLAINTS.seen[before:]
    if late:
        print("\nasyncio complained after the last test:\n" + "\n".join(late))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
