"""What a process holds that a finished run must have given back: the one leak probe of
the project, shared by the chaos run (:mod:`corewire_devtools.chaos`) and the test suite's leak
checks.

:func:`snapshot` records the open file descriptors, the Python threads, the live and
unreaped child processes, the private ``ipc://`` directories this process made
(:mod:`corewire.ipcdir`) and the resident memory; :func:`leaked` compares two. Needs
psutil (the ``bench`` and ``test`` extras).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq

from corewire._optional import import_optional

__all__ = [
    "Leaks",
    "Snapshot",
    "leaked",
    "open_fds",
    "snapshot",
    "stray_children",
    "warm_up_pyzmq_zero_copy",
]

#: Helper processes that Python's multiprocessing keeps for the whole session by design.
SESSION_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")


def _psutil():
    return import_optional("psutil", "the leak probe")


def warm_up_pyzmq_zero_copy() -> None:
    """Make pyzmq's process-wide helper for zero-copy sends now.

    pyzmq frees zero-copy frames through one helper thread, with its own context and
    socket, made on the first zero-copy send and kept for the process's life: made before
    a first snapshot, it is not seen as a leak."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://corewire-warm-up")
    b.connect("inproc://corewire-warm-up")
    tracker = a.send(bytearray(1 << 17), copy=False, track=True)
    b.recv(copy=False)
    tracker.wait(10)
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def stray_children(allowed: Iterable[int] = ()) -> list:
    """Live child processes of this process (at any depth), except multiprocessing's
    session helpers and the ``allowed`` pids (psutil ``Process`` objects)."""
    psutil = _psutil()
    allowed = set(allowed)
    strays = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in allowed or child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if not any(helper in cmdline for helper in SESSION_HELPERS):
            strays.append(child)
    return strays


def _zombies() -> list[int]:
    """Direct children that exited and that nobody reaped."""
    psutil = _psutil()
    out = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.status() == psutil.STATUS_ZOMBIE:
                out.append(child.pid)
    return out


def open_fds() -> dict[str, str]:
    """This process's open file descriptors: number -> what it points to."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def _ipc_dirs() -> set[str]:
    """The private directories this process made (``corewire-ipc-<pid>-...``)."""
    mine = re.compile(rf"^corewire-(?:ipc|dp)-{os.getpid()}-")
    parent = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        return {e.path for e in os.scandir(parent) if mine.match(e.name)}
    return set()


@dataclass
class Snapshot:
    """What the process held at one moment (see :func:`snapshot`)."""

    fds: dict[str, str]
    threads: set[threading.Thread]
    children: set[int]
    zombies: set[int]
    ipc_dirs: set[str]
    rss: int


def snapshot() -> Snapshot:
    """The process's descriptors, threads, children, ipc directories and memory now."""
    psutil = _psutil()
    return Snapshot(
        fds=open_fds(),
        threads=set(threading.enumerate()),
        children={p.pid for p in stray_children()},
        zombies=set(_zombies()),
        ipc_dirs=_ipc_dirs(),
        rss=psutil.Process().memory_info().rss,
    )


@dataclass
class Leaks:
    """What ``after`` holds that ``before`` did not (memory: the growth in bytes)."""

    fds: dict[str, str] = field(default_factory=dict)
    threads: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    zombies: list[int] = field(default_factory=list)
    ipc_dirs: list[str] = field(default_factory=list)
    memory_growth: int = 0

    def any_held(self) -> bool:
        """Whether any resource (memory aside) was left behind."""
        return bool(self.fds or self.threads or self.processes or self.zombies or self.ipc_dirs)


def leaked(before: Snapshot, after: Snapshot) -> Leaks:
    """What was made between ``before`` and ``after`` and is still held at ``after``."""
    return Leaks(
        fds={fd: target for fd, target in after.fds.items() if fd not in before.fds},
        threads=sorted(t.name for t in after.threads - before.threads),
        processes=sorted(after.children - before.children),
        zombies=sorted(after.zombies - before.zombies),
        ipc_dirs=sorted(after.ipc_dirs - before.ipc_dirs),
        memory_growth=after.rss - before.rss,
    )
