"""The suite's one leak checker and one pid waiter (on the probe of
:mod:`corewire_devtools.leaks`, which the chaos run uses too).

:func:`no_leaks` runs after every test (``conftest.py``) and around the client and fault
tests' bodies; a module that shares an engine across its tests passes that engine's pid as
``allowed``. :func:`wait_pid_gone` is how a test waits for a process to exit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import psutil

from corewire_devtools.leaks import open_fds, stray_children, warm_up_pyzmq_zero_copy

# Made before any test runs, so that no test sees pyzmq's helper appear as a leak.
warm_up_pyzmq_zero_copy()


def pid_gone(pid: int, reaped: bool = False) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaped yet counts as gone, unless
    ``reaped``: then its parent must have collected it too)."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return True
    return not reaped and status == psutil.STATUS_ZOMBIE


def wait_pid_gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` exits (or turns zombie) within ``timeout`` seconds; looks
    once more at the deadline, so a timeout of 0 is a plain check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return pid_gone(pid)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} " + " ".join(proc.cmdline()[:4])
    except psutil.Error:
        return f"{proc.pid} (gone)"


@contextlib.contextmanager
def no_leaks(
    grace: float = 5.0,
    allowed: Iterable[int] | Callable[[], Iterable[int]] = (),
    fds: bool = True,
) -> Iterator[None]:
    """Fail unless, within ``grace`` seconds of the end, no thread or file descriptor made
    inside is left and no child process runs but multiprocessing's session helpers and
    the ``allowed`` pids (a callable is asked at the end, for a set that changes).

    ``fds=False`` leaves descriptors out: the check after every test does, because vLLM's
    own front-end classes in the interop tests keep some past a test (two pipes after
    the DP-coordinator handshake test); the client and fault tests check them.
    Leaked processes are killed before failing, so that one leak does not fail the tests
    after it too. An exception from the body passes through unchecked.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # a session-wide helper: not a leak
    fds_before = open_fds() if fds else {}
    threads_before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + grace
    while True:
        keep = set(allowed() if callable(allowed) else allowed)
        children = stray_children(keep)
        threads = [t for t in threading.enumerate() if t not in threads_before]
        new_fds = (
            {fd: target for fd, target in open_fds().items() if fd not in fds_before} if fds else {}
        )
        if not (children or threads or new_fds):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    leaks = [_describe(c) for c in children]
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=5)
    raise AssertionError(
        f"leaked processes {leaks}, threads {[t.name for t in threads]}, fds {new_fds}"
    )


__all__ = ["no_leaks", "pid_gone", "wait_pid_gone"]
