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

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

import httpx  # noqa: E402

from real_engine_support import RealEngineServer, write_real_model  # noqa: E402
from serve_support import MODEL, completion, metric_values, sse_events  # noqa: E402

pytestmark = pytest.mark.timeout(900)

STREAMS = 8


def _stream(
    server: RealEngineServer, i: int, seen: dict[int, int], out: dict[int, dict[str, Any]]
) -> None:
    """Stream one long completion; ``seen[i]``: its events so far, ``out[i]``: its end."""
    body = {"model": MODEL, "prompt": f"a long story {i}", "max_tokens": 400}
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


def _held_by_engine(server: RealEngineServer) -> dict[str, float]:
    """The requests each engine holds, running or waiting, by its ``engine`` label, as the
    server's ``/metrics`` says (vLLM's gauges, set from every step's stats)."""
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        text = http.get("/metrics").text
    held: dict[str, float] = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        for labels, value in metric_values(text, name):
            engine = labels.get("engine", "")
            held[engine] = held.get(engine, 0.0) + value
    return held


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
        # when the kill lands, however fast a quiet machine streams the running ones.
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
        # Both engines busy (streams under way, and each engine holding requests by its
        # own count: the router may have given one engine fewer, which it can finish
        # before the others stream), then one engine dies.
        deadline = time.monotonic() + 120
        while True:
            held = _held_by_engine(server) if len([n for n in seen.values() if n >= 3]) >= 4 else {}
            if len(held) == 2 and min(held.values()) >= 1:
                break
            assert time.monotonic() < deadline, (seen, ended, held, server.log_tail())
            time.sleep(0.1)
        engines[1].kill()
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
