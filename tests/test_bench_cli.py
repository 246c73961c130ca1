"""``corewire bench``: each benchmark runs from the installed package, writes JSON results
with the machine, versions, cases and goals, and draws a real PNG.

The benchmarks run as a user runs them, ``corewire bench ...`` in a fresh interpreter, at
their smallest sizes. "vLLM not installed" and "matplotlib not installed" are produced by
blocking the import the way Python blocks one on purpose (``sys.modules[name] = None``).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from corewire import cli
from corewire._optional import is_installed

HAVE_VLLM = is_installed("vllm")
HAVE_MATPLOTLIB = is_installed("matplotlib")
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench(
    *argv: str, block: tuple[str, ...] = (), timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    """Run ``corewire bench ARGV`` in a fresh interpreter in which ``block`` cannot be
    imported."""
    code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
    code += textwrap.dedent(
        f"""
        from corewire.cli import main
        sys.exit(main(["bench", *{list(argv)!r}]))
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


def read_results(path: Path, name: str) -> dict[str, Any]:
    """The JSON file, checked for what every benchmark writes."""
    doc = json.loads(path.read_text())
    assert doc["bench"] == name and doc["schema"] == 1
    machine = doc["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    assert machine["python"] == ".".join(map(str, sys.version_info[:3]))
    assert machine["corewire"]
    assert datetime.datetime.fromisoformat(machine["date"]).year >= 2024
    assert doc["vllm_installed"] is HAVE_VLLM
    assert (machine["vllm"] is not None) is HAVE_VLLM
    assert doc["cases"], "no measured case"
    for goal in doc["goals"]:
        assert set(goal) == {"name", "value", "target", "lower_is_better", "met"}
        assert isinstance(goal["met"], bool)
    assert doc["goals_met"] + doc["goals_missed"] == len(doc["goals"])
    assert doc["goals_met"] == sum(g["met"] for g in doc["goals"])
    return doc


def check_png(path: Path, min_width: int = 600, min_height: int = 300) -> None:
    """A real PNG image of a useful size, with something drawn on it."""
    from PIL import Image  # matplotlib's own dependency

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        pixels = np.asarray(image.convert("RGB"))
    assert width >= min_width and height >= min_height, image.size
    # Lines, markers, text and legends: many colours, and far from all white.
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 50, len(colours)
    assert (pixels.min(axis=2) < 200).mean() > 0.01


def test_bench_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser("bench")
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["bench", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for name in ("decode", "client", "dp", "serve"):
        assert f"    {name} " in help_text
    args = parser.parse_args(["bench", "decode", "--quick", "--json", "x.json", "--plot", "x.png"])
    assert (args.bench, args.quick, args.json, args.plot) == ("decode", True, "x.json", "x.png")


def test_serve_arguments() -> None:
    parser = cli.build_parser("bench")
    args = parser.parse_args(["bench", "serve"])
    assert (args.streams, args.logprobs, args.clients) == ([64, 256], [0, 5], ["vllm", "corewire"])
    assert (args.profile, args.no_stats, args.quick, args.json, args.plot) == (
        True, False, False, None, None,
    )  # fmt: skip
    args = parser.parse_args(
        ["bench", "serve", "--streams", "8,16", "--logprobs", "5", "--clients", "corewire",
         "--no-profile", "--step-delay", "0.001", "--max-tokens", "32"]
    )  # fmt: skip
    assert (args.streams, args.logprobs, args.clients) == ([8, 16], [5], ["corewire"])
    assert (args.profile, args.step_delay, args.max_tokens) == (False, 0.001, 32)


def test_bad_arguments_stop_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "decode", "--cases", "plain,nope"]) == 2
    assert "unknown case(s) ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "client", "--cases", "plain:7"])
    assert exc.value.code == 2
    for bad in (["--clients", "vllm,other"], ["--streams", "8,x"], ["--logprobs", "-1"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "serve", *bad])
        assert exc.value.code == 2
    capsys.readouterr()
    assert cli.main(["bench", "serve", "--rounds", "0"]) == 2
    expected = "must be at least 1" if HAVE_VLLM else "vLLM is not installed"
    assert expected in capsys.readouterr().err


@needs_matplotlib
def test_decode_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "decode.json", tmp_path / "decode.png"
    proc = bench(
        "decode", "--quick", "--cases", "plain,top-5", "--batches", "256",
        "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_results(out, "decode")
    decoders = {"vllm", "msgspec", "corewire"} if HAVE_VLLM else {"msgspec", "corewire"}
    assert doc["baseline"] == ("vllm" if HAVE_VLLM else "msgspec")
    seen = set()
    for case in doc["cases"]:
        seen.add((case["case"], case["batch"], case["mode"]))
        assert set(case["us"]) == set(case["ns_out"]) == decoders
        assert set(case["ratios"]) == decoders - {"corewire"}
        assert case["equal"] is True and case["differences"] == []
        for name in decoders:
            assert case["us"][name] > 0
            assert case["ns_out"][name] == pytest.approx(case["us"][name] * 1e3 / case["batch"])
        assert case["ratios"][doc["baseline"]] == pytest.approx(
            case["us"][doc["baseline"]] / case["us"]["corewire"]
        )
    assert ("top-5", 256, "decode+tolist") in seen and ("plain", 256, "decode") in seen
    assert len(seen) == 2 + 3  # plain: 2 modes, top-5: 3
    # Both goals are read at batch 256, decode+touch.
    assert [g["name"].split(",")[0] for g in doc["goals"]] == ["plain", "top-5"]
    assert [g["target"] for g in doc["goals"]] == [3.0, 20.0]
    assert doc["logprobs_cost_ns_per_output"]["corewire"] > 0
    check_png(png)
    assert "plot written to" in proc.stdout


def test_decode_without_vllm_says_so(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    proc = bench(
        "decode", "--quick", "--cases", "plain", "--batches", "1", "--json", str(out),
        block=("vllm",),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vLLM is not installed: no comparison with vLLM 0.25.1" in proc.stdout
    assert "pip install vllm==0.25.1" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["vllm_installed"] is False and doc["machine"]["vllm"] is None
    assert doc["baseline"] == "msgspec"
    assert {tuple(c["ratios"]) for c in doc["cases"]} == {("msgspec",)}


@needs_matplotlib
def test_client_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "client.json", tmp_path / "client.png"
    proc = bench(
        "client", "--quick", "--cases", "plain:1,top-5:32", "--gc", "default", "--trials", "1",
        "--calls", "128", "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_results(out, "client")
    variants = {"raw", "baseline", "corewire", "d+t"} | ({"vllm"} if HAVE_VLLM else set())
    assert doc["baseline"] == ("vllm" if HAVE_VLLM else "baseline")
    assert [(c["gc"], c["case"], c["batch"]) for c in doc["cases"]] == [
        ("default", "plain", 1),
        ("default", "top-5", 32),
    ]
    for case in doc["cases"]:
        assert set(case["us_per_frame"]) == set(case["frames_per_s"]) == variants
        assert case["equal"] is True
        assert case["frames_per_s"]["corewire"] == pytest.approx(
            1e6 / case["us_per_frame"]["corewire"]
        )
        assert case["ratios"][doc["baseline"]] > 0
    assert [u["concurrency"] for u in doc["utility"]] == [1, 64]
    assert doc["utility"][0]["calls_per_s"]["raw"] > 0
    # No stream case at batch 256 ran: only the utility goals can be read.
    assert [g["name"].split(":")[0] for g in doc["goals"]] == [
        "utility sequential",
        "utility 64 concurrent",
    ]
    check_png(png)


@needs_matplotlib
def test_dp_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "dp.json", tmp_path / "dp.png"
    proc = bench("dp", "--quick", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_results(out, "dp")
    decision = [c for c in doc["cases"] if c["part"] == "decision"]
    spread = [c for c in doc["cases"] if c["part"] == "spread"]
    assert [c["engines"] for c in decision] == [2, 16, 64]
    policies = {"router", "python", "round_robin"} | ({"vllm"} if HAVE_VLLM else set())
    assert all(set(c["ns_per_decision"]) == policies for c in decision)
    names = {"Router", "round-robin"} | ({"vLLM rule"} if HAVE_VLLM else set())
    assert {c["policy"] for c in spread} == names
    assert len(spread) == 2 * 2 * len(names)  # two scenarios x two group sizes
    assert [g["name"] for g in doc["goals"]] == ["native decision at 16 engines, ns"]
    assert doc["goals"][0]["lower_is_better"] is True
    check_png(png)


def test_plot_without_matplotlib_stops_at_once(tmp_path: Path) -> None:
    png = tmp_path / "dp.png"
    proc = bench("dp", "--quick", "--plot", str(png), block=("matplotlib",))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "corewire bench dp: --plot needs matplotlib, which is not installed: "
        "pip install 'corewire[bench]'"
    ]
    assert "routing decision" not in proc.stdout and not png.exists()


def test_serve_without_vllm_says_so() -> None:
    proc = bench("serve", "--quick", block=("vllm",), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("corewire bench serve: vLLM is not installed")
    assert lines[0].endswith("pip install vllm==0.25.1")


def _serve_missing() -> str | None:
    if not HAVE_VLLM:
        return "vllm is not installed"
    if not HAVE_MATPLOTLIB:
        return "matplotlib is not installed"
    from serve_support import missing_prerequisite, plugin_missing

    return missing_prerequisite() or plugin_missing()


def test_serve_tiny_run(tmp_path: Path) -> None:
    """One tiny configuration: both clients in vLLM's API server, 32 short requests each
    (16 tokens, the engine taking 2 ms a step: without a delay, the API server may merge a
    request's tokens into one chunk, and there is no inter-token latency to measure)."""
    missing = _serve_missing()
    if missing:
        pytest.skip(missing)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    proc = bench(
        "serve", "--quick", "--streams", "2", "--logprobs", "0", "--max-tokens", "16",
        "--step-delay", "0.002", "--no-profile", "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    # Exit status 1 is a missed goal (tokens/s within noise of vLLM's): not this test's.
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    doc = read_results(out, "serve")
    assert [c["client"] for c in doc["cases"]] == ["vllm", "corewire"]
    for case in doc["cases"]:
        assert case["errors"] == 0 and case["requests"] == 32
        assert case["tokens"] == 32 * 16 and case["tokens_per_s"] > 0
        assert 0 < case["ttft_ms"]["p50"] <= case["ttft_ms"]["p99"]
        assert 0 < case["itl_ms"]["p50"] <= case["itl_ms"]["p99"]
    assert [g["name"] for g in doc["goals"]] == [
        "2 streams, logprobs 0: tokens/s x vllm (not lower)"
    ]
    check_png(png)
