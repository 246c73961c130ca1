"""The benchmark's side of :mod:`corewire.bench.gc_probe`: inject it, ask it, read it.

:func:`probe_env` writes the probe as ``sitecustomize.py`` into a directory and returns the
environment that makes a child Python process load it; :func:`snapshot` asks such a
process for its collector totals so far; two snapshots subtract into the collections and
collector seconds of the window between them.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from corewire.bench.gc_probe import ENV, GENERATIONS

__all__ = ["ENV", "GcProbeError", "GcTimes", "probe_env", "read", "snapshot"]

# A Unix socket path is at most 107 bytes on Linux.
_MAX_SOCKET_PATH = 100


class GcProbeError(RuntimeError):
    """The probe did not answer, or its file is not what it writes."""


@dataclass(frozen=True)
class GcTimes:
    """Collector totals per generation (index 0, 1, 2), in CPU and wall seconds."""

    collections: tuple[int, ...]
    cpu_s: tuple[float, ...]
    wall_s: tuple[float, ...]
    collected: tuple[int, ...]

    @property
    def total_cpu_s(self) -> float:
        """CPU seconds in collections of every generation."""
        return sum(self.cpu_s)

    def __add__(self, other: GcTimes) -> GcTimes:
        def plus(a: tuple, b: tuple) -> tuple:
            return tuple(x + y for x, y in zip(a, b, strict=True))

        return GcTimes(
            collections=plus(self.collections, other.collections),
            cpu_s=plus(self.cpu_s, other.cpu_s),
            wall_s=plus(self.wall_s, other.wall_s),
            collected=plus(self.collected, other.collected),
        )

    def __sub__(self, other: GcTimes) -> GcTimes:
        def minus(a: tuple, b: tuple) -> tuple:
            return tuple(x - y for x, y in zip(a, b, strict=True))

        return GcTimes(
            collections=minus(self.collections, other.collections),
            cpu_s=minus(self.cpu_s, other.cpu_s),
            wall_s=minus(self.wall_s, other.wall_s),
            collected=minus(self.collected, other.collected),
        )

    def as_dict(self) -> dict[str, Any]:
        """The totals as the benchmark's JSON results hold them."""
        return {
            "cpu_s": self.total_cpu_s,
            "wall_s": sum(self.wall_s),
            "collections": list(self.collections),
            "cpu_s_by_generation": list(self.cpu_s),
            "collected": list(self.collected),
        }


def probe_env(directory: Path, base_pythonpath: str | None = None) -> dict[str, str]:
    """Write the probe into ``directory`` (created private) and return the variables that
    make a Python process started with them load it: ``PYTHONPATH`` with ``directory``
    first, then ``base_pythonpath`` (default: this process's), and the probe's switch."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if len(str(directory / "gc-4194304.sock")) > _MAX_SOCKET_PATH:
        raise GcProbeError(f"{directory}: too long a path for the probe's Unix socket")
    source = resources.files("corewire.bench").joinpath("gc_probe.py").read_text("utf-8")
    (directory / "sitecustomize.py").write_text(source, encoding="utf-8")
    if base_pythonpath is None:
        base_pythonpath = os.environ.get("PYTHONPATH", "")
    pythonpath = os.pathsep.join(p for p in (str(directory), base_pythonpath) if p)
    return {"PYTHONPATH": pythonpath, ENV: str(directory)}


def read(path: Path) -> GcTimes:
    """The totals in one of the probe's JSON files."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        fields = {
            name: tuple(doc[name]) for name in ("collections", "cpu_s", "wall_s", "collected")
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GcProbeError(f"{path}: not a gc probe file ({exc})") from exc
    if any(len(v) != GENERATIONS for v in fields.values()):
        raise GcProbeError(f"{path}: expected {GENERATIONS} generations")
    return GcTimes(**fields)


def snapshot(directory: Path, pid: int, timeout: float = 10.0) -> GcTimes:
    """Ask the probe in process ``pid`` to write its totals so far, and read them."""
    sock_path = directory / f"gc-{pid}.sock"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(sock_path))
            sock.sendall(b"snapshot\n")
            reply = sock.recv(16)
    except OSError as exc:
        raise GcProbeError(f"the gc probe of process {pid} did not answer: {exc}") from exc
    if reply != b"ok\n":
        raise GcProbeError(f"the gc probe of process {pid} answered {reply!r}")
    return read(directory / f"gc-{pid}.json")
