"""vLLM's own Rust front-end (``vllm-rs``, ``VLLM_USE_RUST_FRONTEND=1 vllm serve``) over a
corewire engine, driven over real HTTP.

The stack is the serve tests' (``vllm serve`` front-end only, DP = 1, one ``corewire
engine`` that joined through vLLM's handshake, its scheduler stats on), with the API
server's environment asking for the Rust front-end: vLLM's Python process does the
handshake and then hands the HTTP socket and the engine sockets to ``vllm-rs``, which
reads the engine's ready response and every output itself, strictly: a ``SchedulerStats``
without all its keys fails every request (``missing field step_counter``), and 0.34.0's
needs the ``is_inference_ready`` utility answered before it serves at all.

Runs with whatever vLLM is installed that ships ``vllm-rs`` (0.25.1 in the main
environment); ``scripts/test`` runs it again under ``COREWIRE_REQUIRE_VLLM=0.34.0`` in the
0.34.0 environment, where anything missing fails instead of skipping. One Rust stack for
the module; the comparison with vLLM's Python server starts that server once, in its test.

Checks ``docs/protocol.md`` §3.2 (engines join ``vllm serve``) and §5 (complete outputs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corewire.vllm.serve.stack import RUST_FRONTEND_ENV, rust_frontend_binary
from serve_support import missing_prerequisite


def _missing() -> str | None:
    missing = missing_prerequisite()
    if missing is None and rust_frontend_binary() is None:
        missing = "the installed vLLM has no Rust front-end (vllm-rs)"
    return missing


_MISSING = _missing()
if _MISSING is not None:
    if _REQUIRED := os.environ.get("COREWIRE_REQUIRE_VLLM"):
        raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={_REQUIRED}: {_MISSING}")
    pytest.skip(_MISSING, allow_module_level=True)

import httpx  # noqa: E402

from corewire.vllm.serve.stack import ServeStack, installed_release  # noqa: E402
from fast_path_features import FEATURES, answer, rust_verdict  # noqa: E402
from serve_support import (  # noqa: E402
    GREEDY_CHATS,
    GREEDY_COMPLETIONS,
    MODEL,
    SharedPids,
    chat,
    completion,
    http_client,
    running_stack,
    server_log,
    shared_stack,
    stream,
)

# Where CI asks for a release, it is the one under test.
if (_REQUIRED := os.environ.get("COREWIRE_REQUIRE_VLLM")) and installed_release() != _REQUIRED:
    raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={_REQUIRED}, found vLLM {installed_release()}")

# Processes of the module's stack: they outlive single tests on purpose.
_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    """The module's Rust front-end over one corewire engine speaking the installed
    vLLM's wire."""
    workdir = tmp_path_factory.mktemp("serve-rust")
    with shared_stack(workdir, "vllm", _SHARED_PIDS, server_env=RUST_FRONTEND_ENV) as started:
        yield started


@pytest.fixture
def http(stack: ServeStack) -> Iterator[httpx.Client]:
    """An HTTP client for the module's server."""
    with http_client(stack) as client:
        yield client


def test_the_rust_front_end_serves(stack: ServeStack, http: httpx.Client) -> None:
    """vllm-rs, not vLLM's Python server, answers: its process runs under the API
    server, and /health and /v1/models answer."""
    log = server_log(stack)
    assert "Launching Rust frontend" in log
    assert "failed to connect to engine core" not in log
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def _greedy(http: httpx.Client) -> list[dict[str, Any]]:
    """Each greedy request of the serve tests (completions plain and streamed, with
    logprobs; chat completions) as text, logprobs, finish reason and usage."""
    results: list[dict[str, Any]] = []
    for body in GREEDY_COMPLETIONS:
        body = {**body, "temperature": 0.0}
        choice = (out := completion(http, **body))["choices"][0]
        chunks = [e["choices"][0] for e in stream(http, "/v1/completions", **body) if e["choices"]]
        results.append(
            {
                "text": choice["text"],
                "tokens": choice["logprobs"]["tokens"],
                "token_logprobs": choice["logprobs"]["token_logprobs"],
                "top_logprobs": choice["logprobs"]["top_logprobs"],
                "finish_reason": choice["finish_reason"],
                "usage": {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens")},
                "streamed_text": "".join(c["text"] for c in chunks),
                "streamed_logprobs": [
                    v for c in chunks if c.get("logprobs") for v in c["logprobs"]["token_logprobs"]
                ],
                "streamed_finish_reason": chunks[-1]["finish_reason"],
            }
        )
    for body in GREEDY_CHATS:
        body = {**body, "temperature": 0.0}
        choice = (out := chat(http, **body))["choices"][0]
        events = stream(http, "/v1/chat/completions", **body)
        deltas = [e["choices"][0] for e in events if e["choices"]]
        logprobs = choice.get("logprobs") or {}
        results.append(
            {
                "text": choice["message"]["content"],
                "logprobs": [
                    [c["token"], c["logprob"], _distinct(c["top_logprobs"])]
                    for c in logprobs.get("content") or []
                ],
                "finish_reason": choice["finish_reason"],
                "usage": {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens")},
                "streamed_text": "".join(d["delta"].get("content") or "" for d in deltas),
            }
        )
    return results


def _distinct(top: list[dict[str, Any]]) -> list[list[Any]]:
    """A chat answer's top logprobs of one token, each candidate once.

    An engine's logprobs row is the sampled token, then the top k (vLLM's sampler: the
    greedy token is in both). vLLM's Python server lists each candidate once; vllm-rs
    (0.25.1 and 0.34.0) lists the row as it is, the greedy token twice, k + 1 entries.
    """
    seen: dict[str, float] = {}
    for entry in top:
        seen.setdefault(entry["token"], entry["logprob"])
    return [[token, logprob] for token, logprob in seen.items()]


def _approx(value: Any) -> Any:
    """``value`` with its floats compared to 1e-5: the Rust front-end writes logprobs as
    32-bit floats, vLLM's Python server as 64-bit ones."""
    if isinstance(value, float):
        return pytest.approx(value, abs=1e-5)
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_approx(v) for v in value]
    return value


def test_same_tokens_as_vllms_python_server(
    stack: ServeStack, http: httpx.Client, tmp_path: Path
) -> None:
    """The greedy requests of the serve tests, one at a time (each engine step sees the
    same batch): the Rust front-end's answers carry the same tokens, text, logprobs,
    finish reasons and usage as vLLM's Python server over the same engine, plain and
    streamed; the streams add up to the plain answers."""
    rust = _greedy(http)
    for res in rust:
        assert res["text"] and res["text"] == res["streamed_text"]
        assert res["usage"]["completion_tokens"] > 0
    for res in rust[: len(GREEDY_COMPLETIONS)]:
        assert len(res["tokens"]) == res["usage"]["completion_tokens"]
        assert res["streamed_logprobs"] == res["token_logprobs"]
        assert res["streamed_finish_reason"] == res["finish_reason"]
    # A token-id prompt with ignore_eos runs to max_tokens.
    assert rust[1]["finish_reason"] == "length"
    assert rust[1]["usage"]["completion_tokens"] == GREEDY_COMPLETIONS[1]["max_tokens"]
    with running_stack(tmp_path, client="vllm") as python_server:
        pids = {p.pid for p in (python_server.server, *python_server.engines) if p}
        _SHARED_PIDS.update(pids)
        try:
            with http_client(python_server) as other:
                python = _greedy(other)
        finally:
            _SHARED_PIDS.difference_update(pids)
    for i, (mine, theirs) in enumerate(zip(rust, python, strict=True)):
        assert mine == _approx(theirs), f"request {i}"


def test_completion_logprobs_plain_and_streamed(http: httpx.Client) -> None:
    """Top-k logprobs: k entries per token, the greedy token the most likely among them,
    and the same values in the stream, which ends with the finish reason."""
    body = {"prompt": "the sun and the moon", "max_tokens": 10, "temperature": 0.0}
    body |= {"logprobs": 4, "ignore_eos": True}
    choice = completion(http, **body)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 10
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert 4 <= len(top) <= 5
        assert top[token] == logprob == max(top.values())
    chunks = [e["choices"][0] for e in stream(http, "/v1/completions", **body) if e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = [v for c in chunks if c.get("logprobs") for v in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert chunks[-1]["finish_reason"] == "length"


def test_chat_completions_plain_and_streamed(http: httpx.Client) -> None:
    """Chat completions with top_logprobs, plain and streamed: the assistant's message,
    one logprob entry per token, the stream adding up to the plain answer."""
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
    assert len(content) == out["usage"]["completion_tokens"] == 8
    for entry in content:
        # The greedy token and the next one (vllm-rs lists the greedy one twice).
        top = _distinct(entry["top_logprobs"])
        assert len(top) == 2 and top[0] == [entry["token"], entry["logprob"]]
        assert top[0][1] >= top[1][1]
    deltas = [e["choices"][0] for e in stream(http, "/v1/chat/completions", **body) if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
    streamed = [c for d in deltas if d.get("logprobs") for c in d["logprobs"]["content"]]
    assert [c["logprob"] for c in streamed] == [c["logprob"] for c in content]
    assert deltas[-1]["finish_reason"] == choice["finish_reason"] == "length"


def test_feature_table_rust_column(stack: ServeStack, tmp_path: Path) -> None:
    """docs/vllm.md's feature table, the Rust front-end's column, against the installed
    vllm-rs: each option's request sent to it and to vLLM's Python server over the same
    kind of engine, and what it answers (the same answer, a different one, an error:
    ``fast_path_features.rust_verdict``) is what the table says. The table is vLLM
    0.34.0's (its per-request stream interval, its chat options)."""
    from corewire.vllm.plugin import FAST_PATH_VLLM_VERSIONS

    if installed_release() not in FAST_PATH_VLLM_VERSIONS:
        pytest.skip(f"the feature table is the fast path's releases', not {installed_release()}'s")
    with http_client(stack) as http:
        rust = [answer(http, f) for f in FEATURES]
    with running_stack(tmp_path, client="vllm") as python_server:
        pids = {p.pid for p in (python_server.server, *python_server.engines) if p}
        _SHARED_PIDS.update(pids)
        try:
            with http_client(python_server) as other:
                python = [answer(other, f) for f in FEATURES]
        finally:
            _SHARED_PIDS.difference_update(pids)
    verdicts = {f.name: rust_verdict(r, p) for f, r, p in zip(FEATURES, rust, python, strict=True)}
    assert verdicts == {f.name: f.rust for f in FEATURES}


def test_engine_stats_reach_the_rust_front_end(stack: ServeStack, http: httpx.Client) -> None:
    """The engine's scheduler stats, which vllm-rs decodes with every output, are what
    it reports: after the requests above finished, no request is running."""
    completion(http, prompt="one two three", max_tokens=3, temperature=0.0)
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    running = [
        line for line in metrics.text.splitlines() if line.startswith("vllm:num_requests_running")
    ]
    assert running and all(line.rsplit(" ", 1)[1] in ("0", "0.0") for line in running), running
    assert "missing field" not in server_log(stack)
