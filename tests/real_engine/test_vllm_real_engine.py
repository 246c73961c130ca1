"""corewire's client against vLLM's own client, both over vLLM's *real* engine core.

Two ``vllm serve`` servers on vLLM's CPU build, each with its own real ``EngineCore`` and the
same tiny llama (real random weights from one seed): one keeps vLLM's engine-core client,
the other runs corewire's (``COREWIRE_VLLM_CLIENT=1``). Everything a user can see must be
the same on both, ids and timestamps aside: completions and chat completions, plain and
streamed, with logprobs, prompt logprobs, stop strings and stop token ids, n > 1, seeds,
``include_usage``; the development utilities (sleep and wake up, prefix-cache reset,
``collective_rpc`` by name); LoRA adapters (one from the start, one loaded and unloaded
while the server runs); ``/metrics`` counts; a client that hangs up mid-stream (the
engine drops the request); and, last, an engine SIGKILLed mid-stream (the same error
answer and the same server state afterwards). The shutdown of corewire's server leaves no
traceback in its log.

Where the answers come from a sampled request, the seed makes them the same; floats of
n > 1 compare within 1e-5 (the children share batches by timing). Runs where vLLM's CPU
build is installed (``scripts/test`` runs it in that build's cached venv, where its absence
fails instead of skipping).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

import httpx  # noqa: E402

from real_engine_support import (  # noqa: E402
    LORA_RANK,
    RealEngineServer,
    one_server_per_client,
    write_lora_adapter,
    write_real_model,
)
from serve_support import (  # noqa: E402
    MODEL,
    PLUGIN_LOG_LINE,
    CloseFloats,
    SharedPids,
    completion,
    first_difference,
    metrics_delta,
    output_metrics,
    output_workload,
    running_requests,
    sse_events,
    stream,
    without_ids,
)

_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree
#: The LoRA adapter the servers start with, and the one loaded and unloaded while running.
STATIC_LORA, LOADED_LORA = "tiny-lora", "tiny-lora-loaded"
#: The adapters' directories, once the module's servers are set up.
_LORAS: dict[str, Path] = {}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RealEngineServer]]:
    """One real-engine server per client, started side by side, shared by the module."""
    root = tmp_path_factory.mktemp("real-engine")
    model_dir = write_real_model(root / "model")
    _LORAS["static"] = write_lora_adapter(root / "lora-static", model_dir, seed=1)
    _LORAS["loaded"] = write_lora_adapter(root / "lora-loaded", model_dir, seed=2)
    lora_args = (
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", str(LORA_RANK),
        "--lora-modules", f"{STATIC_LORA}={_LORAS['static']}",
    )  # fmt: skip
    # /v1/load_lora_adapter and /v1/unload_lora_adapter: the engine's add and remove.
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with one_server_per_client(model_dir, root, _SHARED_PIDS, args=lora_args, env=env) as made:
        yield made


def _http(server: RealEngineServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120.0)


def _on_both(servers: dict[str, RealEngineServer], work: Any) -> dict[str, Any]:
    """``work(http)`` on each server in turn; its results by client."""
    results = {}
    for name, server in servers.items():
        with _http(server) as http:
            results[name] = work(http)
    return results


def test_the_plugin_switched_only_the_corewire_server(
    servers: dict[str, RealEngineServer],
) -> None:
    assert PLUGIN_LOG_LINE in servers["corewire"].log()
    assert PLUGIN_LOG_LINE not in servers["vllm"].log()


def _more_requests(http: httpx.Client) -> list[Any]:
    """What :func:`output_workload` leaves out: prompts as token ids, stop token ids,
    min_tokens, seeded top-k / top-p sampling, chat with include_usage streamed."""
    base = {"max_tokens": 10, "temperature": 0.0, "return_token_ids": True}
    answers: list[Any] = []
    first = completion(http, prompt=[5, 17, 99, 300, 1000], **base, logprobs=2)
    answers.append(without_ids(first))
    ids = first["choices"][0]["token_ids"]
    # A stop token id the greedy answer reaches at its fourth token.
    answers.append(without_ids(completion(http, prompt=[5, 17, 99, 300, 1000], **base,
                                          stop_token_ids=[ids[3]])))  # fmt: skip
    answers.append(without_ids(completion(http, prompt="a red fox", **base, min_tokens=6)))
    sampled = {"temperature": 0.9, "top_k": 20, "top_p": 0.8, "seed": 7, "max_tokens": 12}
    answers.append(without_ids(completion(http, prompt="the blue sea", **sampled, logprobs=3)))
    events = stream(
        http,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "say hello"}],
        max_tokens=8,
        temperature=0.0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    answers.append([without_ids(e) for e in events if e.get("usage") or e["choices"]])
    return answers


def test_every_answer_and_metric_is_vllms(servers: dict[str, RealEngineServer]) -> None:
    def work(http: httpx.Client) -> dict[str, Any]:
        before = output_metrics(http)
        answers = output_workload(http) + _more_requests(http)
        return {"answers": answers, "metrics": metrics_delta(before, output_metrics(http))}

    runs = _on_both(servers, work)
    mine, theirs = runs["corewire"], runs["vllm"]
    assert len(mine["answers"]) == len(theirs["answers"]) == 16
    for i, (a, b) in enumerate(zip(mine["answers"], theirs["answers"], strict=True)):
        assert CloseFloats(a) == b if isinstance(a, dict) else a == b, (
            f"answer {i}: {first_difference(a, b)}"
        )
    assert mine["metrics"] == theirs["metrics"], first_difference(
        mine["metrics"], theirs["metrics"]
    )
    finished = {
        dict(labels)["finished_reason"]: count
        for (name, labels), count in mine["metrics"].items()
        if name == "vllm:request_success_total"
    }
    assert finished.get("stop", 0) >= 6 and finished.get("length", 0) >= 7, finished


def _utilities(http: httpx.Client) -> list[Any]:
    """The development endpoints that reach the engine through the client's utility
    calls, in an order that exercises each state: their status codes and answers."""
    calls = [
        ("POST", "/reset_prefix_cache", None),
        ("GET", "/is_sleeping", None),
        ("POST", "/sleep?level=1", None),
        ("GET", "/is_sleeping", None),
        ("POST", "/wake_up", None),
        ("GET", "/is_sleeping", None),
        ("POST", "/collective_rpc", {"method": "check_health"}),
        # A call the CPU worker fails (NotImplementedError), and one it does not know.
        ("POST", "/collective_rpc", {"method": "get_cache_block_size_bytes"}),
        ("POST", "/collective_rpc", {"method": "no_such_method"}),
        ("POST", "/reset_mm_cache", None),
    ]
    seen: list[Any] = []
    for method, path, body in calls:
        # A connection of its own: after a 500 the server closes the one it answered on.
        resp = httpx.request(method, f"{http.base_url}{path}", json=body, timeout=120.0)
        try:
            content: Any = resp.json()
        except ValueError:
            content = resp.text
        seen.append((path, resp.status_code, content))
    # The engine still serves after the round trip through sleep.
    out = completion(http, prompt="hello there", max_tokens=4, temperature=0.0)
    seen.append(("after", out["choices"][0]["text"]))
    return seen


def test_utility_endpoints_answer_as_under_vllms_client(
    servers: dict[str, RealEngineServer],
) -> None:
    runs = _on_both(servers, _utilities)
    assert runs["corewire"] == runs["vllm"], first_difference(runs["corewire"], runs["vllm"])
    # Not vacuous: the calls reached the engine and some succeeded.
    assert any(status == 200 for _, status, *_ in runs["vllm"][:-1])


def _lora_requests(http: httpx.Client) -> dict[str, Any]:
    """The same greedy request on the base model, on the adapter the server started with,
    on one loaded at run time (the engine's ``add_lora``), and on that one after it is
    unloaded (``remove_lora``); what ``/v1/models`` lists on the way."""
    body = {"prompt": "the old house on the hill", "max_tokens": 10, "temperature": 0.0}
    body |= {"logprobs": 2, "ignore_eos": True}

    def models() -> list[str]:
        return sorted(m["id"] for m in http.get("/v1/models").json()["data"])

    seen: dict[str, Any] = {"base": without_ids(completion(http, **body))}
    seen["static"] = without_ids(completion(http, **body, model=STATIC_LORA))
    loaded = {"lora_name": LOADED_LORA, "lora_path": str(_LORAS["loaded"])}
    seen["load"] = http.post("/v1/load_lora_adapter", json=loaded).status_code
    seen["models loaded"] = models()
    seen["loaded"] = without_ids(completion(http, **body, model=LOADED_LORA))
    unload = http.post("/v1/unload_lora_adapter", json={"lora_name": LOADED_LORA})
    seen["unload"] = unload.status_code
    seen["models unloaded"] = models()
    gone = http.post("/v1/completions", json={**body, "model": LOADED_LORA})
    seen["after unload"] = gone.status_code
    return seen


def test_lora_adapters_answer_as_under_vllms_client(
    servers: dict[str, RealEngineServer],
) -> None:
    runs = _on_both(servers, _lora_requests)
    assert runs["corewire"] == runs["vllm"], first_difference(runs["corewire"], runs["vllm"])
    seen = runs["corewire"]
    assert (seen["load"], seen["unload"], seen["after unload"]) == (200, 200, 404), seen
    assert LOADED_LORA in seen["models loaded"] and LOADED_LORA not in seen["models unloaded"]
    # Not vacuous: each adapter changed the answer (the engine applied it).
    texts = {k: seen[k]["choices"][0]["text"] for k in ("base", "static", "loaded")}
    assert len(set(texts.values())) == 3, texts


def _hang_up(http: httpx.Client) -> float:
    """A long stream cut after its third event; how many requests the engine still runs
    once it settled (it reports each step's count)."""
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for i, _ in enumerate(sse_events(resp)):
            if i == 2:
                break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # A short request makes the engine step and report its counts again.
        completion(http, prompt="hi", max_tokens=1)
        if running_requests(http) == 0:
            return 0.0
        time.sleep(0.5)
    return running_requests(http)


def test_a_client_that_hangs_up_is_aborted_in_the_engine(
    servers: dict[str, RealEngineServer],
) -> None:
    runs = _on_both(servers, _hang_up)
    assert runs == {"vllm": 0.0, "corewire": 0.0}


def _kill_engine_mid_stream(server: RealEngineServer) -> dict[str, Any]:
    """SIGKILL the engine core while a stream runs; what the caller and the server show."""
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True}
    events: list[dict[str, Any]] = []
    ended = "finished"
    with _http(server) as http:
        try:
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                for event in sse_events(resp):
                    events.append(event)
                    if len(events) == 3:
                        engines = server.engine_processes()
                        assert len(engines) == 1, engines
                        engines[0].kill()
                    if "error" in event:
                        ended = "error event"
        except (httpx.HTTPError, AssertionError) as exc:
            ended = f"cut off ({type(exc).__name__})"
    error = next((e["error"] for e in events if "error" in e), None)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.health() == 200:
        time.sleep(0.5)
    # Unhealthy: 503 while the server shuts down, or nothing once it is gone (which of the
    # two a poll meets is timing).
    healthy = server.health() == 200
    if server.process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # still running: an answer too
            server.process.wait(60)
    exited = server.process is not None and server.process.poll() is not None
    return {
        "ended": ended,
        "error": {k: v for k, v in (error or {}).items() if k != "message"},
        "tokens_before_the_error": len(events) > 3,
        "healthy_after": healthy,
        "server_exited": exited,
        "exit_status": server.process.returncode if server.process is not None else None,
    }


def test_an_engine_killed_mid_stream_ends_as_under_vllms_client(
    servers: dict[str, RealEngineServer],
) -> None:
    seen = {name: _kill_engine_mid_stream(server) for name, server in servers.items()}
    assert seen["corewire"] == seen["vllm"], seen
    # Not vacuous: the stream was cut, and the server noticed.
    assert seen["vllm"]["ended"] != "finished" and not seen["vllm"]["healthy_after"]


def test_no_traceback_in_corewires_server_log_at_shutdown(tmp_path: Path) -> None:
    # A server of its own, stopped as a user stops it (the module's two were killed).
    model = write_real_model(tmp_path / "model")
    server = RealEngineServer(model, tmp_path / "corewire.log", client="corewire")
    with server:
        with _http(server) as http:
            assert completion(http, prompt="hello", max_tokens=2)["choices"]
        _SHARED_PIDS.update(server.pids())
    _SHARED_PIDS.clear()
    assert server.process is not None and server.process.returncode == 0, server.log_tail()
    log = server.log()
    assert PLUGIN_LOG_LINE in log
    assert "Traceback" not in log, log[log.index("Traceback") :][:3000]
    assert "process object is closed" not in log
