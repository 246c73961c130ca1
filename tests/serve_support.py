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

from corewire.bench.serve import OUTPUT_SWITCH, STACKS, native_output_missing
from corewire.vllm.serve.model_dir import write_model_dir
from corewire.vllm.serve.stack import ServeStack, plugin_installed

MODEL = "corewire-tiny"
# The reference engine's defaults (vocab 4096, eos 2, pad 0); a shorter context keeps the
# long requests of the abort and kill tests bounded.
MAX_MODEL_LEN = 1024
# Every engine step sleeps this long: long requests stay in flight for seconds (abort and
# kill tests) while short greedy requests still take a fraction of a second.
STEP_DELAY = 0.01
# What corewire's plugin logs in the API server when it switches the client.
PLUGIN_LOG_LINE = "uses corewire's engine-core client"
# What it logs when it hands AsyncLLM's output processing to corewire, and what the native
# processor logs when it keeps vLLM's path for the whole server.
OUTPUT_LOG_LINE = "processes outputs with corewire"
# ... and feeds vLLM's inter-token latency histogram once per step (the same line).
FOLDED_LOG_LINE = "inter-token latencies folded into vLLM's histogram once per step"
OUTPUT_KEPT_LOG_LINE = "vLLM's output processing kept"
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


def output_missing() -> str | None:
    """Why corewire's native output processing cannot run inside vLLM here (its plugin
    switch, ``COREWIRE_VLLM_OUTPUT``), or ``None`` when it can."""
    return plugin_missing() or native_output_missing()


#: The API server settings the serve tests run: name -> (engine-core client, the API
#: server's extra environment). "corewire+output" is corewire's client with corewire's
#: native output processing (the bench's stacks of the same names).
SETTINGS: dict[str, tuple[str, dict[str, str]]] = STACKS
assert SETTINGS["corewire+output"][1][OUTPUT_SWITCH] == "1"


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
    extra_server_args: tuple[str, ...] = (),
    timeout: float = 90.0,
    restart_engines: bool = False,
    markers: tuple[str, ...] = (),
) -> Iterator[ServeStack]:
    """A started stack with its model directory and logs under ``workdir``; stopped on exit
    (``extra_server_args``: more ``vllm serve`` flags; ``restart_engines``: the stack
    starts a dead engine again; ``markers``: the model directory's marker tokens). A
    ``vocab_size`` among ``engine_overrides`` is the model directory's too."""
    vocab_size = (engine_overrides or {}).get("vocab_size", 4096)
    model_dir = write_model_dir(
        workdir / "model", max_model_len=MAX_MODEL_LEN, vocab_size=vocab_size, markers=markers
    )
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
        extra_server_args=extra_server_args,
        restart_engines=restart_engines,
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


def metric_sum(http: httpx.Client, name: str, **labels: str) -> float:
    """Prometheus metric ``name`` from ``/metrics``, summed over the samples whose labels
    include ``labels``."""
    samples = metric_values(http.get("/metrics").text, name)
    return sum(v for got, v in samples if all(got.get(k) == w for k, w in labels.items()))


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
    engine_overrides: Mapping[str, Any] | None = None,
    extra_server_args: tuple[str, ...] = (),
    still_healthy: Callable[[], bool] = lambda: True,
    markers: tuple[str, ...] = (),
    api_servers: int = 1,
) -> Iterator[ServeStack]:
    """The stack a module shares across its tests (one engine, ``client`` in the API
    server, or in each of ``api_servers``), its processes in ``shared`` while it runs. On
    leaving, unless ``still_healthy()`` says a test broke it on purpose, every test must
    have left it healthy: nothing crashed under the requests."""
    with running_stack(
        workdir,
        client=client,
        server_env=server_env,
        engine_overrides=engine_overrides,
        extra_server_args=extra_server_args,
        markers=markers,
        api_servers=api_servers,
        timeout=90.0 if api_servers == 1 else 150.0,
    ) as started:
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


#: A server of vLLM's multi-API-server layout as its log lines name it, and its process.
_API_SERVER = re.compile(r"\((ApiServer_\d+) pid=(\d+)\)")


def api_servers_saying(stack: ServeStack, line: str, count: int = 2) -> dict[str, int]:
    """The servers of ``stack``'s multi-API-server layout whose log says ``line``, by name
    (``ApiServer_0``...) with their process ids, once ``count`` of them have (or a minute
    has passed): ``/health`` answers once one server is up, while another may still be
    building its app on a loaded machine."""
    deadline = time.monotonic() + 60.0
    while True:
        said = [x for x in server_log(stack).splitlines() if line in x]
        servers = {m[1]: int(m[2]) for x in said if (m := _API_SERVER.search(x))}
        if len(servers) >= count or time.monotonic() > deadline:
            return servers
        time.sleep(0.5)


def check_two_api_servers_with_corewire_clients(tmp_path: Path) -> str:
    """``--api-server-count 2`` with the plugin on: both server processes run corewire's
    client, both answer on the one shared port, and vLLM adds up their metrics. Returns
    the servers' log."""
    with (
        running_stack(tmp_path, client="corewire", api_servers=2, timeout=150.0) as stack,
        httpx.Client(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as http,
    ):
        servers = api_servers_saying(stack, PLUGIN_LOG_LINE)
        assert sorted(servers) == ["ApiServer_0", "ApiServer_1"], server_log(stack)[-3000:]
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


# -------------------------------------------- native output processing vs vLLM's, end to end

# The /metrics series the output path feeds that must not depend on who processed the
# outputs: counters, and the histograms of token counts (exact: integers, no timing).
OUTPUT_COUNTERS = (
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
)
OUTPUT_HISTOGRAMS = ("vllm:request_generation_tokens", "vllm:request_prompt_tokens")
# Timing histograms whose observation counts do not depend on timing: one inter-token
# latency per output after a request's first (native output processing folds a step's
# latencies into the histogram at once: corewire.vllm.output.latency_histogram).
OUTPUT_OBSERVATION_COUNTS = ("vllm:inter_token_latency_seconds_count",)


def output_metrics(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The :data:`OUTPUT_COUNTERS`, :data:`OUTPUT_HISTOGRAMS` and
    :data:`OUTPUT_OBSERVATION_COUNTS` samples of /metrics, once
    two reads 0.2 s apart agree: a request's stats are recorded by vLLM's output handler
    after its last output went to the HTTP handler (a stop string's abort is awaited in
    between), so a read right after the response may come a step early."""
    names = [*OUTPUT_COUNTERS, *OUTPUT_OBSERVATION_COUNTS]
    names += [f"{h}{suffix}" for h in OUTPUT_HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")]

    def read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = http.get("/metrics").text
        return {
            (name, tuple(sorted(labels.items()))): value
            for name in names
            for labels, value in metric_values(text, name)
        }

    last = read()
    deadline = time.monotonic() + 10
    while True:
        time.sleep(0.2)
        now = read()
        if now == last:
            return now
        assert time.monotonic() < deadline, "/metrics kept changing with no request running"
        last = now


def metrics_delta(
    before: Mapping[tuple[str, tuple[tuple[str, str], ...]], float],
    after: Mapping[tuple[str, tuple[tuple[str, str], ...]], float],
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What ``after`` adds to ``before``, series by series (unchanged series left out)."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    return {key: value for key, value in delta.items() if value}


def without_ids(obj: Any) -> Any:
    """A response without the fields that differ between identical requests (the request
    id, the creation time) or servers (the fingerprint of the server's configuration)."""
    if isinstance(obj, dict):
        return {
            k: without_ids(v)
            for k, v in obj.items()
            if k not in ("id", "created", "system_fingerprint")
        }
    if isinstance(obj, list):
        return [without_ids(v) for v in obj]
    return obj


def _close(a: Any, b: Any, tolerance: float = 1e-5) -> bool:
    """Equal, floats within ``tolerance``, dict keys in the same order."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tolerance
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_close(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tolerance) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class CloseFloats(dict):  # type: ignore[type-arg]
    """An answer whose floats compare within 1e-5 (:func:`_close`): the children of an
    n > 1 request reach the engine one by one, so the batches they share, and the last
    bits of their logprobs, depend on timing (seen: 1e-7 apart between two servers)."""

    def __eq__(self, other: object) -> bool:
        return _close(dict(self), other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


def joined_completion_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed completion as one choice: text, token ids and logprobs concatenated,
    the last finish and stop reason, the usage (chunk boundaries are left out: a server
    that falls behind merges outputs into fewer chunks, whoever processed them)."""
    joined: dict[str, Any] = {"text": "", "token_ids": [], "logprobs": {}, "usage": None}
    joined |= {"finish_reason": None, "stop_reason": None, "prompt_token_ids": None}
    for event in events:
        if event.get("usage"):
            joined["usage"] = event["usage"]
        for choice in event["choices"]:
            assert choice["index"] == 0
            joined["text"] += choice["text"]
            joined["token_ids"] += choice.get("token_ids") or []
            if choice.get("prompt_token_ids"):
                joined["prompt_token_ids"] = choice["prompt_token_ids"]
            for key, values in (choice.get("logprobs") or {}).items():
                joined["logprobs"].setdefault(key, []).extend(values)
            if choice.get("finish_reason") is not None:
                joined["finish_reason"] = choice["finish_reason"]
                joined["stop_reason"] = choice.get("stop_reason")
    return joined


def joined_chat_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat completion as one message (see :func:`joined_completion_stream`)."""
    joined: dict[str, Any] = {"content": "", "logprobs": [], "token_ids": [], "usage": None}
    joined |= {"finish_reason": None, "stop_reason": None, "role": None}
    for event in events:
        if event.get("usage"):
            joined["usage"] = event["usage"]
        for choice in event["choices"]:
            delta = choice["delta"]
            joined["role"] = joined["role"] or delta.get("role")
            joined["content"] += delta.get("content") or ""
            joined["token_ids"] += choice.get("token_ids") or []
            joined["logprobs"] += (choice.get("logprobs") or {}).get("content") or []
            if choice.get("finish_reason") is not None:
                joined["finish_reason"] = choice["finish_reason"]
                joined["stop_reason"] = choice.get("stop_reason")
    return joined


def _stop_across_tokens(text: str, at: int) -> str:
    """A stop string that spans two tokens of ``text`` (words of the model directory's
    tokenizer joined by spaces): the end of word ``at``, the space, the start of the next."""
    words = text.split()
    assert len(words) > at + 1, text
    return f"{words[at][-2:]} {words[at + 1][:1]}"


def output_workload(http: httpx.Client) -> list[dict[str, Any]]:
    """Greedy requests (one seeded) through vLLM's output path, one at a time: completions
    and chat completions, plain and streamed, with 5 logprobs, prompt logprobs (echo), stop
    strings that span tokens (excluded from and included in the text), and n = 2. Each answer
    without its id and creation time (streams joined: :func:`joined_completion_stream`).
    The stop strings are cut from the first answer's text, so two servers get the same
    requests exactly when they gave the same first answer."""
    stream_usage = {"stream": True, "stream_options": {"include_usage": True}}
    base = {"prompt": "the old house on the hill", "max_tokens": 14, "temperature": 0.0}
    base |= {"ignore_eos": True, "logprobs": 5, "return_token_ids": True}
    results: list[dict[str, Any]] = []

    def plain(**body: Any) -> dict[str, Any]:
        out = without_ids(completion(http, **body))
        results.append(out)
        return out

    def streamed(
        path: str, join: Callable[[list[dict[str, Any]]], dict[str, Any]], **body: Any
    ) -> dict[str, Any]:
        joined = join(stream(http, path, **body, **stream_usage))
        results.append(joined)
        return joined

    first = plain(**base)
    text = first["choices"][0]["text"]
    assert streamed("/v1/completions", joined_completion_stream, **base)["text"] == text
    stop = _stop_across_tokens(text, 5)
    stops = ["no such text", stop]
    cut = plain(**base, stop=stops)["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop), cut
    assert cut["text"] == text[: text.index(stop)]
    streamed("/v1/completions", joined_completion_stream, **base, stop=stops)
    kept = streamed(
        "/v1/completions", joined_completion_stream, **base, stop=stops,
        include_stop_str_in_output=True,
    )  # fmt: skip
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    # Prompt logprobs (echo), and n = 2 (vLLM refuses it greedy: seeded sampling, which
    # vLLM seeds per child), which the native path may leave to vLLM's own.
    plain(**{**base, "max_tokens": 4}, echo=True)
    body = {**base, "max_tokens": 6, "temperature": 0.8}
    two = CloseFloats(without_ids(completion(http, **body, n=2, seed=1234)))
    results.append(two)
    assert [c["index"] for c in two["choices"]] == [0, 1]

    chat_base: dict[str, Any] = {
        "messages": [{"role": "user", "content": "tell me about the old house"}],
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 5,
        "return_token_ids": True,
    }
    answer = without_ids(chat(http, **chat_base))
    results.append(answer)
    content = answer["choices"][0]["message"]["content"]
    joined = streamed("/v1/chat/completions", joined_chat_stream, **chat_base)
    assert joined["content"] == content
    chat_stop = _stop_across_tokens(content, 4)
    cut_chat = without_ids(chat(http, **chat_base, stop=[chat_stop]))
    results.append(cut_chat)
    assert cut_chat["choices"][0]["finish_reason"] == "stop"
    assert cut_chat["choices"][0]["message"]["content"] == content[: content.index(chat_stop)]
    streamed("/v1/chat/completions", joined_chat_stream, **chat_base, stop=[chat_stop])
    return results


#: What each setting's output workload is compared with: only the output processing
#: differs from "corewire" to "corewire+output", only the client from "vllm" to "corewire".
OUTPUT_BASELINES = {"corewire": "vllm", "corewire+output": "corewire"}


def check_output_processing_identical(
    setting: str,
    stack: ServeStack,
    http: httpx.Client,
    tmp_path: Path,
    runs: dict[str, dict[str, Any]],
    shared: SharedPids,
) -> dict[str, Any]:
    """:func:`output_workload` on ``stack`` (the API server ``setting``), and the
    :func:`output_metrics` it added; kept in ``runs`` across the module's servers. Both
    must equal those of the setting's :data:`OUTPUT_BASELINES` entry when it ran: with
    corewire's native output processing ("corewire+output"), those of corewire's client
    with vLLM's output processing ("corewire"), which is started here when it did not run
    in this session (its processes in ``shared``). This setting's run."""
    before = output_metrics(http)
    outputs = output_workload(http)
    run = {"outputs": outputs, "metrics": metrics_delta(before, output_metrics(http))}
    # 11 requests, each finish counted (n = 2: one per child): 5 stop strings, 7 lengths.
    finished = {
        dict(labels)["finished_reason"]: v
        for (name, labels), v in run["metrics"].items()
        if name == "vllm:request_success_total"
    }
    assert finished == {"length": 7, "stop": 5}, run["metrics"]
    # Every output after a request's first is one inter-token latency, whoever counts it.
    assert any(name in OUTPUT_OBSERVATION_COUNTS for name, _ in run["metrics"]), run["metrics"]
    runs[setting] = run
    baseline = OUTPUT_BASELINES.get(setting)
    if baseline is None:
        return run
    if baseline not in runs:
        if setting != "corewire+output":
            return run  # the vLLM-client server did not run: the greedy test covers it
        client, env = SETTINGS[baseline]
        with running_stack(tmp_path, client=client, server_env=env) as other:
            pids = {p.pid for p in (other.server, *other.engines) if p}
            shared.update(pids)
            try:
                with http_client(other) as other_http:
                    before = output_metrics(other_http)
                    other_outputs = output_workload(other_http)
                    delta = metrics_delta(before, output_metrics(other_http))
                    runs[baseline] = {"outputs": other_outputs, "metrics": delta}
            finally:
                shared.difference_update(pids)
    for i, (mine, theirs) in enumerate(zip(run["outputs"], runs[baseline]["outputs"], strict=True)):
        assert mine == theirs, f"answer {i}: {first_difference(mine, theirs)}"
    assert run["metrics"] == runs[baseline]["metrics"], first_difference(
        run["metrics"], runs[baseline]["metrics"]
    )
    return run


def first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where two JSON-like values first differ, and how (for assertion messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in a or key not in b:
                return f"{where}[{key!r}] only in {'the first' if key in a else 'the second'}"
            if a[key] != b[key]:
                return first_difference(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
    return f"{where}: {a!r} != {b!r}"
