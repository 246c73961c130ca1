"""``corewire bench``: each benchmark runs from the installed package, writes JSON results
with the machine, versions, cases and goals, and draws a real PNG.

The benchmarks run as a user runs them, ``corewire bench ...`` in a fresh interpreter, at
their smallest sizes. "vLLM not installed" and "matplotlib not installed" are produced by
blocking the import the way Python blocks one on purpose (``sys.modules[name] = None``).
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from corewire import cli
from corewire._optional import is_installed
from corewire.bench import client as client_bench
from corewire.bench import common, gc_times, serve_real, serve_split
from corewire.bench import serve as serve_bench
from corewire.bench.serve_profile import (
    CLIENT_LAYER,
    COLLECTOR,
    NATIVE_OUTPUT_LAYER,
    NATIVE_RATE,
    RATE,
    Profile,
    classify,
    in_collection,
    is_waiting,
    profiled,
    read_profile,
)
from corewire.client import AsyncMPClient
from corewire.codec import NativeDecoder
from corewire.errors import ProtocolError
from corewire.releases import SUPPORTED, UnsupportedProtocolError
from corewire.releases import for_vllm as release_for_vllm

#: How a refusal names the releases corewire speaks (every recorded one).
SUPPORTED_NAMED = ", ".join(repr(r.name) for r in SUPPORTED)

HAVE_VLLM = is_installed("vllm")
HAVE_MATPLOTLIB = is_installed("matplotlib")
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Each benchmark runs in a fresh interpreter: a --quick run takes seconds on a quiet
# machine and minutes on a loaded one (three CPU hogs on two cores); the budget is the
# loaded machine's, and no check here reads a time.
pytestmark = pytest.mark.timeout(900)


def bench(
    *argv: str, block: tuple[str, ...] = (), timeout: float = 800, path_first: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``corewire bench ARGV`` in a fresh interpreter in which ``block`` cannot be
    imported (and ``path_first``, if given, comes first on ``sys.path``)."""
    code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
    code += textwrap.dedent(
        f"""
        from corewire.cli import main
        sys.exit(main(["bench", *{list(argv)!r}]))
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    if path_first is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(path_first), env.get("PYTHONPATH")) if p
        )
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
    for name in ("decode", "client", "dp", "serve", "output"):
        assert f"    {name} " in help_text
    args = parser.parse_args(["bench", "decode", "--quick", "--json", "x.json", "--plot", "x.png"])
    assert (args.bench, args.quick, args.json, args.plot) == ("decode", True, "x.json", "x.png")


def test_serve_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser("bench")
    args = parser.parse_args(["bench", "serve"])
    # None: every stack, less corewire+output where it cannot run (decided in run()).
    assert (args.streams, args.logprobs, args.clients) == ([64, 256], [0, 5], None)
    assert serve_bench.DEFAULT_CLIENTS == ["vllm", "corewire", "corewire+output"]
    assert (args.chunk_streams, args.chunk_step_delay) == (256, 0.02)
    assert (args.profile, args.no_stats, args.quick, args.json, args.plot) == (
        True, False, False, None, None,
    )  # fmt: skip
    assert args.native_profile is False
    assert args.profile_dir is None
    assert (args.stream_interval, args.repeat) == (1, 1)
    assert serve_bench._server_args(args) == ()
    args = parser.parse_args(["bench", "serve", "--stream-interval", "8", "--no-stats"])
    assert serve_bench._server_args(args) == ("--disable-log-stats", "--stream-interval", "8")
    assert serve_bench.requests_at_least(args, 256) == 256 * 4
    assert serve_bench.requests_at_least(args, 4) == 32
    args = parser.parse_args(
        ["bench", "serve", "--chat", "--tool-call-parser", "hermes", "--reasoning-parser",
         "deepseek_r1"]
    )  # fmt: skip
    assert args.chat
    assert serve_bench._server_args(args) == (
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "deepseek_r1",
    )  # fmt: skip
    args = parser.parse_args(["bench", "serve", "--native-profile", "--profile-dir", "p"])
    assert (args.native_profile, args.profile_dir) == (True, "p")
    # A server paused at every sample runs for --seconds, one request per stream at least.
    assert serve_bench.requests_at_least(args, 256) == 256
    args = parser.parse_args(
        ["bench", "serve", "--streams", "8,16", "--logprobs", "5", "--clients", "corewire",
         "--no-profile", "--step-delay", "0.001", "--max-tokens", "32"]
    )  # fmt: skip
    assert (args.streams, args.logprobs, args.clients) == ([8, 16], [5], ["corewire"])
    assert (args.profile, args.step_delay, args.max_tokens) == (False, 0.001, 32)
    args = parser.parse_args(
        ["bench", "serve", "--clients", "corewire+output,vllm,vllm", "--chunk-streams", "0",
         "--chunk-step-delay", "0.05"]
    )  # fmt: skip
    assert args.clients == ["corewire+output", "vllm"]
    assert (args.chunk_streams, args.chunk_step_delay) == (0, 0.05)
    assert not any(s.one_token_chunks for s in serve_bench.scenarios(args))
    args.chunk_streams = 128
    assert [s.label for s in serve_bench.scenarios(args)] == [
        "64 streams, logprobs 0", "64 streams, logprobs 5", "256 streams, logprobs 0",
        "256 streams, logprobs 5", "one token per chunk: 128 streams, 50 ms steps, logprobs 0",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--chunk-streams",
        "--chunk-step-delay",
        "--stream-interval",
        "--repeat",
        "corewire+output",
        "COREWIRE_VLLM_OUTPUT",
    ):
        assert flag in help_text


def _round(client: str, tokens: int, cpu_s: float, gc_cpu_s: float) -> serve_bench.Result:
    r = serve_bench.Result(client, 8, 0, "8 streams, logprobs 0", requests=2, tokens=tokens)
    r.seconds, r.cpu_seconds, r.chunks = 1.0, cpu_s, tokens
    r.ttft, r.itl = [0.1], [0.01, 0.02]
    r.profile = Profile()
    r.profile.as_sampled.update({CLIENT_LAYER: 3, "HTTP": 1})
    r.gc = gc_times.GcTimes((1, 0, 0), (gc_cpu_s, 0.0, 0.0), (gc_cpu_s, 0.0, 0.0), (5, 0, 0))
    r.per_round = [r.tokens_per_cpu_s]
    return r


def test_serve_rounds_pool_and_read_the_median_ratio() -> None:
    """``--repeat``: rounds of one client pool into one result (tokens, CPU, latencies,
    profile, collector), and tokens per CPU second against vLLM's stack is the median of
    the rounds' own ratios, not the ratio of the totals."""
    ours = _round("corewire+output", 1000, 1.0, 0.1)
    for tokens, cpu in ((1000, 2.0), (1000, 0.5)):
        ours.add_round(_round("corewire+output", tokens, cpu, 0.1))
    base = _round("vllm", 1000, 1.0, 0.2)
    for _ in range(2):
        base.add_round(_round("vllm", 1000, 1.0, 0.2))
    assert (ours.tokens, ours.cpu_seconds, ours.requests, ours.chunks) == (3000, 3.5, 6, 3000)
    assert (len(ours.ttft), len(ours.itl), ours.profile.samples) == (3, 6, 12)
    assert ours.gc is not None and ours.gc.collections == (3, 0, 0)
    assert ours.gc.total_cpu_s == pytest.approx(0.3)
    assert ours.per_round == [1000.0, 500.0, 2000.0]
    # Round ratios 1.0, 0.5, 2.0: the median is 1.0; the totals would say 3000/3.5 / 1000.
    assert serve_bench.per_core_ratio(ours, base) == pytest.approx(1.0)
    assert serve_bench.round_ratios(ours, base) == "rounds 1.00, 0.50, 2.00x (median 1.00x)"
    single, single_base = _round("corewire", 1500, 1.0, 0.1), _round("vllm", 1000, 1.0, 0.1)
    assert serve_bench.per_core_ratio(single, single_base) == pytest.approx(1.5)
    assert serve_bench.round_ratios(single, single_base) == ""
    # A round without CPU time has no ratio: the median is of the others.
    empty = _round("corewire+output", 0, 0.0, 0.1)
    lagging = _round("corewire+output", 2000, 1.0, 0.1)
    lagging.add_round(empty)
    lagging.add_round(_round("corewire+output", 3000, 1.0, 0.1))
    assert serve_bench.per_core_ratio(lagging, base) == pytest.approx(2.5)
    # A round whose probe did not answer leaves the pooled collector unknown.
    missing = _round("vllm", 1000, 1.0, 0.1)
    missing.gc = None
    single_base.add_round(missing)
    assert single_base.gc is None
    case = serve_bench.as_case(ours, base)
    assert case["tokens_per_api_server_cpu_s_by_round"] == [1000.0, 500.0, 2000.0]
    assert case["vs_vllm"]["tokens_per_api_server_cpu_s"] == pytest.approx(1.0)


def _at_length(
    client: str, tokens_per_request: int, per_request_s: float, per_token_s: float
) -> serve_bench.Result:
    """A result whose CPU follows the per-request + per-token model exactly."""
    requests = 12800 // tokens_per_request
    short = None if tokens_per_request == 128 else tokens_per_request
    r = serve_bench.Result(client, 256, 0, requests=requests, tokens=12800, max_tokens=short)
    r.seconds, r.chunks = 1.0, 12800
    r.cpu_seconds = requests * (per_request_s + tokens_per_request * per_token_s)
    return r


def test_serve_split_fits_cpu_per_request_and_per_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--split-tokens``: each saturation scenario runs again with shorter requests (no
    goal read there), and each stack's CPU is split into a part per request and a part per
    token; the ceiling is what the per-request part alone allows over vllm's."""
    parser = cli.build_parser()
    args = parser.parse_args(
        ["bench", "serve", "--streams", "256", "--logprobs", "0,5", "--split-tokens", "32"]
    )
    # Each shorter twin right after its scenario.
    assert [(s.label, s.max_tokens) for s in serve_bench.scenarios(args)] == [
        ("256 streams, logprobs 0", None),
        ("256 streams, logprobs 0, 32 tokens", 32),
        ("256 streams, logprobs 5", None),
        ("256 streams, logprobs 5, 32 tokens", 32),
        ("one token per chunk: 256 streams, 20 ms steps, logprobs 0", None),
    ]
    stacks = {"vllm": (1.4e-3, 22e-6), "corewire+fast": (1.4e-3, 7e-6), "rust": (1e-4, 9e-6)}
    long = [_at_length(c, 128, *parts) for c, parts in stacks.items()]
    short = [_at_length(c, 32, *parts) for c, parts in stacks.items()]
    splits, problems = serve_bench.cost_splits(long, short)
    assert problems == []
    assert [s.client for s in splits] == list(stacks)
    for split, (per_request, per_token) in zip(splits, stacks.values(), strict=True):
        assert split.per_request_s == pytest.approx(per_request)
        assert split.per_token_s == pytest.approx(per_token)
        assert (split.short_tokens, split.long_tokens) == (32, 128)
    vllm, fast, _ = splits
    # With free tokens, the fast stack's 1.4 ms per request caps it at vllm's 1.4 ms +
    # 128 x 22 us over 1.4 ms.
    assert fast.ceiling(vllm) == pytest.approx((1.4e-3 + 128 * 22e-6) / 1.4e-3)
    with pytest.raises(ValueError, match="tokens per request"):
        serve_split.fit(long[0], long[0])
    # A pair that cannot be split is said, and the others still are.
    idle = _at_length("vllm", 32, 1e-3, 1e-5)
    idle.requests = 0
    _, problems = serve_bench.cost_splits(long, [idle])
    assert len(problems) == 1 and "without finished requests" in problems[0]
    capsys.readouterr()
    found = serve_bench.report(long + short)
    out = capsys.readouterr().out
    # The short runs are in the split only: no goal, no row of the main table.
    assert not any("32 tokens" in g.name for g in found)
    assert "front-end CPU per request and per token" in out
    row = next(line for line in out.splitlines() if line.startswith("corewire+fast   ") and
               line.split()[-2:] == [f"{fast.ceiling(vllm):.2f}", "1.00/1.00"])  # fmt: skip
    assert row.split()[3:5] == ["1400", "1.00"]  # us per request, x vllm
    assert row.split()[6:9] == ["7.00", "0.32", "0.78"]  # us per token, x vllm, x rust


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
    for bad in (["--chunk-streams", "-1"], ["--chunk-step-delay", "0"]):
        assert cli.main(["bench", "serve", *bad]) == 2
        expected = "--chunk-step-delay positive" if HAVE_VLLM else "vLLM is not installed"
        assert expected in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--repeat", "0"]) == 2
    expected = "--repeat must be at least 1" if HAVE_VLLM else "vLLM is not installed"
    assert expected in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--split-tokens", "128"]) == 2
    expected = "below --max-tokens" if HAVE_VLLM else "vLLM is not installed"
    assert expected in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--stream-interval", "0"]) == 2
    expected = "--stream-interval must be at least 1" if HAVE_VLLM else "vLLM is not installed"
    assert expected in capsys.readouterr().err
    for bad, why in (
        (["--model", "m"], "--model goes with --engine vllm"),
        (["--engine", "vllm", "--engines", "2"], "give vLLM's own DP flags in --serve-args"),
        (["--engine", "vllm", "--native-profile"], "vLLM's engine waits on it"),
    ):
        assert cli.main(["bench", "serve", *bad]) == 2
        assert (why if HAVE_VLLM else "vLLM is not installed") in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--engine", "other"])
    assert exc.value.code == 2


def test_serve_engine_arguments() -> None:
    parser = cli.build_parser("bench")
    args = parser.parse_args(["bench", "serve"])
    assert (args.engine, args.model, args.served_model_name, args.serve_args) == (
        "synthetic", None, None, "",
    )  # fmt: skip
    args = parser.parse_args(
        ["bench", "serve", "--engine", "vllm", "--model", "/m/llama", "--streams", "8,32",
         "--serve-args", "--max-model-len 4096 --tensor-parallel-size 2", "--chat",
         "--reasoning-parser", "deepseek_r1"]
    )  # fmt: skip
    stack = serve_real.real_engine_stack(
        args, Path("/m/llama"), Path("log"), "corewire", serve_bench._server_args(args), {}
    )
    command = stack.command()
    # The directory's name is the model's in the API; room for the most streams; the
    # run's flags, then --serve-args last, so that their --max-model-len wins.
    assert command[command.index("--served-model-name") + 1] == "llama"
    assert command[command.index("--max-num-seqs") + 1] == "32"
    assert command[-6:] == [
        "--reasoning-parser", "deepseek_r1", "--max-model-len", "4096",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    assert stack.env["COREWIRE_VLLM_CLIENT"] == "1"
    args = parser.parse_args(["bench", "serve", "--engine", "vllm"])
    assert serve_real.real_engine_unsupported(args) is None
    # Over the synthetic engine, --serve-args go last into every stack's flags.
    args = parser.parse_args(
        ["bench", "serve", "--stream-interval", "2", "--serve-args=--enable-force-include-usage"]
    )
    assert serve_real.real_engine_unsupported(args) is None
    assert serve_bench._server_args(args) == (
        "--stream-interval", "2", "--enable-force-include-usage",
    )  # fmt: skip
    args = parser.parse_args(["bench", "serve", "--engine", "vllm"])
    stack = serve_real.real_engine_stack(args, Path("/w/model"), Path("log"), "vllm", (), {})
    assert stack.served_model_name == serve_real.WRITTEN_MODEL_NAME
    assert stack.env["COREWIRE_VLLM_CLIENT"] == "0"


def test_front_end_cpu_leaves_vllm_engine_cores_out() -> None:
    """The front-end's CPU counts the API server's children but vLLM's engine cores
    under it and their own children (``--engine vllm``): read off real processes, one
    of them titled as vLLM titles its engine core."""
    import psutil

    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import subprocess, sys, time
            spin = [sys.executable, "-c", "while True: pass"]
            # The engine core and a worker of its own, both spinning.
            worker = f"import subprocess, time; subprocess.Popen({spin!r}); time.sleep(600)"
            # (The title is put together here: this script's own text must not hold it.)
            title = "VLLM::Engine" + "Core"
            engine = subprocess.Popen([sys.executable, "-c", worker, title])
            helper = subprocess.Popen([*spin, "front-end-helper"])
            time.sleep(600)
            """
        )],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        server = psutil.Process(parent.pid)
        deadline = time.monotonic() + 30
        while len(server.children(recursive=True)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        children = {" ".join(c.cmdline()): c for c in server.children()}
        engine = next(c for line, c in children.items() if "VLLM::EngineCore" in line)
        helper = next(c.pid for line, c in children.items() if "front-end-helper" in line)
        (worker,) = (c.pid for c in engine.children())
        # Read once the helper has run at all (a busy machine may keep it waiting).
        seconds = serve_bench.front_end_cpu(server)
        while not seconds.get(helper) and time.monotonic() < deadline + 30:
            time.sleep(0.1)
            seconds = serve_bench.front_end_cpu(server)
        assert set(seconds) == {parent.pid, helper}
        assert seconds[helper] > 0
        everyone = server.children(recursive=True)
        assert serve_real.engine_pids(everyone) == {engine.pid, worker}
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait(10)


def test_decode_json_and_plot(tmp_path: Path) -> None:
    # The plot only where matplotlib is (the vLLM 0.33.0 venv has none): the JSON and the
    # equality checks run everywhere.
    out, png = tmp_path / "decode.json", tmp_path / "decode.png"
    plot = ("--plot", str(png)) if HAVE_MATPLOTLIB else ()
    proc = bench(
        "decode", "--quick", "--cases", "plain,top-5", "--batches", "256",
        "--json", str(out), *plot,
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
        # Each decoder's time is its best of the quick run's 5 rounds, and the second
        # reading is the median of the rounds' paired ratios.
        assert case["rounds"] == 5
        rounds = case["round_us"]
        assert set(rounds) == decoders and all(len(t) == 5 for t in rounds.values())
        assert set(case["paired_ratios"]) == decoders - {"corewire"}
        for name in decoders:
            assert case["us"][name] == pytest.approx(min(rounds[name]))
        for name, ratio in case["paired_ratios"].items():
            paired = [a / b for a, b in zip(rounds[name], rounds["corewire"], strict=True)]
            assert ratio == pytest.approx(statistics.median(paired))
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
    # The wire is the installed vLLM's, and the untimed step with every optional field
    # set (0.33.0's new ones under 0.33.0) decoded alike.
    installed = doc["machine"]["vllm"]
    assert doc["release"] == (release_for_vllm(installed) if installed else "0.25.1")
    assert f"release={doc['release']!r}" in proc.stdout or not HAVE_VLLM
    assert doc["every_field_equal"] is True and doc["equal"] is True
    if HAVE_MATPLOTLIB:
        check_png(png)
        assert "plot written to" in proc.stdout


@pytest.mark.parametrize(
    ("installed", "release"),
    [(None, "0.25.1"), ("0.25.1", "0.25.1"), ("0.33.0", "0.33.0"), ("0.33.0+cpu", "0.33.0")],
)
def test_benches_measure_the_installed_vllms_wire(installed: str | None, release: str) -> None:
    assert common.baseline_release(installed) == release
    with pytest.raises(UnsupportedProtocolError):
        common.baseline_release("0.25.2")


@pytest.mark.parametrize(
    ("args", "not_measured"),
    [
        (("decode", "--quick", "--cases", "plain", "--batches", "1"), "case batch"),
        (("client", "--quick", "--cases", "plain:1", "--trials", "1"), "stream"),
    ],
    ids=["decode", "client"],
)
def test_benches_refuse_an_unsupported_vllm(
    tmp_path: Path, args: tuple[str, ...], not_measured: str
) -> None:
    # A distribution of another vLLM release, found first on the path: the bench must stop
    # before measuring it on a wire corewire would decode wrongly (no engine starts).
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.25.2"\n')
    info = tmp_path / "vllm-0.25.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.2\n")
    proc = bench(*args, path_first=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"corewire bench {args[0]}: unsupported vLLM version '0.25.2'" in proc.stderr
    assert SUPPORTED_NAMED in proc.stderr
    assert not_measured not in proc.stdout


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


def test_client_json_and_plot(tmp_path: Path) -> None:
    # The plot only where matplotlib is (the vLLM 0.33.0 venv has none): the JSON and the
    # checksum comparison run everywhere, on the installed vLLM's wire.
    out, png = tmp_path / "client.json", tmp_path / "client.png"
    plot = ("--plot", str(png)) if HAVE_MATPLOTLIB else ()
    proc = bench(
        "client", "--quick", "--cases", "plain:1,top-5:32", "--gc", "default", "--trials", "1",
        "--calls", "128", "--json", str(out), *plot,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_results(out, "client")
    variants = {"raw", "baseline", "corewire", "d+t"} | ({"vllm"} if HAVE_VLLM else set())
    assert doc["baseline"] == ("vllm" if HAVE_VLLM else "baseline")
    installed = doc["machine"]["vllm"]
    assert doc["release"] == (release_for_vllm(installed) if installed else "0.25.1")
    assert f"release {doc['release']!r}" in proc.stdout
    assert doc["equal"] is True
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
    # Sequential: the bare asyncio reference too; goals read on the medians of the trials.
    sequential = doc["utility"][0]
    assert sequential["calls_per_s"]["asyncio"] > 0
    for name, rates in sequential["calls_per_s_trials"].items():
        assert len(rates) == sequential["trials"]
        assert sequential["calls_per_s"][name] == pytest.approx(statistics.median(rates))
        assert sequential["calls_per_s_best"][name] == max(rates)
    assert sequential["of_raw"] == pytest.approx(
        sequential["calls_per_s"]["corewire"] / sequential["calls_per_s"]["raw"]
    )
    assert "asyncio" not in doc["utility"][1]["calls_per_s"]
    # No stream case at batch 256 ran: only the utility goals can be read.
    assert [g["name"].split(":")[0] for g in doc["goals"]] == [
        "utility sequential",
        "utility 64 concurrent",
    ]
    if HAVE_MATPLOTLIB:
        check_png(png)
        assert "plot written to" in proc.stdout


@pytest.mark.parametrize("release", ["0.25.1", "0.33.0"])
async def test_client_bench_engine_speaks_each_protocol(release: str) -> None:
    # The bench engine of each version (its ready map, its frames) read by corewire's client
    # of that version: what a consumer touches equals the frame decoded directly.
    client = AsyncMPClient(engine_main=client_bench.run_bench_engine, release=release, wire=release)
    try:
        assert client.release == release
        (ready,) = client.ready_info.values()
        # 0.33.0's front-end requires these keys; 0.25.1's map has none of them.
        assert ("tensor_parallel_size" in ready) is (release == "0.33.0")
        frame = client_bench.case_frame("top-5", 32, release)
        expected = client_bench.touch(NativeDecoder(release=release).decode([frame]))
        size = await client.call_utility_async("replay_case", "top-5", 32, 3)
        assert size == len(frame)
        sums = [client_bench.touch(await client.get_output_async()) for _ in range(3)]
        assert sums == [expected] * 3 and expected > 32
        assert await client.call_utility_async("echo", [release]) == [release]
    finally:
        client.shutdown()


async def test_client_bench_engine_of_0_33_0_is_not_read_as_0_25_1() -> None:
    # The frames really are 0.33.0's: a 0.25.1 client cannot read their outputs.
    assert client_bench.case_frame("plain", 8, "0.33.0") != client_bench.case_frame("plain", 8)
    client = AsyncMPClient(engine_main=client_bench.run_bench_engine, wire="0.33.0")
    try:
        assert client.release == "0.25.1"  # the documented default
        await client.call_utility_async("replay_case", "plain", 8, 1)
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(client.get_output_async(), 30)
    finally:
        client.shutdown()


def test_client_refuses_an_unsupported_protocol() -> None:
    with pytest.raises(UnsupportedProtocolError, match=re.escape(SUPPORTED_NAMED)):
        AsyncMPClient(engine_main=client_bench.run_bench_engine, release="0.25.2")


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


@pytest.mark.skipif(
    not HAVE_VLLM or importlib.metadata.version("vllm").split("+")[0] != "0.25.1",
    reason="vLLM 0.25.1 is the output benchmark's baseline",
)
@needs_matplotlib
def test_output_json_and_plot(tmp_path: Path) -> None:
    """``corewire bench output``: both processors on every case, the same texts, vLLM's
    processor slower per output than the native one (a real difference of about 3x to 8x,
    not a timing threshold: the check is only that the ratio is a measured number)."""
    out, png = tmp_path / "output.json", tmp_path / "output.png"
    proc = bench("output", "--quick", "--batch", "32", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_results(out, "output")
    assert [c["case"] for c in doc["cases"]] == [
        "plain", "stop strings", "logprobs 5", "flat logprobs 5", "prompt logprobs 5",
    ]  # fmt: skip
    for case in doc["cases"]:
        assert case["identical_texts"] is True
        # The scoring case counts per request (one output each, its prompt's logprobs).
        ns = case["ns_per_request" if case["case"] == "prompt logprobs 5" else "ns_per_output"]
        assert set(ns) == {"vllm", "corewire"} and min(ns.values()) > 0
        assert case["ratio"] == pytest.approx(ns["vllm"] / ns["corewire"])
    assert "identical" in proc.stdout
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


@pytest.mark.timeout(900)
def test_serve_tiny_run(tmp_path: Path) -> None:
    """One tiny configuration: every stack in vLLM's API server (corewire+output where it
    can run), 32 short requests each in a saturation scenario and in the one-token-per-
    chunk scenario (16 tokens, the engine taking 10 ms a step: without a delay, the API
    server may merge a request's tokens into one chunk, and there is no inter-token
    latency to measure). One step delay for both: one stack per client (~10 s each)."""
    missing = _serve_missing()
    if missing:
        pytest.skip(missing)
    no_output = serve_bench.native_output_missing()
    clients = ["vllm", "corewire"] + (["corewire+output"] if no_output is None else [])
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    proc = bench(
        "serve", "--quick", "--streams", "2", "--logprobs", "0", "--max-tokens", "16",
        "--step-delay", "0.01", "--chunk-streams", "4", "--chunk-step-delay", "0.01",
        "--no-profile", "--json", str(out), "--plot", str(png), timeout=800,
    )  # fmt: skip
    # Exit status 1 is a missed goal (tokens/s within noise of vLLM's): not this test's.
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert ("no corewire+output stack: " in proc.stdout) is (no_output is not None)
    doc = read_results(out, "serve")
    saturation, chunks = "2 streams, logprobs 0", "one token per chunk: 4 streams, 10 ms steps"
    chunks += ", logprobs 0"
    assert [(c["client"], c["scenario"]) for c in doc["cases"]] == [
        *((client, saturation) for client in clients),
        *((client, chunks) for client in clients),
    ]
    for case in doc["cases"]:
        assert case["errors"] == 0 and case["requests"] == 32
        assert case["tokens"] == 32 * 16 and case["tokens_per_s"] > 0
        assert case["step_delay_s"] == 0.01
        assert case["one_token_per_chunk_scenario"] is (case["scenario"] == chunks)
        assert 0 < case["ttft_ms"]["p50"] <= case["ttft_ms"]["p99"]
        assert 0 < case["itl_ms"]["p50"] <= case["itl_ms"]["p99"]
        per_core = case["tokens_per_api_server_cpu_s"]
        assert per_core == pytest.approx(1e3 / case["api_server_cpu_s_per_1k_tokens"])
        if case["client"] == "vllm":
            assert case["vs_vllm"]["tokens_per_api_server_cpu_s"] == 1.0
        else:
            assert case["vs_vllm"]["itl_p99"] > 0
    # How many tokens a chunk holds is a measurement (a loaded server merges steps), not
    # asserted here; only that it counts whole tokens in whole chunks.
    for case in doc["cases"]:
        assert 1.0 <= case["tokens_per_chunk"] <= case["tokens"] / case["requests"]
    names = [g["name"] for g in doc["goals"]]
    assert names[0] == f"{saturation}: tokens/s x vllm (not lower)"
    expected_chunk_goals = [f"{chunks}: {client} tokens per chunk (about 1)" for client in clients]
    assert names[-len(clients) :] == expected_chunk_goals
    if no_output is None:
        # The goals in the named scenario; none at 2 streams (no goal stated there).
        assert names[1 : -len(clients)] == [
            f"{chunks}: corewire+output tokens per CPU s x vllm",
            f"{chunks}: corewire+output TTFT p99 x vllm (no worse)",
            f"{chunks}: corewire+output ITL p99 x vllm (no worse)",
        ]
    else:
        assert len(names) == 1 + len(clients)
    check_png(png)


def test_serve_rust_stack_is_vllms_rust_front_end_over_the_same_engines() -> None:
    """``rust`` is vLLM's own client with VLLM_USE_RUST_FRONTEND=1 (vllm-rs serves), on
    request only, and py-spy has nothing of it to sample."""
    from corewire.vllm.serve.stack import RUST_FRONTEND_ENV

    client, env = serve_bench.STACKS["rust"]
    switches = {serve_bench.OUTPUT_SWITCH: "0", serve_bench.FAST_PATH_SWITCH: "0"}
    assert client == "vllm" and env == {**switches, **RUST_FRONTEND_ENV}
    assert "rust" not in serve_bench.DEFAULT_CLIENTS and "rust" in serve_bench.UNPROFILED


def test_serve_front_end_cpu_counts_every_process_of_the_front_end() -> None:
    """The front-end's CPU is its API server's and its descendants' (vllm-rs is a child of
    vLLM's Python process): a child that burns 0.3 s of CPU (then idles, to be read) is
    counted."""
    import psutil

    burn = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\ntime.sleep(2)"
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])",
        ]
    )
    try:
        server = psutil.Process(parent.pid)
        before = serve_bench.front_end_cpu(server)
        assert parent.pid in before
        # Read again while the child still runs (it is counted from 0: started after).
        deadline = time.monotonic() + 30
        while True:
            after = serve_bench.front_end_cpu(server)
            child = [pid for pid in after if pid != parent.pid]
            if child and after[child[0]] >= 0.25:
                break
            assert time.monotonic() < deadline, after
            time.sleep(0.02)
        assert serve_bench.cpu_between(before, after) >= 0.25
    finally:
        parent.wait(30)


@pytest.mark.timeout(600)
def test_serve_chat_run_behind_parsers(tmp_path: Path) -> None:
    """``--chat`` with a reasoning parser and a tool-call parser: every stack started
    with both (the model's tokenizer with ``<think>`` markers, which the reasoning parser
    needs to start), streaming chat completions counted by their usage, with and without
    logprobs; without ``--chat`` the parsers are refused (they act on chat only)."""
    missing = _serve_missing()
    if missing:
        pytest.skip(missing)
    refused = bench("serve", "--reasoning-parser", "deepseek_r1", timeout=120)
    assert refused.returncode == 2 and "add --chat" in refused.stderr, refused.stderr
    out = tmp_path / "serve.json"
    proc = bench(
        "serve", "--quick", "--chat", "--reasoning-parser", "deepseek_r1",
        "--tool-call-parser", "hermes", "--clients", "vllm,corewire", "--streams", "2",
        "--logprobs", "0,2", "--max-tokens", "8", "--step-delay", "0.01",
        "--chunk-streams", "0", "--no-profile", "--json", str(out), timeout=500,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "chat  tool-call parser hermes  reasoning parser deepseek_r1" in proc.stdout
    doc = read_results(out, "serve")
    assert doc["options"]["chat"] is True
    assert doc["options"]["reasoning_parser"] == "deepseek_r1"
    assert len(doc["cases"]) == 4
    for case in doc["cases"]:
        assert case["errors"] == 0 and case["requests"] == 32
        assert case["tokens"] == 32 * 8


def test_serve_refuses_an_output_stack_that_cannot_run() -> None:
    """Asked by name, corewire+output without corewire's native output processing stops
    the run before any stack starts (exit status 2), saying why."""
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    from corewire.vllm import plugin

    # The bench names the plugin's switch without importing the plugin (it needs vLLM).
    assert serve_bench.OUTPUT_SWITCH == plugin.OUTPUT_SWITCH
    assert serve_bench.FAST_PATH_SWITCH == plugin.FAST_PATH_SWITCH
    output, fast = plugin.OUTPUT_SWITCH, plugin.FAST_PATH_SWITCH
    assert serve_bench.STACKS["corewire+output"] == ("corewire", {output: "1", fast: "0"})
    assert serve_bench.STACKS["corewire+fast"] == ("corewire", {output: "1", fast: "1"})
    # Off said explicitly: a switch left on in the caller's environment stays out.
    assert serve_bench.STACKS["corewire"] == ("corewire", {output: "0", fast: "0"})
    assert serve_bench.STACKS["vllm"] == ("vllm", {output: "0", fast: "0"})
    proc = bench(
        "serve", "--clients", "vllm,corewire+output", block=("corewire.vllm.output.processor",)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "corewire bench serve: --clients corewire+output: this corewire has no native output "
        "processing (corewire.vllm.output.processor)"
    ]
    assert "serve benchmark" not in proc.stdout


def test_serve_profile_layer_of_native_output_processing() -> None:
    """corewire's native output processing (called from corewire/vllm/output/: the
    processor and its per-release modules) is a layer of its own; vLLM's stays "output
    processing", and vLLM's decoding of logprob candidates counts as detokenization."""
    handler = (
        "_run_once (asyncio/base_events.py:1922);_run (asyncio/events.py:80);"
        "output_handler (vllm/v1/engine/async_llm.py:480)"
    )
    site = "/opt/venv/lib/python3.11/site-packages/"
    ours = f"{handler};process_outputs ({site}corewire/vllm/output/processor.py:120)"
    assert classify(ours) == NATIVE_OUTPUT_LAYER == "output processing (corewire)"
    assert classify(f"{handler};step (python/corewire/vllm/output/v0_33_0.py:40)") == (
        NATIVE_OUTPUT_LAYER
    )
    # What our path hands to vLLM's own classes is vLLM's (its RequestOutput, its stats).
    assert classify(f"{ours};__init__ ({site}vllm/outputs.py:110)") == "output processing"
    assert classify(f"{ours};record ({site}vllm/v1/metrics/loggers.py:900)") == "stats"
    vllms = f"{handler};process_outputs ({site}vllm/v1/engine/output_processor.py:600)"
    assert classify(vllms) == "output processing"
    candidates = (
        f"{vllms};update_from_output ({site}vllm/v1/engine/logprobs.py:200);"
        f"convert_ids_list_to_tokens ({site}vllm/tokenizers/detokenizer_utils.py:30);"
        f"decode ({site}transformers/tokenization_utils_base.py:3900)"
    )
    assert classify(candidates) == "detokenization"
    assert classify(f"{handler};check (corewire/vllm/outputs_probe.py:1)") != NATIVE_OUTPUT_LAYER


# ---------------------------------------------------------------------- serve: the collector

# A sample of vLLM's API server taken by py-spy --native (raw format, root first): vLLM's
# client decoding a frame, and the collector started by one of the decode's allocations.
_DECODE = (
    "_run_once (asyncio/base_events.py:1922);_run (asyncio/events.py:80);"
    "process_outputs_socket (vllm/v1/engine/core_client.py:894);"
    "decode (vllm/v1/serial_utils.py:310)"
)
_IN_GC = _DECODE + ";gc_collect_main (libpython3.11.so.1.0)"
_IN_GC_LIBC = _IN_GC + ";free (libc.so.6)"


def test_serve_profile_puts_collections_in_the_collector_layer(tmp_path: Path) -> None:
    # Inside a collection: the collector's layer, or, as sampled, the triggering layer.
    for stack in (_IN_GC, _IN_GC_LIBC):
        assert in_collection(stack)
        assert classify(stack) == COLLECTOR
        assert classify(stack, collections_apart=False) == CLIENT_LAYER
    # The same stack without the collector's frames goes where it always went.
    assert not in_collection(_DECODE)
    assert classify(_DECODE) == classify(_DECODE, collections_apart=False) == CLIENT_LAYER
    # A Python function of that name is not the collector.
    own = _DECODE + ";gc_collect_main (myapp/tools.py:12)"
    assert not in_collection(own) and classify(own) == CLIENT_LAYER
    # CPython 3.12's and 3.13's entry points, and an explicit gc.collect().
    for name in ("gc_collect_generations", "gc_collect_region", "gc_collect"):
        assert classify(f"{_DECODE};{name} (python3.12)") == COLLECTOR

    raw = tmp_path / "profile.txt"
    http = "handle (uvicorn/protocols/http/httptools_impl.py:400)"
    # Threads that wait (a worker on its queue, the gc probe in accept): py-spy --native
    # counts them as active; they are left out.
    waiting = (
        "_bootstrap (threading.py:995);_answer (corewire/bench/gc_probe.py:90);"
        "sock_accept_impl (libpython3.11.so.1.0);accept4 (libc.so.6)",
        "_bootstrap (threading.py:995);get (vllm/foo.py:1);"
        "PyThread_acquire_lock_timed (libpython3.11.so.1.0);0x7f0b854a3f16 (libc.so.6)",
    )
    assert all(is_waiting(stack) for stack in waiting)
    assert not any(is_waiting(stack) for stack in (_DECODE, _IN_GC, _IN_GC_LIBC))
    raw.write_text(f"{_IN_GC} 30\n{_DECODE} 10\n{http} 60\n{waiting[0]} 70\n{waiting[1]} 5\n")
    profile = read_profile(raw, native=True)
    assert profile.samples == 100 and profile.idle == 75
    assert profile.share(CLIENT_LAYER) == pytest.approx(0.4)
    assert profile.share(CLIENT_LAYER, collections_apart=True) == pytest.approx(0.1)
    assert profile.share(COLLECTOR, collections_apart=True) == pytest.approx(0.3)
    assert profile.share("HTTP") == profile.share("HTTP", collections_apart=True) == 0.6
    # Without native frames nothing says what a collection was: no "apart" figure at all.
    raw.write_text(f"{_IN_GC} 30\n{_DECODE} 10\n{http} 60\n")
    plain = read_profile(raw, native=False)
    assert plain.share(CLIENT_LAYER) == pytest.approx(0.4)
    assert np.isnan(plain.share(CLIENT_LAYER, collections_apart=True))


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_serve_profile_reads_a_real_native_profile(tmp_path: Path) -> None:
    """py-spy --native on a process that collects in a loop: the frames it writes for
    CPython's collector are the ones the classification looks for."""
    code = textwrap.dedent(
        """
        import gc, sys, time
        keep = [[{} for _ in range(20)] for _ in range(5000)]
        print("ready", flush=True)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            gc.collect()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        out = tmp_path / "native.txt"
        spy = subprocess.run(
            ["py-spy", "record", "--pid", str(child.pid), "--native", "--rate", "100",
             "--duration", "2", "--format", "raw", "--output", str(out)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert spy.returncode == 0, spy.stderr
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    profile = read_profile(out, native=True)
    assert profile.samples > 20
    assert profile.share(COLLECTOR, collections_apart=True) > 0.5, out.read_text()[:2000]
    assert profile.as_sampled[COLLECTOR] == 0


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_native_profiling_samples_at_the_lower_rate(tmp_path: Path) -> None:
    """``profiled(native=True)`` pauses its target NATIVE_RATE times a second, not RATE:
    about a quarter of the samples of the non-blocking mode over the same time."""
    code = "import time\nprint('ready', flush=True)\nwhile True: sum(range(1000))\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    counts = {}
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        for native in (False, True):
            out = tmp_path / f"native-{native}.txt"
            with profiled(child.pid, out, True, native=native):
                time.sleep(3)
            counts[native] = read_profile(out, native=native).samples
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert NATIVE_RATE * 4 <= RATE
    # py-spy may fall behind its rate on a loaded machine, never ahead of it.
    assert 0 < counts[True] <= NATIVE_RATE * 3 * 1.2, counts
    assert counts[False] > counts[True] * 2, counts


_GC_CHILD = textwrap.dedent(
    """
    import gc, sys
    gc.disable()  # from here on, only the collections below
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(4):
        for _ in range(1000):
            a = []; a.append(a)  # a cycle only the collector frees
        gc.collect(0)
    gc.collect(1)
    for _ in range(2):
        gc.collect(2)
    print("done", flush=True)
    sys.stdin.readline()
    """
)


def _probed_child(directory: Path, **extra_env: str) -> subprocess.Popen[str]:
    env = dict(os.environ, **gc_times.probe_env(directory), **extra_env)
    return subprocess.Popen(
        [sys.executable, "-c", _GC_CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_gc_probe_times_a_child_process(tmp_path: Path) -> None:
    """The probe, injected as the serve benchmark injects it into vLLM's API server,
    counts every collection of a real child process and writes its file on request."""
    probe = tmp_path / "probe"
    child = _probed_child(probe)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        before = gc_times.snapshot(probe, child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        after = gc_times.snapshot(probe, child.pid)
        written = probe / f"gc-{child.pid}.json"
        assert gc_times.read(written) == after
        doc = json.loads(written.read_text())
        assert doc["pid"] == child.pid and doc["process_cpu_s"] > 0

        window = after - before
        assert window.collections == (4, 1, 2)
        assert window.collected[0] >= 4000  # the cycles, freed by the young collections
        assert all(s >= 0 for s in window.cpu_s) and window.total_cpu_s > 0
        assert window.as_dict()["collections"] == [4, 1, 2]
        assert window.as_dict()["cpu_s"] == pytest.approx(window.total_cpu_s)
    finally:
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
    with pytest.raises(gc_times.GcProbeError, match="did not answer"):
        gc_times.snapshot(probe, child.pid)


def test_gc_probe_is_inert_when_off_and_keeps_another_sitecustomize(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITE = 1\n")
    env = dict(os.environ, **gc_times.probe_env(probe, base_pythonpath=str(other)))
    code = (
        "import builtins, gc, sitecustomize, threading\n"
        "print(sitecustomize.__file__, getattr(builtins, 'OTHER_SITE', 0), len(gc.callbacks),"
        " sorted(t.name for t in threading.enumerate()))"
    )
    for on in (True, False):
        if not on:
            env.pop(gc_times.ENV)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        path, other_ran, callbacks, threads = proc.stdout.split(" ", 3)
        assert Path(path) == probe / "sitecustomize.py" and other_ran == "1"
        assert int(callbacks) == (1 if on else 0)
        assert ("corewire-gc-probe" in threads) is on


def test_gc_probe_file_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "gc-1.json"
    bad.write_text('{"collections": [1, 2]}')
    with pytest.raises(gc_times.GcProbeError, match="not a gc probe file"):
        gc_times.read(bad)
    fields = {k: [0, 0] for k in ("collections", "cpu_s", "wall_s", "collected")}
    bad.write_text(json.dumps(fields))
    with pytest.raises(gc_times.GcProbeError, match="expected 3 generations"):
        gc_times.read(bad)
    start = time.monotonic()
    with pytest.raises(gc_times.GcProbeError, match="did not answer"):
        gc_times.snapshot(tmp_path, 1)
    assert time.monotonic() - start < 5
