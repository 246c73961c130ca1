"""``corewire demo`` end to end with the reference engine."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from corewire.cli import main
from leak_support import no_leaks


def test_demo_prints_throughput_and_latency_percentiles(capsys: pytest.CaptureFixture[str]) -> None:
    with no_leaks(grace=15):
        status = main(
            ["demo", "--requests", "12", "--concurrency", "4", "--max-tokens", "5", "--no-progress"]
        )
    assert status == 0
    out = capsys.readouterr().out
    assert "12 requests x 5 tokens, concurrency 4" in out
    assert float(re.search(r"requests/s\s+([\d.]+)", out).group(1)) > 0  # type: ignore[union-attr]
    tokens_per_s = float(re.search(r"tokens/s\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert tokens_per_s > 0
    for label in ("TTFT", "ITL"):
        match = re.search(label + r"\s+ms\s+p50\s+([\d.]+)\s+p90\s+([\d.]+)\s+p99\s+([\d.]+)", out)
        assert match, out
        p50, p90, p99 = map(float, match.groups())
        assert 0 <= p50 <= p90 <= p99


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "0"]) == 2
    assert "--requests must be at least 1" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_demo_reports_an_engine_that_dies(capsys: pytest.CaptureFixture[str]) -> None:
    # The engine dies with requests in flight: the demo says so and fails, without hanging
    # on the requests that will never finish.
    with no_leaks(grace=15):
        status = main(
            ["demo", "--engine", "client_support:FailingEngine", "--engine-args",
             '{"fail_after": 2}', "--requests", "8", "--concurrency", "4", "--max-tokens",
             "50", "--no-progress"]
        )  # fmt: skip
    assert status == 1
    assert "engine core died" in capsys.readouterr().err.lower()


_STATS = r"[\d,]+ tok/s, TTFT p50 [\d.]+ p99 [\d.]+ ms, ITL p50 [\d.]+ p99 [\d.]+ ms"


def test_demo_progress_off_a_terminal_is_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    # capsys's stderr is no terminal: whole lines, no carriage returns, no escapes.
    with no_leaks(grace=15):
        status = main(["demo", "--requests", "12", "--concurrency", "4", "--max-tokens", "5"])
    assert status == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    lines = err.splitlines()
    pattern = r"corewire demo: \d+/12 requests, " + _STATS
    assert lines and all(re.fullmatch(pattern, x) for x in lines), lines
    assert lines[-1].startswith("corewire demo: 12/12 requests, ")


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # EIO: the other side of the pty is closed
            return out
        if not chunk:
            return out
        out += chunk


def test_demo_progress_on_a_terminal_is_one_live_line() -> None:
    # stderr on a pseudo-terminal (120 columns): the bar is redrawn in place, with the
    # throughput and latency percentiles, and a shorter redraw leaves no old characters.
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    with no_leaks(grace=15):
        proc = subprocess.Popen(
            [sys.executable, "-m", "corewire.cli", "demo", "--requests", "64",
             "--concurrency", "4", "--max-tokens", "64"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=secondary,
        )  # fmt: skip
        os.close(secondary)
        try:
            err = _read_all(primary).decode(errors="replace").replace("\r\n", "\n")
            out = proc.communicate(timeout=100)[0].decode()
        finally:
            os.close(primary)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert "tokens/s" in out
    line = next(x for x in err.split("\n") if "\r" in x)  # the engine logs on other lines
    draws = [d for d in line.split("\r") if d]
    # The first draw is the empty bar; every later one carries the throughput, and each
    # latency's percentiles once it has samples (a start slowed by a busy machine can
    # draw before the first token: no TTFT yet); the last draw carries them all.
    partial = r"[\d,]+ tok/s(, TTFT p50 [\d.]+ p99 [\d.]+ ms)?(, ITL p50 [\d.]+ p99 [\d.]+ ms)?"
    wrong = [d for d in draws[1:] if not re.search(r"\d+/64 \[.*, " + partial + r"\]", d)]
    assert not wrong, wrong
    assert re.search(r" 64/64 \[.*, " + _STATS + r"\]", draws[-1]), draws[-1]
    assert any("/64 " in d and " 64/64 " not in d for d in draws), "no draw before the end"
    # What the terminal shows: each draw written over the last from the line's start.
    screen = ""
    for draw in draws:
        screen = draw + screen[len(draw) :]
    assert screen.rstrip() == draws[-1].rstrip(), (screen, draws[-1])
    assert " 64/64 " in screen and all(len(d) <= 120 for d in draws)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        # Found before any process starts...
        (["--engine", "no_such_module_xyz:E"],
         "corewire demo: the engine failed to start: ModuleNotFoundError: No module named "
         "'no_such_module_xyz'"),
        # ...and reported by the engine process.
        (["--engine-args", '{"no_such_arg": 1}'],
         "corewire demo: engine process corewire-engine-0 exited with code 1 before it was "
         "ready: TypeError: ReferenceEngine.__init__() got an unexpected keyword argument "
         "'no_such_arg'"),
    ],
)  # fmt: skip
def test_demo_names_why_the_engine_did_not_start(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with no_leaks(grace=15):
        assert main(["demo", "--requests", "2", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""
