"""``corewire bench chaos``: a short run in a fresh interpreter, as a user runs it.

Real engine processes are killed, stopped and replaced, real malformed frames are sent;
the run must end every request (completed or with a typed error), leave nothing behind,
and have injected every kind of fault (so that it cannot pass without chaos).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corewire import cli
from corewire.bench.chaos import FAULTS


def run_chaos(*argv: str, json_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``corewire bench chaos ARGV --json json_path`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "corewire.cli", "bench", "chaos", *argv, "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
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


def test_chaos_is_a_bench_subcommand() -> None:
    parser = cli.build_parser("bench")
    args = parser.parse_args(["bench", "chaos", "--seconds", "5", "--engines", "2"])
    assert (args.bench, args.seconds, args.engines) == ("chaos", 5.0, 2)
    assert args.engine == "synthetic" and args.deadline > args.health_timeout


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
    from corewire.bench.chaos import Figures, report
    from corewire.bench.leaks import Leaks

    args = cli.build_parser("bench").parse_args(["bench", "chaos"])
    figures, leaks = Figures(sent=2, completed=2), Leaks()
    assert report(args, figures, leaks, 1.0)
    spoil(figures, leaks)
    assert not report(args, figures, leaks, 1.0)
    assert capsys.readouterr().out.rstrip().endswith("result: FAIL")
