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
from corewire_devtools.chaos_losses import LossRecord, Timeline, summarize
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


def _ended(figures: dict) -> int:
    return (
        figures["completed"]
        + figures["aborted"]
        + figures["refused"]
        + figures["cancelled"]
        + figures["lost"]
        + sum(figures["failed"].values())
    )


def _common_checks(figures: dict) -> None:
    """What every policy's run must show: each fault happened and did what it does,
    nothing hung or leaked, every request accounted for."""
    assert all(figures["faults"][kind] > 0 for kind in FAULTS), figures["faults"]
    assert figures["cancelled"] > 0
    assert figures["failed"].get("ProtocolError", 0) > 0  # the rogue frame naming a request
    assert figures["refused"] > 0  # the truncated ADD, finished with ERROR by its engine
    # The rogue frames were counted by the client they reached (all of them unless its
    # group died first), and only they: the engines sent none.
    assert 0 < figures["protocol_errors"] <= figures["rogue_output_frames"]
    assert figures["bad_input_frames"] > 0
    assert figures["completed"] > 0
    assert figures["hung"] == 0 and figures["hung_operations"] == []
    leaks = figures["leaks"]
    for kind in ("fds", "threads", "processes", "zombies", "ipc_dirs"):
        assert not leaks[kind], (kind, leaks[kind])
    assert figures["in_flight_left"] == 0
    assert _ended(figures) == figures["sent"]
    # Every kill and every stop found hung is a loss the client saw.
    kinds = [loss["kind"] for loss in figures["losses"]]
    assert kinds.count("kill") >= 1 and kinds.count("stop_hang") >= 1
    assert all(loss["seen_s"] is not None for loss in figures["losses"])
    assert figures["groups_started"] == figures["deaths"] + 1


@pytest.mark.timeout(400)
def test_short_chaos_run_under_replace_then_fail(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    done = run_chaos(
        "--seconds", "3", "--engines", "3", "--rate", "50", "--fault-interval", "0.3",
        "--seed", "7", "--engine-loss", "replace,fail", json_path=out, timeout=380,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert done.stdout.count("result: PASS") == 2, report
    assert "policy    losses" in done.stdout, report  # the comparison
    replace, fail = json.loads(out.read_text())["cases"]
    assert (replace["engine_loss"], fail["engine_loss"]) == ("replace", "fail")
    for figures in (replace, fail):
        _common_checks(figures)

    # replace: a lost engine fails its own requests only, and its rank serves again.
    losses = replace["losses"]
    alone = [loss for loss in losses if not loss["whole_group"]]
    assert alone, losses
    assert all(loss["failed_elsewhere"] == 0 for loss in alone)
    assert replace["lost"] == sum(loss["failed"] for loss in alone)
    assert replace["lost_unattributed"] == 0
    assert replace["replacements"] >= 1
    assert any(loss["serving_again_s"] is not None for loss in alone)
    # Only a loss of the last serving engine takes the group (the others being replaced
    # when it is struck).
    assert replace["deaths"] == len(losses) - len(alone)
    assert replace["loss_summary"]["losses"] == len(losses)

    # fail: every loss is the whole group's, and callers get EngineDeadError.
    assert fail["deaths"] >= 2 and fail["lost"] == 0
    assert all(loss["whole_group"] for loss in fail["losses"])
    assert fail["failed"].get("EngineDeadError", 0) > 0
    assert fail["replacements"] == 0


def chaos_args(*argv: str) -> argparse.Namespace:
    """The chaos run's flags parsed as ``tools/chaos`` parses them."""
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_chaos_flags_and_defaults() -> None:
    args = chaos_args("--seconds", "5", "--engines", "2")
    assert (args.seconds, args.engines) == (5.0, 2)
    assert args.engine == "synthetic" and args.deadline > args.health_timeout
    assert chaos.policies(args.engine_loss) == ["replace"]
    assert chaos.policies("replace, Fail") == ["replace", "fail"]
    with pytest.raises(SystemExit, match="replace, isolate, fail"):
        chaos.policies("replace,retry")


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
        lambda f, leaks: setattr(f, "lost_unattributed", 1),
        lambda f, leaks: f.losses.append(LossRecord("kill", 0, 1.0, failed=2, failed_elsewhere=1)),
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


def test_a_losses_throughput_windows_read_the_timeline() -> None:
    timeline = Timeline()
    # Completions at known times: 100 tokens at 1 s, 2 s, 3 s ... 9 s.
    timeline._times = [float(t) for t in range(1, 10)]
    timeline._totals = [100 * t for t in range(1, 10)]
    assert timeline.tokens_per_s(1.0, 3.0) == 100.0  # 1 s and 2 s
    assert timeline.tokens_per_s(3.5, 3.5) is None
    back = LossRecord("kill", 1, fault_at=6.0, serving_again_s=1.0)
    back.measure(timeline)
    # Before [1, 6): 5 completions; during [6, 7): 1; after [7, 12): 3 (7, 8, 9).
    assert (back.tokens_per_s_before, back.tokens_per_s_during) == (100.0, 100.0)
    assert back.tokens_per_s_after == 60.0
    isolated = LossRecord("stop_hang", 0, fault_at=2.0, failed=4)
    isolated.measure(timeline)
    assert isolated.tokens_per_s_after is None  # it never served again
    assert isolated.tokens_per_s_during == 100.0  # [2, 7): 2 .. 6
    summary = summarize([back, isolated])
    assert (summary["losses"], summary["failed_max"], summary["serving_again"]) == (2, 4, 1)
    assert summary["serving_again_median_s"] == 1.0
