"""``corewire demo`` end to end with the reference engine."""

from __future__ import annotations

import re

import pytest

from client_support import no_leaks
from corewire.cli import main


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
