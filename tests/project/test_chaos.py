"""The chaos run (``tools/chaos``): a short one in a fresh interpreter, as a developer runs it.

Real engine processes are killed, stopped and replaced, real malformed frames are sent;
the run must end every request (completed or with a typed error), leave nothing behind,
and have injected every kind of fault (so that it cannot pass without chaos).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corewire import cli
from corewire_devtools import chaos
from corewire_devtools.chaos import FAULTS
from paths_support import REPO_ROOT


def run_chaos(*argv: str, json_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``tools/chaos ARGV --json json_path`` in a fresh interpreter (this one's python)."""
    path = os.environ.get("PATH", "")
    return subprocess.run(
        [str(REPO_ROOT / "tools" / "chaos"), *argv, "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{path}"),
    )


@pytest.mark.timeout(300)
def test_short_chaos_run_hangs_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    done = run_chaos(
        "--seconds", "3", "--engines", "2", "--rate", "50", "--fault-interval", "0.3",
        "--seed", "7", json_path=out, timeout=280,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "result: PASS" in done.stdout, report
    (figures,) = json.loads(out.read_text())["cases"]
    # Every kind of fault really happened, and did what it does.
    assert all(figures["faults"][kind] > 0 for kind in FAULTS), figures["faults"]
    assert figures["deaths"] >= 2  # kill and stop_hang, each ended a group
    assert figures["groups_started"] == figures["deaths"] + 1
    assert figures["cancelled"] > 0
    assert figures["failed"].get("EngineDeadError", 0) > 0 or figures["deaths"]
    assert figures["failed"].get("ProtocolError", 0) > 0  # the rogue frame naming a request
    assert figures["refused"] > 0  # the truncated ADD, finished with ERROR by its engine
    # The rogue frames were counted by the client they reached (all of them unless its
    # group died first), and only they: the engines sent none.
    assert 0 < figures["protocol_errors"] <= figures["rogue_output_frames"]
    assert figures["bad_input_frames"] > 0
    assert figures["completed"] > 0
    # Nothing hung, nothing leaked, every request accounted for.
    assert figures["hung"] == 0 and figures["hung_operations"] == []
    leaks = figures["leaks"]
    for kind in ("fds", "threads", "processes", "zombies", "ipc_dirs"):
        assert not leaks[kind], (kind, leaks[kind])
    assert figures["in_flight_left"] == 0
    ended = (
        figures["completed"]
        + figures["aborted"]
        + figures["refused"]
        + figures["cancelled"]
        + sum(figures["failed"].values())
    )
    assert ended == figures["sent"]


def chaos_args(*argv: str) -> argparse.Namespace:
    """The chaos run's flags parsed as ``tools/chaos`` parses them."""
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_chaos_flags_and_defaults() -> None:
    args = chaos_args("--seconds", "5", "--engines", "2")
    assert (args.seconds, args.engines) == (5.0, 2)
    assert args.engine == "synthetic" and args.deadline > args.health_timeout


def test_chaos_is_not_in_the_wheel_or_its_bench_command() -> None:
    # Developer tooling: the installed package has neither the run nor its leak probe.
    import corewire.bench

    assert "chaos" not in corewire.bench.BENCHES
    for gone in ("corewire.bench.chaos", "corewire.bench.leaks"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    with pytest.raises(SystemExit):
        cli.build_parser("bench").parse_args(["bench", "chaos"])


@pytest.mark.parametrize(
    "spoil",
    [
        lambda f, leaks: setattr(f, "hung", 1),
        lambda f, leaks: f.hung_operations.append("scale_elastic_ep(1) hung"),
        lambda f, leaks: leaks.threads.append("corewire-stray"),
        lambda f, leaks: leaks.processes.append(12345),
        lambda f, leaks: leaks.ipc_dirs.append("/tmp/corewire-ipc-1-x"),
        lambda f, leaks: setattr(leaks, "memory_growth", 65 * 2**20),
        lambda f, leaks: setattr(f, "in_flight_left", 3),
    ],
)
def test_anything_hung_or_leaked_fails_the_run(spoil, capsys: pytest.CaptureFixture[str]) -> None:
    from corewire_devtools.chaos import Figures, report
    from corewire_devtools.leaks import Leaks

    args = chaos_args()
    figures, leaks = Figures(sent=2, completed=2), Leaks()
    assert report(args, figures, leaks, 1.0)
    spoil(figures, leaks)
    assert not report(args, figures, leaks, 1.0)
    assert capsys.readouterr().out.rstrip().endswith("result: FAIL")
