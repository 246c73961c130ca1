"""Helpers for the tests that run vLLM's API server over corewire engines.

What they need, and why a test skips without it: vLLM itself, the project's CPU platform
plugin (``pip install ./tools/vllm-cpu-platform``; without it vLLM cannot pick a platform
on a GPU-less machine), engines that can join through vLLM's handshake, and, for the cases
with corewire's client inside vLLM, corewire's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from corewire.vllm.model_dir import write_model_dir
from corewire.vllm.stack import ServeStack, plugin_installed

MODEL = "corewire-tiny"
# The reference engine's defaults (vocab 4096, eos 2, pad 0); a shorter context keeps the
# long requests of the abort and kill tests bounded.
MAX_MODEL_LEN = 1024
# Every engine step sleeps this long: long requests stay in flight for seconds (abort and
# kill tests) while short greedy requests still take a fraction of a second.
STEP_DELAY = 0.01
# What corewire's plugin logs in the API server when it switches the client.
PLUGIN_LOG_LINE = "uses corewire's engine-core client"
# A long request: all the room the context leaves, at STEP_DELAY per token (~10 s).
LONG_TOKENS = MAX_MODEL_LEN - 16
HTTP_TIMEOUT = 30.0


def missing_prerequisite() -> str | None:
    """Why the serve tests cannot run here, or ``None`` when they can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if importlib.util.find_spec("tokenizers") is None:
        return "tokenizers is not installed"
    if not any(ep.name == "corewire_cpu" for ep in entry_points(group="vllm.platform_plugins")):
        return "the CPU platform plugin is missing: pip install ./tools/vllm-cpu-platform"
    if not engine_can_join():
        return "corewire engine has no --handshake-address"
    return None


def engine_can_join() -> bool:
    """Whether ``corewire engine`` accepts ``--handshake-address`` (vLLM's start-up handshake)."""
    from corewire.engine import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    _, unknown = parser.parse_known_args(["--handshake-address", "tcp://127.0.0.1:1"])
    return not unknown


def plugin_missing() -> str | None:
    """Why corewire's client cannot run inside vLLM here, or ``None`` when it can."""
    if importlib.util.find_spec("corewire.vllm.plugin") is None:
        return "corewire.vllm.plugin does not exist yet"
    if not plugin_installed():
        return "corewire's vllm.general_plugins entry point is not installed"
    return None


def engine_args(**overrides: Any) -> dict[str, Any]:
    """Reference engine arguments shared by the serve tests."""
    args: dict[str, Any] = {
        "max_model_len": MAX_MODEL_LEN,
        "step_delay": STEP_DELAY,
        "num_threads": 1,
    }
    args.update(overrides)
    return args


@contextlib.contextmanager
def running_stack(
    workdir: Path,
    *,
    client: str,
    engines: int = 1,
    engine_overrides: Mapping[str, Any] | None = None,
    server_env: Mapping[str, str] | None = None,
    api_servers: int = 1,
    timeout: float = 90.0,
) -> Iterator[ServeStack]:
    """A started stack with its model directory and logs under ``workdir``; stopped on exit."""
    model_dir = write_model_dir(workdir / "model", max_model_len=MAX_MODEL_LEN)
    stack = ServeStack(
        model_dir,
        port=0,
        engines=engines,
        client=client,  # type: ignore[arg-type]
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        engine_args=engine_args(**(engine_overrides or {})),
        log_dir=workdir / "logs",
        server_env=server_env,
        api_servers=api_servers,
    )
    stack.start(timeout=timeout)
    try:
        yield stack
    finally:
        stack.stop()


def server_log(stack: ServeStack) -> str:
    """The API server's output so far."""
    assert stack.log_dir is not None
    return (stack.log_dir / "api-server.log").read_text(errors="replace")


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of Prometheus metric ``name`` in ``text``: ``(labels, value)`` pairs."""
    samples = []
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", re.MULTILINE)
    for labels, value in pattern.findall(text):
        pairs = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        samples.append((pairs, float(value)))
    return samples


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``data: [DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


class SharedPids(set[int]):
    """Process ids of the stacks a test module shares across tests (they outlive single
    tests on purpose); :meth:`tree` is the module's ``LEAK_ALLOWED_PIDS`` (conftest)."""

    def tree(self) -> set[int]:
        """These processes and their children."""
        pids = set()
        for pid in self:
            try:
                proc = psutil.Process(pid)
                pids.add(pid)
                pids.update(c.pid for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return pids


def completion(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """POST /v1/completions; the JSON answer of a 200."""
    resp = http.post("/v1/completions", json={"model": MODEL, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """POST /v1/chat/completions; the JSON answer of a 200."""
    resp = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    """Every event of a streamed request, up to ``[DONE]``."""
    body = {"model": MODEL, "stream": True, **body}
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read().decode()
        return list(sse_events(resp))


# The greedy requests whose outputs must not depend on the client.
GREEDY_COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "hello world the quick brown fox", "max_tokens": 12, "logprobs": 3},
    {"prompt": [10, 20, 30, 4000, 4095], "max_tokens": 16, "logprobs": 1, "ignore_eos": True},
    {"prompt": "once upon a time", "max_tokens": 8, "logprobs": 5, "echo": False},
]
GREEDY_CHATS: list[dict[str, Any]] = [
    {
        "messages": [{"role": "user", "content": "tell me a story about a red fox"}],
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 3,
    },
    {
        "messages": [
            {"role": "system", "content": "you are a good assistant"},
            {"role": "user", "content": "count to ten please"},
        ],
        "max_tokens": 6,
    },
]


def greedy_outputs(http: httpx.Client) -> list[dict[str, Any]]:
    """Text, token ids, logprobs and usage of each greedy request, plain and streamed."""
    results: list[dict[str, Any]] = []
    for body in GREEDY_COMPLETIONS:
        body = {**body, "temperature": 0.0, "return_token_ids": True}
        out = completion(http, **body)
        choice = out["choices"][0]
        events = stream(http, "/v1/completions", **body)
        streamed_text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        streamed_ids = [
            t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []
        ]
        results.append(
            {
                "text": choice["text"],
                "token_ids": choice["token_ids"],
                "logprobs": choice["logprobs"],
                "finish_reason": choice["finish_reason"],
                "usage": out["usage"],
                "streamed_text": streamed_text,
                "streamed_ids": streamed_ids,
            }
        )
    for body in GREEDY_CHATS:
        body = {**body, "temperature": 0.0, "return_token_ids": True}
        out = chat(http, **body)
        choice = out["choices"][0]
        results.append(
            {
                "text": choice["message"]["content"],
                "token_ids": choice.get("token_ids"),
                "logprobs": choice.get("logprobs"),
                "finish_reason": choice["finish_reason"],
                "usage": out["usage"],
            }
        )
    return results


# ---------------------------------------------------------------------- shared stack


def running_requests(http: httpx.Client) -> float:
    """vllm:num_requests_running, summed over engines (as the engines last reported it)."""
    return sum(v for _, v in metric_values(http.get("/metrics").text, "vllm:num_requests_running"))


async def long_requests(base_url: str, n: int, started: list[asyncio.Event]) -> list[Any]:
    """``n`` long requests, every other one streamed; each result says how it ended:
    "finished", "error event" or "cut off" (streams), the HTTP status (plain requests),
    or the name of the httpx error."""

    async def one(i: int, client: httpx.AsyncClient) -> Any:
        body = {"model": MODEL, "prompt": f"story {i}", "max_tokens": LONG_TOKENS}
        body |= {"ignore_eos": True, "temperature": 0.0}
        try:
            if i % 2:
                started[i].set()
                resp = await client.post("/v1/completions", json=body)
                return resp.status_code if resp.status_code != 200 else "finished"
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    started[i].set()
                    if line == "data: [DONE]":
                        return "finished"
                    if line.startswith("data: ") and '"error"' in line:
                        return "error event"
                return "cut off"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        return await asyncio.gather(*(one(i, client) for i in range(n)))


# corewire's health watchdog inside vLLM, made quick for the kill test: a check every
# second, an engine that does not answer within 2 s is dead.
HEALTH_ENV = {"COREWIRE_HEALTH_CHECK_INTERVAL_S": "1", "COREWIRE_HEALTH_CHECK_TIMEOUT_S": "2"}
# Interval + timeout, and slack for a loaded 2-core machine.
DEATH_NOTICED_S = 1 + 2 + 5


@contextlib.contextmanager
def shared_stack(
    workdir: Path,
    client: str,
    shared: SharedPids,
    *,
    server_env: Mapping[str, str] | None = None,
    still_healthy: Callable[[], bool] = lambda: True,
) -> Iterator[ServeStack]:
    """The stack a module shares across its tests (one engine, ``client`` in the API
    server), its processes in ``shared`` while it runs. On leaving, unless
    ``still_healthy()`` says a test broke it on purpose, every test must have left it
    healthy: nothing crashed under the requests."""
    with running_stack(workdir, client=client, server_env=server_env) as started:
        pids = {started.server.pid, *(p.pid for p in started.engines)}  # type: ignore[union-attr]
        shared.update(pids)
        try:
            yield started
            if still_healthy():
                started.check_alive()
                assert started.health() == 200
        finally:
            shared.difference_update(pids)


def http_client(stack: ServeStack) -> httpx.Client:
    """An HTTP client for ``stack``'s server (close it, or use it in ``with``)."""
    return httpx.Client(base_url=stack.base_url, timeout=HTTP_TIMEOUT)


def check_greedy_outputs_identical_across_clients(
    stack: ServeStack,
    http: httpx.Client,
    tmp_path: Path,
    greedy: dict[str, list[dict[str, Any]]],
    shared: SharedPids,
) -> list[dict[str, Any]]:
    """Same greedy requests, same text, token ids, logprobs and usage with either client
    (completions and chat, plain and streamed); ``greedy`` keeps each client's outputs
    across the module's servers. When the vLLM-client server did not run in this session
    (a run of the corewire parameter alone), a vLLM-client stack is started here to
    compare with (its processes in ``shared``). This client's outputs."""
    results = greedy_outputs(http)
    for res in results[: len(GREEDY_COMPLETIONS)]:
        assert res["token_ids"], "no tokens generated"
        assert res["streamed_text"] == res["text"]
        assert res["streamed_ids"] == res["token_ids"]
        assert res["usage"]["completion_tokens"] == len(res["token_ids"])
        assert len(res["logprobs"]["token_logprobs"]) == len(res["token_ids"])
    # A token-id prompt with ignore_eos runs to max_tokens.
    assert results[1]["finish_reason"] == "length"
    greedy[stack.client] = results
    if stack.client == "vllm":
        return results
    if "vllm" not in greedy:
        with running_stack(tmp_path, client="vllm") as other:
            pids = {p.pid for p in (other.server, *other.engines) if p}
            shared.update(pids)
            try:
                with http_client(other) as client:
                    greedy["vllm"] = greedy_outputs(client)
            finally:
                shared.difference_update(pids)
    assert results == greedy["vllm"]
    return results


async def kill_engine_under_load(
    stack: ServeStack, n: int = 6, on_kill: Callable[[], None] = lambda: None
) -> list[Any]:
    """SIGKILL of the stack's engine while ``n`` long requests (every other one streamed)
    are in flight (``on_kill`` runs just before): each request's ending (as
    :func:`long_requests`), all within :data:`DEATH_NOTICED_S` of the kill, and /health
    turns unhealthy within that time too."""
    started = [asyncio.Event() for _ in range(n)]
    task = asyncio.ensure_future(long_requests(stack.base_url, n, started))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    await asyncio.sleep(0.5)  # the non-streamed ones reached the engine too
    assert stack.health() == 200
    on_kill()
    killed_at = time.monotonic()
    os.kill(stack.engines[0].pid, signal.SIGKILL)
    results = await asyncio.wait_for(task, 45)
    errors_after = time.monotonic() - killed_at
    assert errors_after < DEATH_NOTICED_S, f"errors came {errors_after:.1f} s after the kill"
    while (status := stack.health()) == 200:
        assert time.monotonic() - killed_at < DEATH_NOTICED_S, "/health stayed 200"
        await asyncio.sleep(0.2)
    assert status is None or status >= 500
    return results


# ------------------------------------------------ checks shared by the serve tests of each vLLM


def check_greedy_tokens_and_logprobs_are_the_engines(stack: ServeStack, http: httpx.Client) -> None:
    """What the HTTP answer carries is what the engine sampled: the same greedy tokens and
    sampled-token logprobs as the reference engine stepped in this process, and the text is
    those tokens decoded by the model directory's tokenizer (joined by spaces)."""
    from client_support import request
    from corewire.engine import ReferenceEngine

    prompt = [10, 20, 30, 4000, 4095]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    choice = completion(http, **body, logprobs=0, return_token_ids=True)["choices"][0]

    engine = ReferenceEngine(device="cpu", max_model_len=MAX_MODEL_LEN)
    try:
        engine.add_request(request("r", 12, prompt=prompt, sampling={"logprobs": 0}))
        token_ids: list[int] = []
        logprobs: list[float] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                token_ids += out.new_token_ids
                logprobs += [float(row[0]) for row in out.new_logprobs.logprobs]
    finally:
        engine.shutdown()
    assert choice["token_ids"] == token_ids
    # The engine process may run torch with another thread count: not bit-identical.
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    tokenizer = json.loads((stack.model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    words = {i: w for w, i in tokenizer.items()}
    assert choice["text"].split() == [words[t] for t in token_ids]


def check_health_and_models(stack: ServeStack, http: httpx.Client) -> None:
    """/health answers 200 with an empty body; /v1/models lists the served model."""
    resp = http.get("/health")
    assert resp.status_code == 200
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def check_completion_logprobs_plain_and_streamed(stack: ServeStack, http: httpx.Client) -> None:
    """Top-k logprobs: k entries per token, the sampled (greedy: most likely) token among
    them with its own logprob, and the same values in the stream."""
    body = {"prompt": "the sun and the moon", "max_tokens": 10, "temperature": 0.0}
    body |= {"logprobs": 4, "ignore_eos": True}
    choice = completion(http, **body)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 10
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert 4 <= len(top) <= 5  # the sampled token is added when outside the top k
        assert top[token] == logprob <= 0.0
        assert logprob == max(top.values())  # greedy
    assert "".join(lp["tokens"]).replace(" ", "") == choice["text"].replace(" ", "")
    events = stream(http, "/v1/completions", **body)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert chunks[-1]["finish_reason"] == "length"


def check_chat_top_logprobs_plain_and_streamed(stack: ServeStack, http: httpx.Client) -> None:
    """Chat completions, plain and streamed, with top_logprobs; the stream adds up."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hello , what is your name ?"}],
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = chat(http, **body)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] > 0
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    events = stream(http, "/v1/chat/completions", **body)
    deltas = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    assert text == choice["message"]["content"]
    streamed = [c for d in deltas if d.get("logprobs") for c in d["logprobs"]["content"]]
    assert streamed == content
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]


def check_stop_string(stack: ServeStack, http: httpx.Client) -> None:
    """A stop string ends the text before it (the front-end matches it and aborts the
    request in the engine): finish_reason "stop" with the string as stop_reason."""
    body = {"prompt": "i like the blue sea", "max_tokens": 16, "temperature": 0.0}
    body["ignore_eos"] = True
    full = completion(http, **body)["choices"][0]["text"]
    words = full.split()
    assert len(words) == 16
    stop = " " + words[8]
    cut = full.find(stop)
    assert cut >= 0
    out = completion(http, **body, stop=[stop])
    choice = out["choices"][0]
    assert choice["text"] == full[:cut]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert out["usage"]["completion_tokens"] < 16


def check_client_disconnect_aborts_in_engine(stack: ServeStack, http: httpx.Client) -> None:
    """A client that hangs up mid-stream: the engine drops the request (ABORT).

    The long request would run ~10 s. After the disconnect, a short request's last
    output carries the engine's own count of running requests, which /metrics shows:
    0 once the engine aborted the long one, 1 if it were still generating for nobody.
    """
    started = time.monotonic()
    body = {"model": MODEL, "prompt": "write a long poem", "stream": True, "ignore_eos": True}
    body |= {"max_tokens": LONG_TOKENS, "temperature": 0.0}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
        for _ in range(3):
            next(events)
    # The response is closed: the server sees the disconnect on its next write.
    deadline = started + LONG_TOKENS * STEP_DELAY * 0.6
    while True:
        completion(http, prompt="hi", max_tokens=2, temperature=0.0)
        if running_requests(http) == 0:
            break
        assert time.monotonic() < deadline, "the engine still runs the abandoned request"
        time.sleep(0.2)


def check_metrics(stack: ServeStack, http: httpx.Client) -> None:
    """/metrics counts the requests and tokens that went through the engine."""
    before = metric_values(http.get("/metrics").text, "vllm:generation_tokens_total")
    completion(http, prompt="one two three", max_tokens=5, temperature=0.0, ignore_eos=True)
    text = http.get("/metrics").text
    after = metric_values(text, "vllm:generation_tokens_total")
    assert sum(v for _, v in after) - sum(v for _, v in before) == 5
    length = [
        v
        for labels, v in metric_values(text, "vllm:request_success_total")
        if labels.get("finished_reason") == "length"
    ]
    assert sum(length) >= 1
    assert {labels.get("engine") for labels, _ in after} == {"0"}


def check_metrics_prompt_tokens(stack: ServeStack, http: httpx.Client) -> None:
    """vLLM counts prompt tokens from the prefill_stats of each request's first output."""
    before = metric_values(http.get("/metrics").text, "vllm:prompt_tokens_total")
    completion(http, prompt="one two three", max_tokens=2, temperature=0.0)
    after = metric_values(http.get("/metrics").text, "vllm:prompt_tokens_total")
    assert sum(v for _, v in after) - sum(v for _, v in before) == 3


def check_corewire_metrics_in_vllms_metrics(stack: ServeStack, http: httpx.Client) -> None:
    """With the plugin on, corewire's client metrics appear in vLLM's own /metrics (the
    default registry) and count the messages of a request; with vLLM's client, none."""
    text = http.get("/metrics").text
    before = metric_values(text, "corewire_frames_received_total")
    if stack.client != "corewire":
        assert "corewire_" not in text
        return
    completion(http, prompt="one two three", max_tokens=5, temperature=0.0, ignore_eos=True)
    text = http.get("/metrics").text
    after = metric_values(text, "corewire_frames_received_total")
    assert {labels.get("engine") for labels, _ in after} == {"0"}
    # At least one message per generated token came through corewire's decoder.
    assert sum(v for _, v in after) - sum(v for _, v in before) >= 5
    outputs = metric_values(text, "corewire_outputs_received_total")
    assert sum(v for _, v in outputs) >= 5
    for name in (
        "corewire_decode_seconds_count",
        "corewire_output_backlog",
        "corewire_pending_utility_calls",
    ):
        assert metric_values(text, name), name


def check_two_engines_behind_one_front_end(tmp_path: Path, client: str) -> str:
    """DP = 2 behind one API server with ``client``: vLLM's coordinator and two corewire
    engines; 8 concurrent requests reach both engines, with the same greedy text. Returns
    the API server's log."""
    with (
        running_stack(tmp_path, client=client, engines=2) as stack,
        httpx.Client(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as http,
    ):
        body = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0.0}
        body["ignore_eos"] = True

        async def burst() -> list[str]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as c:
                resps = await asyncio.gather(
                    *(c.post("/v1/completions", json={"model": MODEL, **body}) for _ in range(8))
                )
            assert all(r.status_code == 200 for r in resps)
            return [r.json()["choices"][0]["text"] for r in resps]

        texts = asyncio.run(burst())
        assert len(set(texts)) == 1
        gen = metric_values(http.get("/metrics").text, "vllm:request_success_total")
        per_engine: dict[str, float] = {}
        for labels, v in gen:
            per_engine[labels["engine"]] = per_engine.get(labels["engine"], 0) + v
        assert per_engine.get("0", 0) > 0 and per_engine.get("1", 0) > 0, per_engine
        assert sum(per_engine.values()) == 8
        return server_log(stack)


def check_two_api_servers_with_corewire_clients(tmp_path: Path) -> str:
    """``--api-server-count 2`` with the plugin on: both server processes run corewire's
    client, both answer on the one shared port, and vLLM adds up their metrics. Returns
    the servers' log."""
    with (
        running_stack(tmp_path, client="corewire", api_servers=2, timeout=150.0) as stack,
        httpx.Client(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as http,
    ):
        switched = [line for line in server_log(stack).splitlines() if PLUGIN_LOG_LINE in line]
        servers = {line.split(" pid=")[0] for line in switched if "(ApiServer_" in line}
        assert servers == {"(ApiServer_0", "(ApiServer_1"}, switched
        body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.0}

        async def burst() -> list[Any]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as c:
                return await asyncio.gather(
                    *(c.post("/v1/completions", json={"model": MODEL, **body}) for _ in range(8))
                )

        resps = asyncio.run(burst())
        assert [r.status_code for r in resps] == [200] * 8
        assert len({r.json()["choices"][0]["text"] for r in resps}) == 1
        assert http.get("/health").status_code == 200
        # vLLM aggregates the servers' metrics (prometheus multiprocess mode).
        done = metric_values(http.get("/metrics").text, "vllm:request_success_total")
        assert sum(v for _, v in done) == 8, done
        return server_log(stack)
