"""The per-token fast path of ``vllm serve`` (``corewire.vllm.fast_path``) against vLLM's
own server, over real HTTP.

Two stacks of the serve tests (``vllm serve`` front-end only, one reference engine): vLLM's
own (its client, its output processing, its serving code) and corewire's with the fast
path (``corewire+fast``: corewire's client, native output processing, and the chunks of
streaming completions after the first written natively). Both get the same seeded random
workloads of streaming completions, one request at a time, and every SSE event must be the
same text, byte for byte, but for the request id, the creation time and the server's
fingerprint: the options the fast path covers (sample logprobs, echo with and without them,
n > 1, stop strings and stop token ids, usage, min_tokens, seeded sampling, per-request stream
intervals...) and those that stay on vLLM's path (logprob_token_ids, continuous usage, token
ids). Directed tests
cover the edges: a client that hangs up mid-stream, an engine that dies mid-stream, a
fallback said in the log, and the counters that show which path ran.

The engine steps every 30 ms, so that neither server falls a step behind on this 2-core
machine (a server that falls behind merges two steps into one chunk, in either stack); a
request whose events still differ is sent to both again, up to three times in all, since a
real difference shows on every try.

Runs where the installed vLLM is one the fast path is held to (0.33.0, 0.34.0: ``scripts/test``
runs it in that release's venv, where anything missing fails instead of skipping).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from corewire.bench.serve import fast_path_missing
from serve_support import missing_prerequisite, plugin_missing


def _missing() -> str | None:
    return missing_prerequisite() or plugin_missing() or fast_path_missing()


_MISSING = _missing()
if _MISSING is not None:
    if _REQUIRED := os.environ.get("COREWIRE_REQUIRE_VLLM"):
        from corewire.vllm.plugin import FAST_PATH_VLLM_VERSIONS

        if _REQUIRED in FAST_PATH_VLLM_VERSIONS:
            raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={_REQUIRED}: {_MISSING}")
    pytest.skip(_MISSING, allow_module_level=True)

import httpx  # noqa: E402

from corewire.vllm.fast_path import INSTALLED_LOG_LINE, envs_cache  # noqa: E402
from corewire.vllm.fast_path.asgi_cycle import DIRECT_ROUTE_LOG_LINE  # noqa: E402
from corewire.vllm.serve.stack import ServeStack  # noqa: E402
from fast_path_features import FEATURES, Feature, semantic  # noqa: E402
from serve_support import (  # noqa: E402
    HEALTH_ENV,
    LONG_TOKENS,
    MODEL,
    SETTINGS,
    SharedPids,
    api_servers_saying,
    check_client_disconnect_aborts_in_engine,
    completion,
    http_client,
    metric_values,
    running_requests,
    server_log,
    shared_stack,
)

_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree

#: A workload's run on one server: each request, and the events it got.
Run = list[tuple[dict[str, Any], list[str]]]
#: The engine's step for this module (see the module doc).
STEP_DELAY = 0.03
#: Words of the model directory's tokenizer, for random prompts.
WORDS = [
    "the",
    "old",
    "house",
    "on",
    "hill",
    "blue",
    "sea",
    "tell",
    "me",
    "a",
    "story",
    "about",
    "red",
    "fox",
    "count",
    "to",
    "ten",
]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServeStack]]:
    """vLLM's own stack and corewire's with the fast path, both running."""
    started: dict[str, ServeStack] = {}
    with (
        _stack("vllm", tmp_path_factory) as started["vllm"],
        _stack("corewire+fast", tmp_path_factory) as started["corewire+fast"],
    ):
        yield started


def _stack(
    setting: str,
    factory: Any,
    extra_server_args: tuple[str, ...] = (),
    vocab_size: int = 4096,
    markers: tuple[str, ...] = (),
) -> Any:
    client, env = SETTINGS[setting]
    workdir = factory.mktemp(f"fast-{setting.replace('+', '-')}")
    return shared_stack(
        workdir,
        client,
        _SHARED_PIDS,
        server_env=env,
        engine_overrides={"step_delay": STEP_DELAY, "vocab_size": vocab_size},
        extra_server_args=extra_server_args,
        markers=markers,
    )


_ID = re.compile(r'"id":"[^"]*"')
_CREATED = re.compile(r'"created":\d+')
_FINGERPRINT = re.compile(r'"system_fingerprint":"[^"]*"')
# A usage chunk's per-request metrics (--enable-per-request-metrics): timings, flat.
_METRICS = re.compile(r'"metrics":\{[^{}]*\}')
_NUMBER = re.compile(r":-?[0-9][0-9.eE+-]*")


def normalized(data: str) -> str:
    """An event's JSON text with the request id, the creation time, the fingerprint and
    the per-request metrics' timings (what differs between identical requests, or
    servers) replaced."""
    data = _ID.sub('"id":"-"', data)
    data = _CREATED.sub('"created":0', data)
    data = _METRICS.sub(lambda m: _NUMBER.sub(":0", m.group()), data)
    return _FINGERPRINT.sub('"system_fingerprint":"-"', data)


def raw_events(
    http: httpx.Client, body: dict[str, Any], path: str = "/v1/completions"
) -> list[str]:
    """Every ``data:`` payload of a streamed completion (or, by ``path``, chat
    completion), as the server wrote it (:func:`normalized`), ``[DONE]`` included."""
    events = []
    with http.stream("POST", path, json={"model": MODEL, **body}) as resp:
        assert resp.status_code == 200, resp.read().decode()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(normalized(line[len("data: ") :]))
    assert events and events[-1] == "[DONE]", events[-3:]
    return events


#: Options that keep a request on vLLM's path, each with what it asks.
FALLBACKS: list[dict[str, Any]] = [
    {"logprobs": 1, "logprob_token_ids": [5, 6]},
]


def random_requests(seed: int, http: httpx.Client, count: int) -> Iterator[dict[str, Any]]:
    """``count`` streaming completions drawn from ``seed``. Stop strings and stop token ids
    are cut from the request's own answer without them (asked of ``http`` first: the same on
    both servers, as the comparison of the streams then shows); the draws do not depend on
    the answers, so both servers get the same requests exactly when they gave the same
    answers."""
    rng = random.Random(seed)
    for _ in range(count):
        body: dict[str, Any] = {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 10))),
            "max_tokens": rng.randint(1, 20),
            "temperature": 0.0,
            "ignore_eos": rng.random() < 0.7,
            "stream": True,
        }
        if rng.random() < 0.3:
            body |= {"temperature": 0.9, "seed": rng.randint(0, 2**31)}
            if rng.random() < 0.4:
                body["n"] = rng.randint(2, 3)
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
            if rng.random() < 0.3:
                # Every chunk carries the running usage, the sample's tokens so far.
                body["stream_options"]["continuous_usage_stats"] = True
        if rng.random() < 0.2:
            body["min_tokens"] = rng.randint(0, body["max_tokens"])
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.25:
            # With logprobs too: the echo's chunk carries the prompt's, then the sample's.
            body["echo"] = True
        if rng.random() < 0.15:
            # The one value vLLM streams: each prompt token's own logprob (an echo's).
            body["prompt_logprobs"] = 0
        if rng.random() < 0.25:
            # Each chunk's token ids, the first's the prompt's too (an echo's text then
            # leaves the prompt out).
            body["return_token_ids"] = True
        if rng.random() < 0.2:
            # vLLM 0.34.0's per-request stream interval: chunks of several tokens.
            body["stream_interval"] = rng.randint(2, 4)
        cut, kind, include = rng.random(), rng.random(), rng.random() < 0.5
        fallback = FALLBACKS[rng.randrange(len(FALLBACKS))] if rng.random() < 0.25 else {}
        if cut < 0.4:
            plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            answer = completion(http, **(plain | {"return_token_ids": True}))["choices"][0]
            ids, text = answer["token_ids"], answer["text"]
            at = int(cut / 0.4 * len(ids))
            if kind < 0.5 and len(text) > 2:
                start = min(int(kind * 2 * len(text)), len(text) - 2)
                body["stop"] = ["never in the text", text[start : start + 2]]
                body["include_stop_str_in_output"] = include
            elif ids:
                body["stop_token_ids"] = [ids[min(at, len(ids) - 1)]]
        yield body | fallback


def _run(http: httpx.Client, seed: int, count: int) -> Run:
    return [(body, raw_events(http, body)) for body in random_requests(seed, http, count)]


#: Options that keep a chat request on vLLM's path.
CHAT_FALLBACKS: list[dict[str, Any]] = [
    {"logprobs": True, "logprob_token_ids": [5, 6]},
]


def random_chats(seed: int, http: httpx.Client, count: int) -> Iterator[dict[str, Any]]:
    """``count`` streaming chat completions drawn from ``seed`` (stop strings cut from the
    answer without them, as :func:`random_requests` does)."""
    rng = random.Random(seed)
    for _ in range(count):
        turns = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))}]
        if rng.random() < 0.3:
            turns.insert(0, {"role": "system", "content": "you are a good assistant"})
        echo = rng.random() < 0.3
        if echo and rng.random() < 0.6:
            # An answer begun in the assistant's role: echo sends it back first.
            turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=3))})
        body: dict[str, Any] = {
            "messages": turns,
            "max_tokens": rng.randint(1, 20),
            "temperature": 0.0,
            "ignore_eos": rng.random() < 0.7,
            "stream": True,
        }
        if echo:
            body["echo"] = True
        if rng.random() < 0.3:
            body |= {"temperature": 0.9, "seed": rng.randint(0, 2**31)}
            if rng.random() < 0.4:
                body["n"] = rng.randint(2, 3)
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
            if rng.random() < 0.3:
                # Every chunk carries the running usage (not on the fast path beside a
                # reasoning parser, whose count it would show).
                body["stream_options"]["continuous_usage_stats"] = True
        if rng.random() < 0.2:
            body["stream_interval"] = rng.randint(2, 4)
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": rng.choice([0, 1, 2, 5])}
        if rng.random() < 0.25:
            # The role chunks carry the prompt's token ids, the others their own.
            body["return_token_ids"] = True
        cut, include = rng.random(), rng.random() < 0.5
        fallback = CHAT_FALLBACKS[rng.randrange(len(CHAT_FALLBACKS))] if rng.random() < 0.25 else {}
        if cut < 0.3:
            plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            resp = http.post("/v1/chat/completions", json={"model": MODEL, **plain})
            assert resp.status_code == 200, resp.text
            message = resp.json()["choices"][0]["message"]
            # Under a reasoning parser the text may all be reasoning.
            content = message["content"] or message.get("reasoning") or ""
            if len(content) > 2:
                start = min(int(cut / 0.3 * len(content)), len(content) - 2)
                body["stop"] = [content[start : start + 2]]
                body["include_stop_str_in_output"] = include
        yield body | fallback


def _run_chats(http: httpx.Client, seed: int, count: int) -> Run:
    return [
        (body, raw_events(http, body, path="/v1/chat/completions"))
        for body in random_chats(seed, http, count)
    ]


def fast_path_counts(http: httpx.Client) -> dict[str, float]:
    """The fast path's counters in ``/metrics``: requests per path, and tokens."""
    text = http.get("/metrics").text
    counts = {
        labels["path"]: value
        for labels, value in metric_values(text, "corewire_fast_path_requests_total")
    }
    tokens = metric_values(text, "corewire_fast_path_tokens_total")
    counts["tokens"] = tokens[0][1] if tokens else 0.0
    return counts


@pytest.mark.parametrize(
    ("endpoint", "seed"),
    [("completions", 1), ("completions", 2), ("completions", 3), ("chat", 11), ("chat", 12)],
)
def test_random_workload_same_events_as_vllms_server(
    stacks: dict[str, ServeStack], endpoint: str, seed: int
) -> None:
    """Seeded random streaming completions (12 a seed) or chat completions (10): every
    event the same text as vLLM's own server wrote, and the fast path taken by every
    request it covers (the others, carrying one of the endpoint's fallbacks, by vLLM's
    code)."""
    run, count, fallbacks, path = {
        "completions": (_run, 12, FALLBACKS, "/v1/completions"),
        "chat": (_run_chats, 10, CHAT_FALLBACKS, "/v1/chat/completions"),
    }[endpoint]
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        before = fast_path_counts(mine)
        expected = run(theirs, seed, count)
        got = run(mine, seed, count)
        sent = assert_same_runs(got, expected, mine, theirs, path)
        # A fallback's options are merged last into a request, so they show as they are;
        # every send of a request (retries included) takes the same path.
        kept = [
            any(all(body.get(k) == v for k, v in f.items()) for f in fallbacks) for body, _ in got
        ]
        took, want = paths_taken(mine, before, sent, kept)
    assert took == want, (before, sent)


def paths_taken(
    mine: httpx.Client, before: dict[str, float], sent: list[int], kept: list[bool]
) -> tuple[dict[str, int], dict[str, int]]:
    """The requests per path the fast path's server counted since ``before``, and those
    it should have: each request sent ``sent[i]`` times, on vLLM's path where ``kept``."""
    want = {
        "fast": sum(n for n, k in zip(sent, kept, strict=True) if not k),
        "vllm": sum(n for n, k in zip(sent, kept, strict=True) if k),
    }
    # A request's count lands just after its last chunk, which a loaded machine can
    # deliver first: read until every send is counted (or the time is up).
    deadline = time.monotonic() + 15
    while True:
        after = fast_path_counts(mine)
        took = {path: int(after.get(path, 0) - before.get(path, 0)) for path in want}
        if sum(took.values()) >= sum(want.values()) or time.monotonic() > deadline:
            return took, want
        time.sleep(0.1)


def test_server_stream_interval_same_events_as_vllms_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Both servers started with ``--stream-interval 3`` and per-request metrics: seeded
    random completions and chat completions, every event the same text (chunks of three
    tokens, written natively after the first), and the usage chunk's metrics for one
    sample only, as vLLM sends them."""
    args = ("--stream-interval", "3", "--enable-per-request-metrics")
    with (
        _stack("vllm", tmp_path_factory, args) as vllm_stack,
        _stack("corewire+fast", tmp_path_factory, args) as fast_stack,
        http_client(vllm_stack) as theirs,
        http_client(fast_stack) as mine,
    ):
        before = fast_path_counts(mine)
        expected = _run(theirs, 21, 8)
        got = _run(mine, 21, 8)
        assert_same_runs(got, expected, mine, theirs, "/v1/completions")
        expected = _run_chats(theirs, 22, 4)
        got = _run_chats(mine, 22, 4)
        assert_same_runs(got, expected, mine, theirs, "/v1/chat/completions")
        usage: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        usage |= {"max_tokens": 7, "temperature": 0.8, "seed": 3, "ignore_eos": True}
        for path, n in [
            (p, n) for p in ("/v1/completions", "/v1/chat/completions") for n in (1, 2)
        ]:
            body = usage | {"n": n}
            body |= (
                {"prompt": "the old house"}
                if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "the old house"}]}
            )
            got_events, expected_events, _ = side_by_side(
                theirs, mine, lambda h, b=body, p=path: per_choice(b, raw_events(h, b, p))
            )
            assert got_events == expected_events, (path, n)
            groups = [got_events] if isinstance(got_events, list) else got_events.values()
            metrics = any('"metrics":{' in event for group in groups for event in group)
            assert metrics == (n == 1), (path, n, got_events)
        after = fast_path_counts(mine)
    assert after["tokens"] > before["tokens"]


#: A tool the tool-call parser servers' requests offer the model.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def tool_chats(seed: int, http: httpx.Client, count: int) -> Iterator[dict[str, Any]]:
    """:func:`random_chats` for a server with a tool-call parser: some offer a tool with
    ``tool_choice: "none"``, some let the model call it (``auto``, the default with
    tools)."""
    rng = random.Random(seed + 1000)
    for body in random_chats(seed, http, count):
        draw = rng.random()
        if draw < 0.3:
            body |= {"tools": [WEATHER_TOOL], "tool_choice": "none"}
        elif draw < 0.5:
            body |= {"tools": [WEATHER_TOOL]}
        yield body


def parser_kept(body: dict[str, Any], reasoning: bool = False) -> bool:
    """Whether a chat request to a server with a parser (``reasoning``: a reasoning parser
    among them) stays on vLLM's path: it may call tools (with tools and no tool_choice,
    vLLM's default is "auto"), carries one of the endpoint's fallbacks (logprobs take the
    fast path there too), or asks for running usage beside a reasoning parser."""
    continuous = (body.get("stream_options") or {}).get("continuous_usage_stats", False)
    return (
        ("tools" in body and body.get("tool_choice") != "none")
        or any(all(body.get(k) == v for k, v in f.items()) for f in CHAT_FALLBACKS)
        or (reasoning and continuous)
    )


@contextlib.contextmanager
def parser_servers(
    factory: Any, args: tuple[str, ...], vocab_size: int, markers: tuple[str, ...] = ()
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """vLLM's stack and the fast path's, both started with the server flags ``args`` (a
    parser's, or others) and a model of ``vocab_size`` tokens with ``markers``: an HTTP
    client for each."""
    with (
        _stack("vllm", factory, args, vocab_size, markers) as vllm_stack,
        _stack("corewire+fast", factory, args, vocab_size, markers) as fast_stack,
        http_client(vllm_stack) as theirs,
        http_client(fast_stack) as mine,
    ):
        yield theirs, mine


def same_tool_chats(
    theirs: httpx.Client, mine: httpx.Client, seed: int, reasoning: bool = False
) -> Run:
    """14 seeded :func:`tool_chats` on both parser servers (``reasoning``: with a reasoning
    parser): every event the same text, those that :func:`parser_kept` on vLLM's path, the
    others on the fast path, some of their tokens written natively. The fast path's run."""
    path = "/v1/chat/completions"
    before = fast_path_counts(mine)
    expected = [(b, raw_events(theirs, b, path)) for b in tool_chats(seed, theirs, 14)]
    got = [(b, raw_events(mine, b, path)) for b in tool_chats(seed, mine, 14)]
    sent = assert_same_runs(got, expected, mine, theirs, path)
    kept = [parser_kept(body, reasoning) for body, _ in got]
    took, want = paths_taken(mine, before, sent, kept)
    tokens = fast_path_counts(mine)["tokens"] - before.get("tokens", 0)
    assert took == want, (before, sent)
    assert want["fast"] and want["vllm"] and tokens > 0
    return got


def test_tool_parser_server_same_events_as_vllms_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Both servers started with a tool-call parser (``--enable-auto-tool-choice
    --tool-call-parser hermes``, which vLLM runs on every stream), over a vocabulary of 16
    whose special quarter adds no text: the parser sends nothing for such an output, and
    neither do the native frames (the case where a classic tool parser's stream differs
    from a plain server's; text passing through is held for every registered parser in
    test_fast_path_parsers.py). Seeded random chat completions (:func:`same_tool_chats`),
    then a long one with fewer content chunks than tokens, and the same with logprobs,
    where vLLM sends such an output's logprobs under an empty delta (Python renders those
    outputs; the frames write the rest)."""
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    path = "/v1/chat/completions"
    with parser_servers(tmp_path_factory, args, 16) as (theirs, mine):
        same_tool_chats(theirs, mine, 31)
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body, path))
        logprobs_body = body | {"logprobs": True, "top_logprobs": 2}
        with_logprobs, logprobs_expected, logprobs_added = side_by_side(
            theirs, mine, lambda h: raw_events(h, logprobs_body, path)
        )
        ids_body = body | {"return_token_ids": True}
        with_ids, ids_expected, ids_added = side_by_side(
            theirs, mine, lambda h: raw_events(h, ids_body, path)
        )
        # Without the reasoning, vLLM hides the ids as the logprobs (its hide_metadata).
        hidden_body = ids_body | {"include_reasoning": False}
        hidden, hidden_expected, hidden_added = side_by_side(
            theirs, mine, lambda h: raw_events(h, hidden_body, path)
        )
    assert got == expected, _first_difference(got, expected)
    assert added["fast"] == added["tries"] and added["tokens"] > 0
    usage = json.loads(got[-2])["usage"]
    content = [e for e in got if '"delta":{"content"' in e and '"finish_reason":null' in e]
    assert usage["completion_tokens"] == 60
    assert 0 < len(content) < 59, len(content)
    assert with_logprobs == logprobs_expected, _first_difference(with_logprobs, logprobs_expected)
    assert logprobs_added["fast"] == logprobs_added["tries"] and logprobs_added["tokens"] > 0
    empty = [e for e in with_logprobs if '"delta":{},"logprobs":{"content":[' in e]
    # Every token's logprobs are sent, an output of no text's in an empty delta (counted
    # over the stream, not per chunk: a loaded server may merge two steps into one).
    positions = [
        len((choice.get("logprobs") or {}).get("content") or [])
        for event in with_logprobs[:-1]
        for choice in json.loads(event).get("choices", [])
    ]
    assert empty and sum(positions) == 60, (len(empty), positions)
    # With token ids, likewise: an output of no text gets an empty delta with its ids.
    assert with_ids == ids_expected, _first_difference(with_ids, ids_expected)
    assert ids_added["fast"] == ids_added["tries"] and ids_added["tokens"] > 0
    ids = [json.loads(event)["choices"] for event in with_ids[:-2]]
    assert sum(len(choices[0]["token_ids"]) for choices in ids[1:]) == 60
    assert any(
        '"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[' in e for e in with_ids
    )
    assert hidden == hidden_expected, _first_difference(hidden, hidden_expected)
    assert hidden_added["fast"] == hidden_added["tries"] and hidden_added["tokens"] > 0
    assert json.loads(hidden[0])["prompt_token_ids"]
    assert all(c.get("token_ids") is None for e in hidden[1:-2] for c in json.loads(e)["choices"])


@pytest.mark.parametrize("vocab_size", [4096, 16])
def test_reasoning_parser_server_same_events_as_vllms_server(
    tmp_path_factory: pytest.TempPathFactory, vocab_size: int
) -> None:
    """Both servers started with DeepSeek-R1's reasoning parser and a tool-call parser
    (``--reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser
    hermes``), the model's tokenizer with ``<think>`` and ``</think>``: seeded random chat
    completions (:func:`same_tool_chats`: reasoning chunks, the switch to content, usage
    with its reasoning tokens). With 4096 tokens the markers are rare and a stream is
    reasoning throughout; with 16, an eighth of the tokens are markers."""
    args = ("--reasoning-parser", "deepseek_r1")
    args += ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    markers = ("<think>", "</think>")
    with parser_servers(tmp_path_factory, args, vocab_size, markers) as (theirs, mine):
        got = same_tool_chats(theirs, mine, 41, reasoning=True)
    events = [e for _, run in got for e in run]
    assert any('"delta":{"reasoning"' in e for e in events)
    assert any('"reasoning_tokens"' in e for e in events)


#: Tries of one request on both servers before their events must agree: a server that
#: falls a step behind (a pause of the loaded machine) merges two steps into one chunk,
#: which says nothing of the bytes each writes; a real difference shows on every try.
ATTEMPTS = 3


def side_by_side(
    theirs: httpx.Client, mine: httpx.Client, fetch: Callable[[httpx.Client], Any]
) -> tuple[Any, Any, dict[str, float]]:
    """``fetch`` on vLLM's server and on the fast path's, tried again (up to
    :data:`ATTEMPTS`) while the answers differ: the fast path's answer, vLLM's, and what
    the last try added to the fast path's counters (``"tries"``: how many it took)."""
    tries = 0
    while tries < ATTEMPTS:
        tries += 1
        before = fast_path_counts(mine)
        expected = fetch(theirs)
        got = fetch(mine)
        after = fast_path_counts(mine)
        if got == expected:
            break
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return got, expected, delta | {"tries": tries}


def assert_same_runs(
    mine: Run, theirs: Run, mine_http: httpx.Client, theirs_http: httpx.Client, path: str
) -> list[int]:
    """Two servers' runs of one workload: the same requests (drawn from the same answers)
    and, request by request, the same events (:func:`per_choice`), a request whose events
    differ sent again to both (:func:`side_by_side`). How many times each request was sent
    to the fast path's server in all."""
    sent = []
    for i, ((body, events), (my_body, my_events)) in enumerate(zip(theirs, mine, strict=True)):
        assert body == my_body, f"request {i}: the answers without streaming differ"
        got, expected = per_choice(body, my_events), per_choice(body, events)
        tries = 0
        if got != expected:
            got, expected, added = side_by_side(
                theirs_http, mine_http, lambda h, b=body: per_choice(b, raw_events(h, b, path))
            )
            tries = int(added["tries"])
        sent.append(1 + tries)
        assert got == expected, f"request {i} {body}: {_first_difference(got, expected)}"
    return sent


_INDEX = re.compile(r'"choices":\[\{"index":(\d+)')


def per_choice(body: dict[str, Any], events: list[str]) -> list[str] | dict[str, list[str]]:
    """The events to compare: as they came, or for n > 1 each choice's in order (the
    children reach the engine one by one, so how their chunks interleave depends on
    timing, on either server)."""
    if body.get("n", 1) == 1:
        return events
    choices: dict[str, list[str]] = {}
    for event in events:
        match = _INDEX.search(event)
        choices.setdefault(match.group(1) if match else "-", []).append(event)
    return choices


def _first_difference(mine: Any, theirs: Any) -> str:
    if isinstance(mine, dict):
        return f"per choice: {mine} != {theirs}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return f"event {i}:\n  fast path {a}\n  vLLM      {b}"
    return f"{len(mine)} events against {len(theirs)}"


@pytest.mark.parametrize(
    ("logprobs", "interval", "tokens"),
    [(None, 1, 60), (5, 1, 60), (3, 4, 31)],
    ids=["plain", "logprobs", "logprobs-interval"],
)
def test_long_stream_is_written_natively(
    stacks: dict[str, ServeStack], logprobs: int | None, interval: int, tokens: int
) -> None:
    """A long stream, with and without logprobs, and with a stream interval whose last
    wait ends in the engine's finish (the positions kept for the waiting frame go to
    vLLM's finish): the same events as vLLM's server, and the tokens between the first
    chunk and the finish's counted as written natively."""
    body = {"prompt": "the old house", "max_tokens": tokens, "temperature": 0.0}
    body |= {"logprobs": logprobs, "stream_interval": interval, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body))
    assert got == expected, _first_difference(got, expected)
    # The first token's chunk is Python's; frames of `interval` tokens follow while a
    # whole one fits before the last token, whose chunk (the finish) is Python's too.
    assert added["tokens"] == interval * ((tokens - 2) // interval)
    assert added["fast"] == 1


@pytest.mark.parametrize("tokens", [0, 1, 40])
def test_echo_with_logprobs_is_written_natively(stacks: dict[str, ServeStack], tokens: int) -> None:
    """A completion that echoes its prompt with logprobs: the same events as vLLM's
    server (the first chunk's logprobs over the prompt, its first position without one,
    then over the first token; for no tokens, the prompt alone), and a long stream's tokens
    after the first written natively, their text offsets counted on from the prompt's."""
    prompt = "the old house on the hill"
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    body |= {"echo": True, "logprobs": 3, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body))
    assert got == expected, _first_difference(got, expected)
    assert added["fast"] == 1
    first = json.loads(got[0])["choices"][0]
    assert first["text"].startswith(prompt)
    assert first["logprobs"]["token_logprobs"][0] is None
    if tokens < 40:
        assert added["tokens"] == 0
        return
    # The first token's chunk and the finish are Python's, the tokens between native.
    assert added["tokens"] == tokens - 2
    offsets = [json.loads(e)["choices"][0]["logprobs"]["text_offset"][0] for e in got[1:4]]
    assert len(prompt) < offsets[0] < offsets[1] < offsets[2], offsets


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": 2, "stream_interval": 3}, {"echo": True}],
    ids=["plain", "logprobs-interval", "echo"],
)
def test_return_token_ids_is_written_natively(
    stacks: dict[str, ServeStack], extra: dict[str, Any]
) -> None:
    """A streamed completion with ``return_token_ids``, plain, with logprobs and a stream
    interval, and with echo: the same events as vLLM's server (the first chunk with the
    prompt's token ids, an echo's text without the prompt), the tokens between the first
    chunk and the finish written natively, each chunk's ids the tokens it carries."""
    tokens = 40
    body: dict[str, Any] = {"prompt": "the old house on the hill", "max_tokens": tokens}
    body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}, **extra}
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body))
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        whole = completion(mine, **plain)
    assert got == expected, _first_difference(got, expected)
    assert added["fast"] == 1
    interval = extra.get("stream_interval", 1)
    assert added["tokens"] == interval * ((tokens - 2) // interval)
    choices = [json.loads(e)["choices"][0] for e in got[:-1] if json.loads(e)["choices"]]
    assert choices[0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    if extra.get("echo"):
        assert not choices[0]["text"].startswith("the old house")
    if "logprobs" in extra:
        assert all(len(c["token_ids"]) == len(c["logprobs"]["tokens"]) for c in choices)


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": 2, "return_token_ids": True, "stream_interval": 3}, {"n": 2}],
    ids=["plain", "logprobs-ids-interval", "two-samples"],
)
def test_continuous_usage_is_written_natively(
    stacks: dict[str, ServeStack], extra: dict[str, Any]
) -> None:
    """A streamed completion with ``continuous_usage_stats``, plain, with logprobs, token
    ids and a stream interval, and of two samples: the same events as vLLM's server, every
    chunk's usage the sample's tokens so far, and the tokens between each sample's first
    chunk and its finish written natively."""
    tokens = 40
    body: dict[str, Any] = {"prompt": "the old house on the hill", "max_tokens": tokens}
    body |= {"temperature": 0.0, "ignore_eos": True, "stream": True}
    body |= {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if "n" in extra:
        body |= {"temperature": 0.9, "seed": 4}
    body |= extra
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(
            theirs, mine, lambda h: per_choice(body, raw_events(h, body))
        )
    assert got == expected, _first_difference(got, expected)
    assert added["fast"] == 1
    samples, interval = extra.get("n", 1), extra.get("stream_interval", 1)
    events = [e for e in (got.values() if isinstance(got, dict) else [got]) for e in e]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    for index in range(samples):
        of_sample = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in of_sample]
        assert counts[0] >= 1 and counts[-1] == tokens, counts
        assert counts == sorted(counts)
        assert all(
            c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
            for c, n in zip(of_sample, counts, strict=True)
        )
    if samples == 1:
        assert added["tokens"] == interval * ((tokens - 2) // interval)
    else:
        # As for any request of several samples: most of their tokens are the frames'.
        most = samples * (tokens - 2)
        assert most // 2 <= added["tokens"] <= most, added


def test_chat_continuous_usage_is_written_natively(stacks: dict[str, ServeStack]) -> None:
    """A streamed chat with ``continuous_usage_stats``, echo and token ids: the same events
    as vLLM's server (the role and echo chunks with no completion tokens yet, every later
    chunk's usage the tokens so far), and the tokens between the first content chunk and
    the finish written natively."""
    tokens = 30
    turns = [{"role": "user", "content": "tell me a story"}]
    turns.append({"role": "assistant", "content": "once upon a"})
    body: dict[str, Any] = {"messages": turns, "max_tokens": tokens, "temperature": 0.0}
    body |= {"ignore_eos": True, "echo": True, "return_token_ids": True, "stream": True}
    body |= {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    path = "/v1/chat/completions"
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body, path))
    assert got == expected, _first_difference(got, expected)
    assert added["fast"] == 1
    assert added["tokens"] == tokens - 2
    chunks = [json.loads(e) for e in got[:-2]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[:2] == [0, 0] and counts[-1] == tokens, counts
    # Each later chunk's count moves on by the tokens it carries (however many steps a
    # busy server merged into it).
    carried = [len(c["choices"][0]["token_ids"]) for c in chunks[2:]]
    assert counts[2:] == [sum(carried[: k + 1]) for k in range(len(carried))], counts


def test_force_include_usage_server_takes_the_fast_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Both servers started with ``--enable-force-include-usage`` (every stream carries its
    usage, running usage included, whatever the request asks) and
    ``--enable-prompt-tokens-details`` (the usage shows the cached prompt tokens): a
    completion's and a chat's events the same as vLLM's server's, on the fast path, their
    tokens between the first chunk and the finish written natively."""
    tokens = 30
    base: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    base["stream"] = True
    requests = [
        ("/v1/completions", base | {"prompt": "the old house on the hill"}),
        ("/v1/chat/completions", base | {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    args = ("--enable-force-include-usage", "--enable-prompt-tokens-details")
    with parser_servers(tmp_path_factory, args, 4096) as (theirs, mine):
        for path, body in requests:
            got, expected, added = side_by_side(
                theirs, mine, lambda h, b=body, p=path: raw_events(h, b, p)
            )
            assert got == expected, (path, _first_difference(got, expected))
            assert added["fast"] == 1 and added["tokens"] == tokens - 2, (path, added)
            assert all('"usage":{' in event for event in got[:-1]), path
            assert '"prompt_tokens_details":{' in got[-2], path


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_prompt_logprobs_zero_is_written_natively(
    stacks: dict[str, ServeStack], path: str
) -> None:
    """A streamed completion or chat with ``prompt_logprobs: 0`` (the engine computes the
    prompt's logprobs, which no chunk shows without echo): the same events as vLLM's
    server, and the tokens between the first chunk and the finish written natively."""
    tokens = 40
    body: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    body |= {"prompt_logprobs": 0, "stream": True}
    if path == "/v1/completions":
        body |= {"prompt": "the old house on the hill", "logprobs": 2}
    else:
        body |= {"messages": [{"role": "user", "content": "tell me a story"}]}
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body, path))
    assert got == expected, _first_difference(got, expected)
    assert added["fast"] == 1
    assert added["tokens"] == tokens - 2


@pytest.mark.parametrize("top", [0, 2])
def test_chat_echo_with_logprobs_is_written_natively(
    stacks: dict[str, ServeStack], top: int
) -> None:
    """A chat that echoes its last message with logprobs (vLLM then asks the engine for
    the prompt's logprobs too, which no chunk shows): the same events as vLLM's server,
    and the tokens between the first token's chunk and the finish written natively."""
    body = {
        "messages": [
            {"role": "user", "content": "tell me a story"},
            {"role": "assistant", "content": "once upon a"},
        ],
        "max_tokens": 30,
        "temperature": 0.0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": True,
        "top_logprobs": top,
        "stream": True,
    }
    path = "/v1/chat/completions"
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body, path))
    assert got == expected, _first_difference(got, expected)
    # The role's chunk, then the echo's.
    assert json.loads(got[1])["choices"][0]["delta"]["content"] == "once upon a"
    assert added["fast"] == 1
    assert added["tokens"] == 30 - 2


@pytest.mark.parametrize(
    ("path", "logprobs"),
    [("/v1/completions", None), ("/v1/completions", 2), ("/v1/chat/completions", 2)],
)
def test_samples_of_one_request_are_written_natively(
    stacks: dict[str, ServeStack], path: str, logprobs: int | None
) -> None:
    """A long stream of three samples (``n`` = 3), completion or chat, with and without
    logprobs: each sample's events the same as vLLM's server's, and the samples' tokens
    between their first chunks and their finishes written natively."""
    samples, tokens = 3, 40
    body: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.9, "seed": 4}
    body |= {"n": samples, "ignore_eos": True, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body |= {"prompt": "the old house", "logprobs": logprobs}
    else:
        body |= {"messages": [{"role": "user", "content": "the old house"}]}
        body |= {"logprobs": True, "top_logprobs": logprobs}
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(
            theirs, mine, lambda h: per_choice(body, raw_events(h, body, path))
        )
    assert got == expected, _first_difference(got, expected)
    # Each sample's first chunk and finish are Python's, and while a sibling's output
    # needs Python (its first, one step later), outputs of the same step go with it; a
    # sample attaches only once every chunk yielded is on the wire, which a loaded
    # machine delays: most of the tokens, not all, are the frames'.
    most = samples * (tokens - 2)
    assert most // 2 <= added["tokens"] <= most, added
    assert added["fast"] == 1


@pytest.mark.parametrize(("top", "interval"), [(0, 1), (3, 1), (2, 4)])
def test_long_chat_stream_with_logprobs_is_written_natively(
    stacks: dict[str, ServeStack], top: int, interval: int
) -> None:
    """A long chat stream with logprobs (no candidates, three, and two with a stream
    interval of 4): the same events as vLLM's server, its chat logprobs objects (tokens,
    logprobs, UTF-8 bytes, top candidates) written natively between the first chunk and
    the finish."""
    body = {
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 40,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": top,
        "stream_interval": interval,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    path = "/v1/chat/completions"
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: raw_events(h, body, path))
    assert got == expected, _first_difference(got, expected)
    assert added["tokens"] == interval * ((40 - 2) // interval)
    assert added["fast"] == 1
    content = json.loads(got[2])["choices"][0]["logprobs"]["content"]
    assert len(content) == interval and len(content[0]["top_logprobs"]) == top


def test_fallback_is_said_once_in_the_log(stacks: dict[str, ServeStack]) -> None:
    """A request the fast path does not cover (logprobs of given token ids) is served by
    vLLM's code, and the server's log says why, once however many such requests come."""
    body = {"prompt": "count to ten", "max_tokens": 3, "temperature": 0.0, "stream": True}
    with http_client(stacks["corewire+fast"]) as mine:
        for _ in range(3):
            raw_events(mine, {**body, "logprobs": 1, "logprob_token_ids": [5, 6]})
    log = server_log(stacks["corewire+fast"])
    reason = "streaming completion stays on vLLM's path: logprob_token_ids"
    said = [line for line in log.splitlines() if reason in line]
    assert len(said) == 1, said
    # And that the fast path is on at all, once vLLM's logging is up, and vLLM's
    # environment variables are read once (vLLM's own stack reads them on every access).
    assert log.count(INSTALLED_LOG_LINE) == 1, log[-3000:]
    assert log.count(envs_cache.CACHED_LOG_LINE) == 1, log[-3000:]
    assert envs_cache.CACHED_LOG_LINE not in server_log(stacks["vllm"])


#: Requests to the direct routes' paths and beside them, as ``(method, path, content
#: type, body)``: answers streamed and whole, and each refusal the app answers (bodies that
#: are not JSON, null, empty, of another content type or invalid for the model; a model
#: the server does not serve; another method; a path the router redirects).
_ROUTED = ("/v1/completions", "/v1/chat/completions")
_JSON = "application/json"
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}
DIRECT_REQUESTS: list[tuple[str, str, str, bytes]] = [
    (m, p, t, json.dumps(b).encode() if isinstance(b, dict) else b)
    for m, p, t, b in [
        ("POST", _ROUTED[0], _JSON, {"model": MODEL, "prompt": "the old house", "stream": True}),
        ("POST", _ROUTED[0], _JSON, {"model": MODEL, "prompt": "the old house", "max_tokens": 5}),
        ("POST", _ROUTED[1], _JSON, {**_CHAT, "max_tokens": 6, "stream": True}),
        ("POST", _ROUTED[1], "application/json; charset=utf-8", {**_CHAT, "max_tokens": 4}),
        ("POST", _ROUTED[0], _JSON, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "x": 1}),
        ("POST", _ROUTED[0], _JSON, b'{"model": "m", "prompt": '),
        ("POST", _ROUTED[0], _JSON, b"null"),
        ("POST", _ROUTED[1], _JSON, b""),
        ("POST", _ROUTED[0], "text/plain", {"model": MODEL, "prompt": "hi", "stream": True}),
        ("POST", _ROUTED[0], _JSON, {"model": MODEL, "prompt": "hi", "max_tokens": "many"}),
        # vLLM's own validators raise their own errors (logprob_token_ids without logprobs).
        ("POST", _ROUTED[0], _JSON, {"model": MODEL, "prompt": "hi", "logprob_token_ids": [1]}),
        # Deeper than Python's JSON parser goes: FastAPI's "error parsing the body".
        ("POST", _ROUTED[1], _JSON, b"[" * 100_000 + b"]" * 100_000),
        ("POST", _ROUTED[1], _JSON, {**_CHAT, "model": "no-such-model", "stream": True}),
        ("GET", _ROUTED[0], _JSON, b""),
        ("POST", _ROUTED[0] + "/", _JSON, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ]
]


def _http_answer(http: httpx.Client, method: str, path: str, ctype: str, body: bytes) -> Any:
    # Status, headers but the date (a redirect's without the server's port), and the
    # body's text without ids and times.
    resp = http.request(method, path, content=body, headers={"content-type": ctype})
    headers = sorted(
        (k, re.sub(r":\d+/", ":-/", v)) for k, v in resp.headers.multi_items() if k != "date"
    )
    return resp.status_code, headers, normalized(resp.text)


def http_request_counts(http: httpx.Client) -> dict[tuple[str, str, str], float]:
    """The instrumentator's ``http_requests_total`` of the direct routes' paths, by
    handler, method and status."""
    return {
        (labels["handler"], labels["method"], labels["status"]): value
        for labels, value in metric_values(http.get("/metrics").text, "http_requests_total")
        if labels.get("handler", "").startswith(_ROUTED)
    }


def _direct_served(http: httpx.Client) -> float:
    values = metric_values(http.get("/metrics").text, "corewire_direct_route_requests_total")
    return values[0][1] if values else 0.0


def _abandon_whole_request(stack: ServeStack, http: httpx.Client) -> None:
    # A long completion, not streamed, whose client hangs up mid-generation (once the
    # engine runs it, so that the server has read the request whatever the load).
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "write a long poem",
            "ignore_eos": True,
            "max_tokens": LONG_TOKENS,
            "temperature": 0.0,
        }
    ).encode()
    host, port = stack.base_url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while running_requests(http) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)


def test_direct_route_answers_as_vllms_router(stacks: dict[str, ServeStack]) -> None:
    """Requests to the routes the fast path serves around the app's router, and beside
    them: status, headers (but the date) and body the same as vLLM's own server's, the
    direct route serving exactly the requests whose body the route accepts, and the
    instrumentator's request counts in ``/metrics`` moved alike, a whole request whose
    client hung up included; the server says once that the direct routes serve."""
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        counted = {name: http_request_counts(h) for name, h in (("t", theirs), ("m", mine))}
        served, sent, direct = _direct_served(mine), 0, 0
        for method, path, ctype, body in DIRECT_REQUESTS:
            got, expected, added = side_by_side(
                theirs, mine, lambda h, r=(method, path, ctype, body): _http_answer(h, *r)
            )
            assert got == expected, (method, path, ctype, body, got, expected)
            tries = int(added["tries"])
            # The instrumentator names a request to a routed path by it, any method.
            sent += tries if path in _ROUTED else 0
            direct += tries if method == "POST" and path in _ROUTED and got[0] != 400 else 0
        for stack, http in ((stacks["vllm"], theirs), (stacks["corewire+fast"], mine)):
            _abandon_whole_request(stack, http)
        sent += 1
        direct += 1
        # The instrumentator counts a request once its response is sent.
        moved: dict[str, Any] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for name, h in (("t", theirs), ("m", mine)):
                now = http_request_counts(h)
                moved[name] = {k: v - counted[name].get(k, 0) for k, v in now.items()}
                moved[name] = {k: v for k, v in moved[name].items() if v}
            if all(sum(m.values()) >= sent for m in moved.values()):
                break
            time.sleep(0.1)
        assert _direct_served(mine) - served == direct
    assert moved["m"] == moved["t"] and sum(moved["t"].values()) == sent, moved
    assert server_log(stacks["corewire+fast"]).count(DIRECT_ROUTE_LOG_LINE) == 1


def _http_chunks(stack: ServeStack, path: str, body: dict[str, Any]) -> list[bytes]:
    """The body of a streamed answer from ``stack`` to ``body`` at ``path``, as the
    server framed it: each chunk of HTTP's chunked transfer coding."""
    payload = json.dumps({"model": MODEL, **body}).encode()
    host, port = stack.base_url.split("//", 1)[1].rsplit(":", 1)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    data = b""
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(head.encode() + payload)
        while received := sock.recv(65536):
            data += received
    headers, rest = data.split(b"\r\n\r\n", 1)
    assert headers.startswith(b"HTTP/1.1 200"), data[:500]
    assert b"transfer-encoding: chunked" in headers.lower(), headers
    chunks = []
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_ends_go_as_one_body_chunk(stacks: dict[str, ServeStack], path: str) -> None:
    """The events after a stream's final output (its finish and the usage chunk) and
    ``[DONE]`` leave the fast path's direct route as one chunk of the body with the
    response's end, and a chat's role chunk goes with its first content chunk, where
    vLLM's server sends each alone: the same events either way."""
    body: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body["prompt"] = "the old house"
    else:
        body["messages"] = [{"role": "user", "content": "the old house"}]
    for _ in range(ATTEMPTS):
        # Sent again while the two differ: a loaded server may merge two steps' tokens.
        framed = {
            name: _http_chunks(stacks[name], path, body) for name in ("vllm", "corewire+fast")
        }
        events = {
            name: [normalized(e) for c in chunks for e in c.decode().split("\n\n") if e]
            for name, chunks in framed.items()
        }
        # The last three events: the finish, the usage, [DONE]; the same on both servers.
        tails = {name: got[-3:] for name, got in events.items()}
        heads = {name: got[:2] for name, got in events.items()}
        if tails["corewire+fast"] == tails["vllm"] and heads["corewire+fast"] == heads["vllm"]:
            break
    assert heads["corewire+fast"] == heads["vllm"], heads
    assert tails["corewire+fast"] == tails["vllm"], tails
    finish, usage, done = tails["vllm"]
    assert '"finish_reason":"length"' in finish and '"usage":{' in usage
    assert done == "data: [DONE]"
    assert framed["vllm"][-1] == b"data: [DONE]\n\n"
    # On the fast path those three are the last chunk, alone.
    last = [normalized(e) for e in framed["corewire+fast"][-1].decode().split("\n\n")]
    assert last == [*tails["vllm"], ""], last
    first = {
        name: [normalized(e) for e in c[0].decode().split("\n\n")] for name, c in framed.items()
    }
    if path == "/v1/completions":
        assert first["corewire+fast"] == first["vllm"] == [heads["vllm"][0], ""], first
    else:
        # The role chunk, then the first token's content.
        assert '"role":"assistant"' in heads["vllm"][0] and '"content":"' in heads["vllm"][1]
        assert first["vllm"] == [heads["vllm"][0], ""], first
        assert first["corewire+fast"] == [*heads["vllm"], ""], first


def _inline_renders(http: httpx.Client) -> float:
    values = metric_values(http.get("/metrics").text, "corewire_inline_chat_renders_total")
    return values[0][1] if values else 0.0


def _chat_answers(
    theirs: httpx.Client, mine: httpx.Client, chat: dict[str, Any]
) -> tuple[Any, Any, float]:
    # vLLM's answer and the fast path's to ``chat`` (streamed or whole), and how many
    # renders the fast path's server did on its loop on the last try.
    path = "/v1/chat/completions"

    def answer(http: httpx.Client) -> Any:
        if chat.get("stream"):
            return raw_events(http, chat, path)
        data = json.dumps({"model": MODEL, **chat}).encode()
        return _http_answer(http, "POST", path, "application/json", data)

    renders: list[float] = []

    def fetch(http: httpx.Client) -> Any:
        if http is mine:
            renders.append(_inline_renders(mine))
        got = answer(http)
        if http is mine:
            renders[-1] = _inline_renders(mine) - renders[-1]
        return got

    got, expected, _ = side_by_side(theirs, mine, fetch)
    return got, expected, renders[-1]


def test_short_chats_render_on_the_loop_with_vllms_answers(
    stacks: dict[str, ServeStack],
) -> None:
    """A short chat is rendered through the model's template on the event loop, a long
    one (past the bound) in vLLM's pool: both answered as vLLM's server answers them,
    streamed or not."""
    short = [{"role": "user", "content": "the old house"}]
    long = [{"role": "user", "content": "the old house " * 200}]
    body: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        for messages, inline in ((short, 1), (long, 0)):
            for stream in (True, False):
                chat = body | {"messages": messages, "stream": stream}
                got, expected, renders = _chat_answers(theirs, mine, chat)
                assert got == expected, (len(messages[0]["content"]), stream)
                assert renders == inline, (inline, stream, renders)


#: A server's ``--chat-template``: the model's, and a refusal of one message.
_SERVER_TEMPLATE = (
    "{% if messages[0]['content'] == 'refuse me' %}"
    "{{ raise_exception('the server template refuses this chat') }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }} says {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


def test_server_template_renders_on_the_loop_and_a_brought_one_in_the_pool(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Both servers started with ``--chat-template`` and ``--trust-request-chat-template``:
    a short chat through the server's template is rendered on the loop, its template's
    refusal answered with vLLM's error; a template the request brings (the same text, or
    its own) goes to vLLM's pool; every answer the same as vLLM's server's."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(_SERVER_TEMPLATE)
    args = ("--chat-template", str(template), "--trust-request-chat-template")
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    hello = [{"role": "user", "content": "the old house"}]
    with parser_servers(tmp_path_factory, args, 4096) as (theirs, mine):
        for stream in (True, False):
            got, expected, renders = _chat_answers(
                theirs, mine, body | {"messages": hello, "stream": stream}
            )
            assert got == expected and renders == 1, (stream, renders)
        refused = body | {"messages": [{"role": "user", "content": "refuse me"}]}
        got, expected, renders = _chat_answers(theirs, mine, refused)
        assert got == expected and renders == 1, (got, renders)
        assert got[0] == 400 and "the server template refuses this chat" in got[2], got
        for brought in (_SERVER_TEMPLATE, "{% for m in messages %}{{ m['content'] }}{% endfor %}"):
            chat = body | {"messages": hello, "chat_template": brought}
            got, expected, renders = _chat_answers(theirs, mine, chat)
            assert got == expected and got[0] == 200 and renders == 0, (got, renders)


def test_client_disconnect_mid_stream_aborts_in_the_engine(
    stacks: dict[str, ServeStack],
) -> None:
    """A client that hangs up while its chunks are written natively: the engine drops the
    request, and the server serves on."""
    stack = stacks["corewire+fast"]
    with http_client(stack) as mine:
        before = fast_path_counts(mine)
        check_client_disconnect_aborts_in_engine(stack, mine)
        after = fast_path_counts(mine)
        assert after["tokens"] > before["tokens"]
        assert raw_events(mine, {"prompt": "hi", "max_tokens": 3, "stream": True})[-1] == "[DONE]"


def test_fast_path_off_by_switch(tmp_path: Path) -> None:
    """``COREWIRE_VLLM_FAST_PATH=0`` on corewire's stack: every streaming completion goes
    through vLLM's serving code (no request counted on either path)."""
    client, env = SETTINGS["corewire+output"]
    with (
        shared_stack(tmp_path, client, _SHARED_PIDS, server_env=env) as stack,
        http_client(stack) as http,
    ):
        raw_events(http, {"prompt": "the old house", "max_tokens": 5, "stream": True})
        assert fast_path_counts(http) == {"tokens": 0.0}
        assert INSTALLED_LOG_LINE not in server_log(stack)
        assert envs_cache.CACHED_LOG_LINE not in server_log(stack)


def fast_path_counts_by_process(metrics_dir: Path) -> dict[int, dict[str, float]]:
    """Each process's own fast path counters (requests on the fast path, tokens written
    natively), from prometheus_client's per-process files in ``metrics_dir`` (the
    ``PROMETHEUS_MULTIPROC_DIR`` of a multi-API-server layout)."""
    from prometheus_client.multiprocess import MultiProcessCollector

    counts: dict[int, dict[str, float]] = {}
    for path in metrics_dir.glob("counter_*.db"):
        mine = {"fast": 0.0, "tokens": 0.0}
        for metric in MultiProcessCollector.merge([str(path)], accumulate=True):
            for sample in metric.samples:
                if sample.name == "corewire_fast_path_requests_total":
                    mine["fast"] += sample.value if sample.labels.get("path") == "fast" else 0
                elif sample.name == "corewire_fast_path_tokens_total":
                    mine["tokens"] += sample.value
        counts[int(path.stem.rsplit("_", 1)[1])] = mine
    return counts


def test_each_of_two_api_servers_takes_the_fast_path(
    stacks: dict[str, ServeStack], tmp_path: Path
) -> None:
    """vLLM's multi-API-server layout (``--api-server-count 2``, one port, the servers'
    metrics added up) with the fast path: both servers install it; eight long streams
    sent at once (with and without logprobs and usage) get vLLM's own server's events,
    byte for byte, each counted on the fast path with at least half of its tokens written
    natively; and each server, by its own counters, serves streams on the fast path and
    writes tokens natively."""
    client, env = SETTINGS["corewire+fast"]
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    tokens = 40
    bodies = [
        {
            "prompt": " ".join(WORDS[i : i + 3]),
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": (None, 2)[i % 2],
        }
        | ({"stream_options": {"include_usage": True}} if i % 3 == 0 else {})
        for i in range(8)
    ]

    def at_once(http: httpx.Client, batch: list[dict[str, Any]]) -> list[list[str]]:
        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            return list(pool.map(lambda body: raw_events(http, body), batch))

    with (
        shared_stack(
            tmp_path,
            client,
            _SHARED_PIDS,
            server_env={**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
            engine_overrides={"step_delay": STEP_DELAY, "vocab_size": 4096},
            api_servers=2,
        ) as stack,
        http_client(stack) as mine,
        http_client(stacks["vllm"]) as theirs,
    ):
        servers = api_servers_saying(stack, INSTALLED_LOG_LINE)
        assert sorted(servers) == ["ApiServer_0", "ApiServer_1"], server_log(stack)[-3000:]
        before = fast_path_counts(mine)
        # The whole batch goes again, at once, while any stream differs: on two cores a
        # server can fall a step behind (two tokens in one chunk, as vLLM's would), and
        # vLLM's server is asked again too.
        rounds = 0
        while rounds < ATTEMPTS:
            rounds += 1
            expected = [raw_events(theirs, body) for body in bodies]
            got = at_once(mine, bodies)
            if got == expected:
                break
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert a == b, f"request {i}: {_first_difference(a, b)}"
        took, want = paths_taken(mine, before, [rounds] * len(bodies), [False] * len(bodies))
        assert took == want, (before, rounds)
        native = fast_path_counts(mine)["tokens"] - before["tokens"]
        # Each stream's first chunk and finish are Python's; one that fell behind
        # attaches later, so at least half the tokens between are the frames'.
        ideal = rounds * len(bodies) * (tokens - 2)
        assert ideal // 2 <= native <= ideal, native
        # Which server accepts a connection is the kernel's choice: more batches (fresh
        # connections) until each server has served some, by its own counters.
        pids = list(servers.values())

        def served() -> dict[int, dict[str, float]]:
            # A request's count lands just after its last chunk: read until both
            # servers show some (or a few seconds pass).
            deadline = time.monotonic() + 3.0
            while True:
                by_process = fast_path_counts_by_process(metrics_dir)
                counts = {pid: by_process.get(pid, {"fast": 0.0, "tokens": 0.0}) for pid in pids}
                if all(c["fast"] > 0 for c in counts.values()) or time.monotonic() > deadline:
                    return counts
                time.sleep(0.1)

        counts = served()
        for _ in range(10):
            if all(c["fast"] > 0 for c in counts.values()):
                break
            with http_client(stack) as fresh:
                at_once(fresh, bodies)
            counts = served()
        assert all(c["fast"] > 0 and c["tokens"] > 0 for c in counts.values()), counts


#: Builds vLLM's app as ``vllm serve`` does once its engines are up, with the fast path
#: installed, and prints whether ``vllm.envs`` is memoized before and after.
_ENVS_PROBE = """
import vllm.entrypoints.launchers.app as launcher
import vllm.envs as envs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.utils.argparse_utils import FlexibleArgumentParser
from corewire.vllm import fast_path

fast_path.install(OpenAIServingCompletion, OpenAIServingChat)
args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
before = envs._is_envs_cache_enabled()
launcher.build_app(args, ("generate",))
print("envs cached:", before, envs._is_envs_cache_enabled())
"""


@pytest.mark.parametrize(("switch", "cached"), [(None, True), ("0", False)])
def test_envs_read_once_once_the_app_is_built(switch: str | None, cached: bool) -> None:
    """The fast path memoizes ``vllm.envs`` when vLLM builds the server's app, not before
    (the API server's start-up still reads the environment), and not with
    ``COREWIRE_VLLM_ENVS_CACHE=0`` (the bench's ``corewire+fast/envs`` stack sets it)."""
    from corewire.bench.serve import ENVS_CACHE_SWITCH, STACKS

    assert STACKS["corewire+fast/envs"][1][ENVS_CACHE_SWITCH] == "0"
    assert ENVS_CACHE_SWITCH == envs_cache.SWITCH
    env = {k: v for k, v in os.environ.items() if k != envs_cache.SWITCH}
    if switch is not None:
        env[envs_cache.SWITCH] = switch
    proc = subprocess.run(
        [sys.executable, "-c", _ENVS_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"envs cached: False {cached}" in proc.stdout, (proc.stdout, proc.stderr[-3000:])


def _events_until_engine_killed(stack: ServeStack) -> list[str]:
    """A long streaming completion whose engine is SIGKILLed after its tenth chunk: every
    event the client then sees, as written."""
    body = {"model": MODEL, "prompt": "write a long poem", "max_tokens": LONG_TOKENS}
    body |= {"temperature": 0.0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with (
        http_client(stack) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(normalized(line[len("data: ") :]))
            if len(events) == 10:
                os.kill(stack.engines[0].pid, signal.SIGKILL)
    return events


def test_engine_death_mid_stream_ends_the_stream_as_vllms_path_does(tmp_path: Path) -> None:
    """The engine dies (SIGKILL) while a stream's chunks are written natively: the client
    gets the same error event and ``[DONE]`` as from vLLM's serving code over the same
    client (corewire+output), after the chunks written so far, all of them whole."""
    ends = {}
    for setting in ("corewire+output", "corewire+fast"):
        client, env = SETTINGS[setting]
        workdir = tmp_path / setting.replace("+", "-")
        with shared_stack(
            workdir,
            client,
            _SHARED_PIDS,
            server_env={**env, **HEALTH_ENV},
            engine_overrides={"step_delay": STEP_DELAY},
            still_healthy=lambda: False,
        ) as stack:
            events = _events_until_engine_killed(stack)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])
        assert "error" in error, events[-2]
        # Every chunk before the error is a whole token chunk, none lost or cut.
        chunks = [json.loads(e) for e in events[:-2]]
        assert len(chunks) >= 10
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        ends[setting] = events[-2:]
    assert ends["corewire+fast"] == ends["corewire+output"]


@pytest.mark.parametrize("feature", FEATURES, ids=[f.name for f in FEATURES])
def test_feature_table_fast_column(stacks: dict[str, ServeStack], feature: Feature) -> None:
    """docs/vllm.md's feature table, the fast path's column: each option's request gets the
    same answer from the fast path's stack as from vLLM's own server (streams event for
    event, the text as written), and takes the fast path exactly where the table says."""
    with http_client(stacks["vllm"]) as theirs, http_client(stacks["corewire+fast"]) as mine:
        got, expected, added = side_by_side(theirs, mine, lambda h: _table_answer(h, feature))
    assert got == expected, _first_difference(got, expected)
    took_fast, took_vllm = added.get("fast", 0), added.get("vllm", 0)
    if feature.stream and feature.path in ("/v1/completions", "/v1/chat/completions"):
        assert (took_fast, took_vllm) == ((1, 0) if feature.fast else (0, 1))
    else:
        assert (took_fast, took_vllm) == (0, 0)


def _table_answer(http: httpx.Client, feature: Feature) -> Any:
    # A stream's events as written (normalized), n > 1 per choice; else the JSON without
    # ids, times and null fields.
    body = feature.request()
    if body.get("stream"):
        return per_choice(body, raw_events(http, body, path=feature.path))
    resp = http.post(feature.path, json=body)
    return resp.status_code, semantic(resp.json())
