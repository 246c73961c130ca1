"""vLLM 0.33.0's OpenAI-compatible API server over corewire engines, driven over real HTTP
(runs only where vLLM 0.33.0 is installed; skipped with vLLM 0.25.1, failed where CI
requires 0.33.0 and something is missing).

The same stack as ``test_vllm_serve.py`` (vLLM 0.25.1): ``vllm serve`` front-end only on a
model directory the test writes, and ``corewire engine --release 0.33.0`` reference
engines that joined it through vLLM's start-up handshake. One server per client setting,
each started once and shared by every test: vLLM's own engine-core client, then corewire's
(``COREWIRE_VLLM_CLIENT=1``). Greedy outputs must be identical with either. The last test
kills the corewire server's engine: in-flight requests end with errors and /health turns
unhealthy within corewire's health timeout.

Checks ``docs/protocol.md`` end to end with vLLM 0.33.0's layouts (§11): §3.2 (engines
join ``vllm serve``), §4.5 (a client disconnect aborts in the engine) and §7 (a killed
engine).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_0_33_0_gate import RELEASE, require_vllm_0_33_0

vllm = require_vllm_0_33_0()

from serve_support import missing_prerequisite, plugin_missing  # noqa: E402

_MISSING = missing_prerequisite() or plugin_missing()
if _MISSING is not None:
    if _REQUIRED := os.environ.get("COREWIRE_REQUIRE_VLLM"):
        raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={_REQUIRED}: {_MISSING}")
    pytest.skip(_MISSING, allow_module_level=True)

import httpx  # noqa: E402

from corewire.vllm.classes import client_classes  # noqa: E402
from corewire.vllm.stack import ServeStack  # noqa: E402
from serve_support import (  # noqa: E402
    FOLDED_LOG_LINE,
    HEALTH_ENV,
    OUTPUT_LOG_LINE,
    PLUGIN_LOG_LINE,
    SharedPids,
    check_chat_top_logprobs_plain_and_streamed,
    check_client_disconnect_aborts_in_engine,
    check_completion_logprobs_plain_and_streamed,
    check_corewire_metrics_in_vllms_metrics,
    check_greedy_outputs_identical_across_clients,
    check_greedy_tokens_and_logprobs_are_the_engines,
    check_health_and_models,
    check_metrics,
    check_metrics_prompt_tokens,
    check_stop_string,
    check_two_api_servers_with_corewire_clients,
    check_two_engines_behind_one_front_end,
    http_client,
    kill_engine_under_load,
    server_log,
    shared_stack,
)

# vLLM's client first: the corewire server compares its greedy outputs with its answers.
CLIENTS = ["vllm", "corewire"]

# Processes of the two shared stacks: they outlive single tests on purpose.
_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree
# Greedy outputs per client, compared across clients.
_GREEDY: dict[str, list[dict[str, Any]]] = {}
# Clients whose server's engine a test killed on purpose.
_KILLED: set[str] = set()


@pytest.fixture(scope="module", params=CLIENTS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeStack]:
    """The module's API server (one engine speaking 0.33.0), with vLLM's client or with
    corewire's (whose health watchdog is made quick for the kill test)."""
    client = request.param
    workdir = tmp_path_factory.mktemp(f"serve33-{client}")
    env = HEALTH_ENV if client == "corewire" else None
    with shared_stack(
        workdir, client, _SHARED_PIDS, server_env=env, still_healthy=lambda: client not in _KILLED
    ) as started:
        assert started.release == RELEASE
        yield started


@pytest.fixture
def http(stack: ServeStack) -> Iterator[httpx.Client]:
    """An HTTP client for the module's server."""
    with http_client(stack) as client:
        yield client


def test_greedy_outputs_identical_across_clients(
    stack: ServeStack, http: httpx.Client, tmp_path: Path
) -> None:
    """Same greedy requests, same text, token ids, logprobs and usage with either client
    (completions and chat, plain and streamed). Runs first on each server, one request at
    a time, so that each engine step sees the same batch."""
    check_greedy_outputs_identical_across_clients(stack, http, tmp_path, _GREEDY, _SHARED_PIDS)


def test_greedy_tokens_and_logprobs_are_the_engines(stack: ServeStack, http: httpx.Client) -> None:
    """What the HTTP answer carries is what the reference engine sampled."""
    check_greedy_tokens_and_logprobs_are_the_engines(stack, http)


def test_api_server_runs_the_requested_client(stack: ServeStack) -> None:
    """corewire's plugin says in vLLM 0.33.0's log that it installed corewire's client
    exactly when COREWIRE_VLLM_CLIENT=1 (it is not refused by version)."""
    log = server_log(stack)
    assert (PLUGIN_LOG_LINE in log) == (stack.client == "corewire")
    assert "supports vLLM" not in log
    # With corewire's client, native output processing (on by default here) says so once
    # vLLM's logging is up (0.34.0 drops what plugins say at INFO while they load).
    assert (OUTPUT_LOG_LINE in log) == (stack.client == "corewire"), log[-3000:]
    assert (FOLDED_LOG_LINE in log) == (stack.client == "corewire")


def test_health_and_models(stack: ServeStack, http: httpx.Client) -> None:
    """/health answers 200; /v1/models lists the served model."""
    check_health_and_models(stack, http)


def test_completion_logprobs_plain_and_streamed(stack: ServeStack, http: httpx.Client) -> None:
    """Top-k logprobs in completions, the same values in the stream."""
    check_completion_logprobs_plain_and_streamed(stack, http)


def test_chat_top_logprobs_plain_and_streamed(stack: ServeStack, http: httpx.Client) -> None:
    """Chat completions, plain and streamed, with top_logprobs; the stream adds up."""
    check_chat_top_logprobs_plain_and_streamed(stack, http)


def test_stop_string(stack: ServeStack, http: httpx.Client) -> None:
    """A stop string ends the text before it: finish_reason "stop", the string as
    stop_reason."""
    check_stop_string(stack, http)


def test_client_disconnect_aborts_in_engine(stack: ServeStack, http: httpx.Client) -> None:
    """A client that hangs up mid-stream: the engine drops the request (ABORT)."""
    check_client_disconnect_aborts_in_engine(stack, http)


def test_metrics(stack: ServeStack, http: httpx.Client) -> None:
    """/metrics counts the requests and tokens that went through the engine."""
    check_metrics(stack, http)


def test_metrics_prompt_tokens(stack: ServeStack, http: httpx.Client) -> None:
    """vLLM counts prompt tokens from the prefill_stats of each request's first output."""
    check_metrics_prompt_tokens(stack, http)


def test_corewire_metrics_in_vllms_metrics(stack: ServeStack, http: httpx.Client) -> None:
    """corewire's client metrics appear in vLLM 0.33.0's /metrics with the plugin only."""
    check_corewire_metrics_in_vllms_metrics(stack, http)


async def test_engine_killed_under_load_fails_requests_and_health(stack: ServeStack) -> None:
    """corewire's client inside vLLM 0.33.0 (the last test on its server): SIGKILL of the
    engine under load ends every in-flight HTTP request with an error and turns /health
    unhealthy within the health timeout. (vLLM's own client never notices the death of
    an engine that joined from elsewhere: not run with it.)"""
    if stack.client != "corewire":
        pytest.skip("vLLM's own client does not watch engines that joined from elsewhere")
    n = 6
    results = await kill_engine_under_load(stack, n, on_kill=lambda: _KILLED.add(stack.client))
    # Streams end with an error event (their 200 status is already sent), plain requests
    # with status 500 (vLLM's answer to its EngineDeadError); none hangs, none finishes.
    assert results[0::2] == ["error event"] * (n // 2), results
    assert results[1::2] == [500] * (n // 2), results


def test_two_engines_behind_one_front_end(tmp_path: Path) -> None:
    """DP = 2 with corewire's DP client under vLLM 0.33.0's coordinator (its
    [waiting, running, kv_cache_usage] counts): requests reach both engines, the greedy
    text does not depend on the engine; vLLM's coordinator is sent nothing it does not
    expect (0.33.0 has no first-request notices). Its own stack (~25 s)."""
    log = check_two_engines_behind_one_front_end(tmp_path, "corewire")
    assert f"{PLUGIN_LOG_LINE} {client_classes(RELEASE)['dplb'].__name__}" in log
    assert "unexpected message" not in log


def test_two_api_servers_with_corewire_clients(tmp_path: Path) -> None:
    """``--api-server-count 2`` with the plugin on: vLLM 0.33.0's parent binds each
    server's engine sockets itself and hands them over; corewire's client in each server
    adopts them (zmq.USE_FD), and both servers answer on the one port. Its own stack."""
    log = check_two_api_servers_with_corewire_clients(tmp_path)
    assert client_classes(RELEASE)["plain"].__name__ in log
