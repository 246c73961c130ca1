"""One of vLLM's real DP engines SIGKILLed under ``vllm serve`` with corewire's client.

``vllm serve --data-parallel-size 2 --api-server-count 1`` on vLLM's CPU build: the API
server launches both engine cores (vLLM's launcher owns them; corewire's client watches
their processes). A dense model's DP engines are independent in vLLM (each runs as a DP
group of one), so ``engine_loss`` applies; vLLM's launcher owns the processes, so the
default ``"replace"`` isolates. Killed mid-load: the streams on the lost engine end with
vLLM's error event, the others finish, the server stays healthy and answers new requests
on the engine left, and ``/metrics`` shows the degraded group.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

import httpx  # noqa: E402
import psutil  # noqa: E402

from real_engine_support import RealEngineServer, write_real_model  # noqa: E402
from serve_support import MODEL, completion, metric_values, sse_events  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# Ten requests per engine, two running at once, as long as the model's context allows:
# on a quiet machine the engines ran so far ahead of the streams that, with six
# requests of 400 tokens each, the victim held one left when four streams had shown
# their first event.
STREAMS = 20
MAX_TOKENS = 500


def _stream(
    server: RealEngineServer, i: int, seen: dict[int, int], out: dict[int, dict[str, Any]]
) -> None:
    """Stream one long completion; ``seen[i]``: its events so far, ``out[i]``: its end."""
    body = {"model": MODEL, "prompt": f"a long story {i}", "max_tokens": MAX_TOKENS}
    body |= {"ignore_eos": True, "temperature": 0.0, "stream": True}
    events: list[dict[str, Any]] = []
    try:
        with (
            httpx.Client(base_url=server.base_url, timeout=300.0) as http,
            http.stream("POST", "/v1/completions", json=body) as resp,
        ):
            for event in sse_events(resp):
                events.append(event)
                seen[i] = len(events)
    except httpx.HTTPError as exc:
        out[i] = {"ended": f"cut off ({type(exc).__name__})", "events": len(events)}
        return
    if any("error" in e for e in events):
        out[i] = {"ended": "error event", "events": len(events)}
        return
    last = [c for e in events for c in e.get("choices", ())][-1]
    out[i] = {"ended": last.get("finish_reason"), "events": len(events)}


def _cpu_seconds(processes: list[Any]) -> float:
    """CPU time the processes (an engine core and its workers) have used so far."""
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def _first_busy(engines: list[Any], deadline: float, why: Any) -> Any:
    """The first of the engines seen busy in a short interval (it used a fifth of it on
    the CPU, where an idle one uses a hundredth): it is stepping requests, and at its
    first busy interval nearly all of its requests' tokens are yet to be made.

    Read from the engines, not from the streams or ``/metrics``: vLLM's CPU engine steps
    far ahead of what the API server has streamed (all of a request's tokens can be made
    before its client has read half), and ``/metrics`` answers in seconds on a loaded
    server, so either read let the victim finish its requests before the kill. Nor both
    engines busy at once: on 2 loaded cores a CI run never saw that in two minutes while
    every stream ran to its end. An interval that ran long (this process starved of a
    core) is not read: the engine may have been busy early in it and done by its end.
    """
    groups = [[e, *e.children(recursive=True)] for e in engines]
    interval = 0.05
    before, then = [_cpu_seconds(g) for g in groups], time.monotonic()
    while True:
        time.sleep(interval)
        now, at = [_cpu_seconds(g) for g in groups], time.monotonic()
        if at - then < 0.5:
            for engine, a, b in zip(engines, before, now, strict=True):
                if b - a >= interval / 5:
                    return engine
        assert at < deadline, why()
        before, then = now, at


def _metric(server: RealEngineServer, name: str) -> float:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        return sum(value for _, value in metric_values(http.get("/metrics").text, name))


def test_one_engine_killed_mid_load_leaves_the_server_answering(tmp_path: Path) -> None:
    model = write_real_model(tmp_path / "model")
    server = RealEngineServer(
        model,
        tmp_path / "corewire.log",
        client="corewire",
        # Two running per engine, the rest queued: the lost engine still holds requests
        # when the kill lands.
        args=("--data-parallel-size", "2", "--api-server-count", "1", "--max-num-seqs", "2"),
    )
    with server:
        engines = server.engine_processes()
        assert len(engines) == 2, engines
        ended: dict[int, dict[str, Any]] = {}
        seen: dict[int, int] = {}
        threads = [
            threading.Thread(target=_stream, args=(server, i, seen, ended)) for i in range(STREAMS)
        ]
        for thread in threads:
            thread.start()
        # Once four streams are under way (two running per engine, eight more queued on
        # each: an engine can be busy before any request reaches it, and killed then it
        # held none), an engine computing dies.
        deadline = time.monotonic() + 120
        while len(seen) < 4:
            assert time.monotonic() < deadline, ("streams never began", seen, server.log_tail())
            time.sleep(0.02)
        victim = _first_busy(
            engines,
            time.monotonic() + 120,
            lambda: ("no engine seen busy", seen, ended, server.log_tail()),
        )
        victim.kill()
        for thread in threads:
            thread.join(300)
        outcomes = sorted(e["ended"] for e in ended.values())
        print("streams ended:", outcomes)
        # The lost engine's streams end with vLLM's error event; the others run to their end.
        assert set(outcomes) == {"error event", "length"}, (outcomes, server.log_tail())
        assert server.health() == 200
        with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
            for i in range(4):
                assert completion(http, prompt=f"after {i}", max_tokens=4)["choices"]
        assert _metric(server, "corewire_engine_losses_total") == 1
        assert _metric(server, "corewire_engines_serving") == 1
        log = server.log()
        isolated = r"engine \d lost .* it stays out of routing \(vLLM's launcher owns it"
        assert re.search(isolated, log), log[-3000:]
