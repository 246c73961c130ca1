"""The installed vLLM's OpenAI-compatible API server over corewire engines, driven over
real HTTP: vLLM 0.25.1 in the main venv, and the same module in the venv of each later
release ``scripts/test`` runs (0.34.0; 0.33.0 with ``COREWIRE_LIVE_0_33_0=1``), whose
engines speak that release (the stack starts ``corewire engine --release`` of it).

Each stack is real processes: ``vllm serve`` front-end only on a model directory the test
writes, and ``corewire engine`` reference engines that joined it through vLLM's start-up
handshake. The module's shared server runs once with vLLM's own engine-core client, once
with corewire's (``COREWIRE_VLLM_CLIENT=1``), and once with corewire's client and
corewire's native output processing (``COREWIRE_VLLM_OUTPUT=1`` too, where corewire has
it); the greedy outputs of all must be identical, and the native output processing must
give the same answers and /metrics counters as vLLM's. The engine-kill and DP = 2 tests
start stacks of their own.

Checks ``docs/protocol.md`` end to end: §3.2 (engines join ``vllm serve``), §2 (several
API servers, client index), §4.5 (a client disconnect aborts in the engine), §7 (a killed
engine) and §8.1 (DP = 2 behind vLLM's coordinator).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from corewire.releases import installed_vllm_version
from corewire.vllm.adapters.classes import client_classes
from corewire.vllm.serve.model_dir import write_model_dir
from corewire.vllm.serve.stack import ServeStack, StackError
from serve_support import (
    FOLDED_LOG_LINE,
    GREEDY_COMPLETIONS,
    HEALTH_ENV,
    HTTP_TIMEOUT,
    MODEL,
    OUTPUT_KEPT_LOG_LINE,
    OUTPUT_LOG_LINE,
    PLUGIN_LOG_LINE,
    SETTINGS,
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
    check_output_processing_identical,
    check_stop_string,
    check_two_api_servers_with_corewire_clients,
    check_two_engines_behind_one_front_end,
    first_difference,
    http_client,
    joined_chat_stream,
    joined_completion_stream,
    kill_engine_under_load,
    long_requests,
    metric_sum,
    missing_prerequisite,
    output_missing,
    plugin_missing,
    running_stack,
    server_log,
    shared_stack,
    stream,
    without_ids,
)

_MISSING = missing_prerequisite()
_NO_PLUGIN = plugin_missing()
_NO_OUTPUT = output_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
#: The installed vLLM's release (None: no vLLM, and the module skips).
RELEASE = (installed_vllm_version() or "").split("+")[0] or None

# The API server settings of the module's shared server (serve_support.SETTINGS).
_SETTINGS = [
    pytest.param("vllm", id="vllm-client"),
    pytest.param(
        "corewire",
        id="corewire-client",
        marks=pytest.mark.skipif(_NO_PLUGIN is not None, reason=_NO_PLUGIN or ""),
    ),
    pytest.param(
        "corewire+output",
        id="corewire-output",
        marks=pytest.mark.skipif(_NO_OUTPUT is not None, reason=_NO_OUTPUT or ""),
    ),
]

# Processes of the stack the module shares: they outlive single tests on purpose.
_SHARED_PIDS = SharedPids()
# Greedy outputs per client, compared across clients.
_GREEDY: dict[str, list[dict[str, Any]]] = {}
# The output-path workload's answers and /metrics deltas per setting, compared.
_OUTPUT_RUNS: dict[str, dict[str, Any]] = {}


LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree


@pytest.fixture(scope="module", params=_SETTINGS)
def setting(request: pytest.FixtureRequest) -> str:
    """The module's API server setting: "vllm", "corewire" or "corewire+output"."""
    return request.param


@pytest.fixture(scope="module")
def stack(setting: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    """The module's API server (one engine), with vLLM's client, with corewire's, or with
    corewire's client and native output processing."""
    client, env = SETTINGS[setting]
    workdir = tmp_path_factory.mktemp(f"serve-{setting.replace('+', '-')}")
    with shared_stack(workdir, client, _SHARED_PIDS, server_env=env) as started:
        # The engines speak the installed vLLM's release, not a default of corewire's.
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
    """Same greedy requests, same text, token ids, logprobs and usage with either client.

    Runs first on each server, one request at a time, so that each engine step sees the
    same batch. When the other client's server did not run in this session (a run of
    one parameter), this test starts a vLLM-client stack itself to compare with.
    """
    results = check_greedy_outputs_identical_across_clients(
        stack, http, tmp_path, _GREEDY, _SHARED_PIDS
    )
    assert len(results[1]["token_ids"]) == GREEDY_COMPLETIONS[1]["max_tokens"]


def test_output_processing_identical_with_native_output(
    setting: str, stack: ServeStack, http: httpx.Client, tmp_path: Path
) -> None:
    """corewire's native output processing (COREWIRE_VLLM_OUTPUT=1) against vLLM's, both
    under corewire's client: the same greedy answers for completions and chat completions,
    plain and streamed, with 5 logprobs, prompt logprobs, stop strings across tokens and
    n = 2, and the same /metrics counters of generation tokens, prompt tokens and finished
    requests (and token-count histograms) for them. The other settings run the workload
    too, as the baseline (a "corewire" stack is started here when none ran)."""
    check_output_processing_identical(setting, stack, http, tmp_path, _OUTPUT_RUNS, _SHARED_PIDS)


def test_greedy_tokens_and_logprobs_are_the_engines(stack: ServeStack, http: httpx.Client) -> None:
    """What the HTTP answer carries is what the engine sampled: the same greedy tokens and
    sampled-token logprobs as the reference engine stepped in this process, and the text is
    those tokens decoded by the model directory's tokenizer (joined by spaces)."""
    check_greedy_tokens_and_logprobs_are_the_engines(stack, http)


def test_api_server_runs_the_requested_client(setting: str, stack: ServeStack) -> None:
    """The switches work both ways: corewire's plugin says in the API server's log that it
    installed corewire's client exactly when COREWIRE_VLLM_CLIENT=1, and corewire's output
    processing exactly when COREWIRE_VLLM_OUTPUT=1, which then keeps the native path (no
    refusal of the whole server: the test tokenizer is a fast one)."""
    log = server_log(stack)
    assert (PLUGIN_LOG_LINE in log) == (stack.client == "corewire")
    assert "supports vLLM" not in log  # no release is refused by its version
    assert (OUTPUT_LOG_LINE in log) == (setting == "corewire+output")
    assert (FOLDED_LOG_LINE in log) == (setting == "corewire+output")
    assert OUTPUT_KEPT_LOG_LINE not in log


def test_health_and_models(stack: ServeStack, http: httpx.Client) -> None:
    """/health answers 200 with an empty body; /v1/models lists the served model."""
    check_health_and_models(stack, http)


def test_completion_logprobs_plain_and_streamed(stack: ServeStack, http: httpx.Client) -> None:
    """Top-k logprobs: k entries per token, the sampled (greedy: most likely) token among
    them with its own logprob, and the same values in the stream."""
    check_completion_logprobs_plain_and_streamed(stack, http)


def test_chat_top_logprobs_plain_and_streamed(stack: ServeStack, http: httpx.Client) -> None:
    """Chat completions, plain and streamed, with top_logprobs; the stream adds up."""
    check_chat_top_logprobs_plain_and_streamed(stack, http)


def test_stop_string(stack: ServeStack, http: httpx.Client) -> None:
    """A stop string ends the text before it (the front-end matches it and aborts the
    request in the engine): finish_reason "stop" with the string as stop_reason."""
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
    """With the plugin on, corewire's client metrics appear in vLLM's own /metrics (the
    default registry) and count the messages of a request; with vLLM's client, none."""
    check_corewire_metrics_in_vllms_metrics(stack, http)


# ---------------------------------------------------------------------- own stacks


@pytest.mark.skipif(_NO_PLUGIN is not None, reason=_NO_PLUGIN or "")
async def test_engine_killed_under_load_fails_requests_and_health(tmp_path: Path) -> None:
    """corewire's client inside vLLM: SIGKILL of the engine under load ends every in-flight
    HTTP request with an error and turns /health unhealthy, within the health timeout.
    (vLLM's own client never notices the death of an engine that joined from elsewhere.)"""
    with running_stack(tmp_path, client="corewire", server_env=HEALTH_ENV) as stack:
        n = 6
        results = await kill_engine_under_load(stack, n)
        # Streams end with an error event (their 200 status is already sent), plain
        # requests with a 5xx status; none hangs, none finishes.
        assert sorted(map(str, results)) == sorted(["500"] * (n // 2) + ["error event"] * (n // 2))


def test_engine_restarts_need_a_client_that_takes_an_engine_back(tmp_path: Path) -> None:
    for settings in ({"engines": 1}, {"engines": 2, "client": "vllm"}):
        with pytest.raises(ValueError, match="restart_engines needs"):
            ServeStack(tmp_path, restart_engines=True, **settings)  # type: ignore[arg-type]


@pytest.mark.skipif(_NO_PLUGIN is not None, reason=_NO_PLUGIN or "")
async def test_a_dp_engine_killed_under_load_is_started_again_and_rejoins(tmp_path: Path) -> None:
    """DP = 2, corewire's client, and the stack's engine restarts (``scripts/serve``'s
    default): SIGKILL of engine 1 mid-load ends only its requests (streams with vLLM's
    error event, plain requests with a 5xx), the others finish and /health stays 200; the
    stack starts engine 1 again, it rejoins, /metrics shows the loss, the replacement and
    both engines serving, and new requests reach engine 1 again."""
    with (
        running_stack(
            tmp_path, client="corewire", engines=2, server_env=HEALTH_ENV, restart_engines=True
        ) as stack,
        http_client(stack) as http,
    ):
        n = 8
        started = [asyncio.Event() for _ in range(n)]
        load = asyncio.ensure_future(long_requests(stack.base_url, n, started))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        await asyncio.sleep(0.5)  # the plain requests reached their engines too
        stack.engines[1].kill()
        results = await asyncio.wait_for(load, 180)
        failed = [r for r in results if r != "finished"]
        assert failed and len(failed) < n, results  # engine 1's, and only they
        # Plain requests get vLLM's 5xx for an engine error (500, or 503 where the error
        # says retryable: vLLM 0.33.0 on).
        assert all(f == "error event" or (isinstance(f, int) and f >= 500) for f in failed), results
        assert stack.health() == 200
        deadline = time.monotonic() + 120
        while metric_sum(http, "corewire_engine_replacements_total") < 1:
            assert time.monotonic() < deadline, server_log(stack)[-3000:]
            await asyncio.sleep(0.5)
        assert metric_sum(http, "corewire_engine_losses_total") == 1
        assert metric_sum(http, "corewire_engines_serving") == 2
        assert stack.engine_restarts is not None and stack.engine_restarts.restarts[1] == 1
        served_before = metric_sum(http, "vllm:request_success_total", engine="1")
        body = {"model": MODEL, "prompt": "after", "max_tokens": 4, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as c:
            resps = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))
        assert [r.status_code for r in resps] == [200] * 8
        assert metric_sum(http, "vllm:request_success_total", engine="1") > served_before
        log = server_log(stack)
        assert re.search(r"engine 1 lost .*waiting for its launcher to start it again", log)
        assert "engine 1 rejoined" in log
        assert "Task exception was never retrieved" not in log


@pytest.mark.skipif(_NO_OUTPUT is not None, reason=_NO_OUTPUT or "")
def test_stream_interval_with_native_output(tmp_path: Path) -> None:
    """``vllm serve --stream-interval 4``: corewire's native output processing stays on
    (no "kept" line) and streams the same events as vLLM's output processing under the
    same client, chunk for chunk: the first token alone, then four tokens (text, ids and
    logprobs) per chunk, the rest with the finish; chat and a stop string too."""
    interval = ("--stream-interval", "4")
    body = {"prompt": "the old house on the hill", "max_tokens": 14, "temperature": 0.0}
    body |= {"ignore_eos": True, "logprobs": 5, "return_token_ids": True}
    chat_body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "tell me about the old house"}],
        "max_tokens": 11,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    events: dict[str, list[Any]] = {}
    for setting in ("corewire", "corewire+output"):
        client, env = SETTINGS[setting]
        workdir = tmp_path / setting.replace("+", "-")
        with (
            running_stack(
                workdir, client=client, server_env=env, extra_server_args=interval
            ) as stack,
            http_client(stack) as http,
        ):
            log = server_log(stack)
            assert (OUTPUT_LOG_LINE in log) == (setting == "corewire+output"), log[-2000:]
            assert OUTPUT_KEPT_LOG_LINE not in log
            text = "".join(
                e["choices"][0]["text"]
                for e in stream(http, "/v1/completions", **body)
                if e["choices"]
            )
            stop = text.split()[4]
            events[setting] = [
                without_ids(stream(http, "/v1/completions", **body)),
                without_ids(stream(http, "/v1/completions", **body, stop=[stop])),
                without_ids(stream(http, "/v1/chat/completions", **chat_body)),
            ]
    joins = (joined_completion_stream, joined_completion_stream, joined_chat_stream)
    for i, (mine, theirs, join) in enumerate(
        zip(events["corewire+output"], events["corewire"], joins, strict=True)
    ):
        if _token_chunks(mine) == _token_chunks(theirs):
            # The usual case: the same events, chunk for chunk.
            assert mine == theirs, f"stream {i}: {first_difference(mine, theirs)}"
        else:
            # A server that lagged merged outputs into fewer chunks: the same answer.
            assert join(mine) == join(theirs), f"stream {i}: {first_difference(mine, theirs)}"
    for setting, streams in events.items():
        sizes = _token_chunks(streams[0])
        # The first token alone, then four at a time (a multiple where the server lagged
        # and merged), the last one with the finish: never a chunk boundary elsewhere.
        boundaries = list(itertools.accumulate(sizes[:-1]))
        assert sizes[0] == 1 and sum(sizes) == 14, (setting, sizes)
        assert all((b - 1) % 4 == 0 for b in boundaries), (setting, sizes)


def _token_chunks(events: list[dict[str, Any]]) -> list[int]:
    """Tokens per event of a stream: token ids of a completion, logprob entries of a
    chat completion (its role-only first event carries none)."""
    sizes = []
    for event in events:
        for choice in event["choices"]:
            if "token_ids" in choice:
                sizes.append(len(choice["token_ids"] or []))
            else:
                sizes.append(len((choice.get("logprobs") or {}).get("content") or []))
    return [n for n in sizes if n]


def test_two_engines_behind_one_front_end(tmp_path: Path) -> None:
    """DP = 2: vLLM's coordinator and two corewire engines; requests reach both engines
    and the greedy text does not depend on the engine that ran it. With corewire's client
    where the plugin is installed (its DP client under vLLM's coordinator), else vLLM's:
    one DP stack costs ~25 s on a 2-core machine. vLLM's coordinator is sent nothing it
    does not expect (0.33.0 on have no first-request notices)."""
    client = "corewire" if _NO_PLUGIN is None else "vllm"
    log = check_two_engines_behind_one_front_end(tmp_path, client)
    if client == "corewire":
        assert f"{PLUGIN_LOG_LINE} {client_classes(RELEASE)['dplb'].__name__}" in log
    assert "unexpected message" not in log


@pytest.mark.skipif(_NO_PLUGIN is not None, reason=_NO_PLUGIN or "")
def test_two_api_servers_with_corewire_clients(tmp_path: Path) -> None:
    """vLLM's multi-API-server layout (``--api-server-count 2``) with the plugin on: each
    server process builds corewire's client on the addresses vLLM's parent hands it and
    reports the endpoints it bound back to that parent, which only then starts the
    engine handshake. Both servers answer, on the one shared port; each runs the
    installed release's client class."""
    log = check_two_api_servers_with_corewire_clients(tmp_path)
    assert client_classes(RELEASE)["plain"].__name__ in log


def test_serve_command_serves_until_ctrl_c(tmp_path: Path) -> None:
    """``python -m corewire.vllm.serve.stack`` (the body of scripts/serve): serves on the port
    it chose (``--port 0``) and names it, and Ctrl-C (SIGINT) stops the API server and
    the engines, status 0."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "corewire.vllm.serve.stack", "--port", "0", "--client", "vllm"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        while b"Ctrl-C stops" not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.25)
        # --port 0: the stack chose the port, and says which.
        found = re.search(rb"serving .* at (http://127\.0\.0\.1:(\d+)) ", log.read_bytes())
        assert found is not None and int(found[2]) > 0, log.read_text(errors="replace")
        url = found[1].decode()
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2  # the API server and one engine
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 4}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT)
        assert resp.status_code == 200
        assert resp.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- no server


def test_model_dir_tokenizer_matches_the_engine_vocabulary(tmp_path: Path) -> None:
    """The written tokenizer loads as vLLM loads it: one token per engine id, the engine's
    eos and pad ids as special tokens, text decoded as words joined by spaces, a chat
    template; ids the engine could not use are refused."""
    from vllm.tokenizers import get_tokenizer

    model_dir = write_model_dir(tmp_path / "model", vocab_size=512, max_model_len=256)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["vocab_size"], config["max_position_embeddings"]) == (512, 256)
    tok = get_tokenizer(str(model_dir))
    assert len(tok) == 512
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    ids = tok.encode("hello world , the fox")
    assert 3 not in ids  # no <unk>: every word is in the vocabulary
    assert tok.decode(ids) == "hello world , the fox"
    assert tok.decode([511, 2, 7], skip_special_tokens=True) == "w511 " + tok.decode([7])
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(chat_ids, Mapping):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    assert tok.decode(chat_ids) == "user : hi assistant :"
    with pytest.raises(ValueError, match="eos"):
        write_model_dir(tmp_path / "bad", eos_token_id=7)


def test_model_dir_markers_are_whole_tokens_kept_in_the_text(tmp_path: Path) -> None:
    """``markers`` take the ids after the special ones, encode whole in a prompt and stay
    in the decoded text (a reasoning model's ``<think>``), the vocabulary the same size;
    too small a vocabulary for them is refused."""
    from vllm.tokenizers import get_tokenizer

    markers = ("<think>", "</think>")
    model_dir = write_model_dir(tmp_path / "model", vocab_size=16, markers=markers)
    tok = get_tokenizer(str(model_dir))
    assert len(tok) == 16
    assert [tok.get_vocab()[m] for m in markers] == [4, 5]
    ids = tok.encode("<think> , </think> .")
    assert ids[0] == 4 and ids[2] == 5, ids
    assert "<think>" in tok.decode([4, 6, 5], skip_special_tokens=True)
    assert "</think>" in tok.decode([4, 6, 5], skip_special_tokens=True)
    with pytest.raises(ValueError, match="at least 6"):
        write_model_dir(tmp_path / "small", vocab_size=5, markers=markers)


def test_model_dir_weights_are_the_seeds_and_load_as_a_llama(tmp_path: Path) -> None:
    """With ``weights_seed`` the directory carries weights in the config's shapes, the same
    bytes for the same seed and others for another; without it, none."""
    from safetensors.torch import load_file

    made = {
        name: write_model_dir(tmp_path / name, vocab_size=256, weights_seed=seed)
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    }
    files = {name: (path / "model.safetensors").read_bytes() for name, path in made.items()}
    assert files["a"] == files["b"] != files["c"]
    config = json.loads((made["a"] / "config.json").read_text())
    tensors = load_file(str(made["a"] / "model.safetensors"))
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    assert tensors["lm_head.weight"].shape == (256, hidden)
    assert tensors["model.embed_tokens.weight"].shape == (256, hidden)
    q_rows = config["num_attention_heads"] * config["head_dim"]
    assert tensors[f"model.layers.{layers - 1}.self_attn.q_proj.weight"].shape == (q_rows, hidden)
    assert f"model.layers.{layers}.mlp.up_proj.weight" not in tensors
    # The head is wide enough that greedy choices are far from ties.
    assert float(tensors["lm_head.weight"].std()) > 0.3
    assert not (write_model_dir(tmp_path / "none") / "model.safetensors").exists()


def test_model_dir_weights_of_an_moe_config_are_experts_behind_a_router(
    tmp_path: Path,
) -> None:
    """A config with ``num_local_experts`` gets Mixtral's feed-forward (a router, then each
    expert's three projections) in place of the llama's, the rest as the llama's."""
    from safetensors.torch import load_file

    from corewire.vllm.serve.model_dir import write_weights

    made = write_model_dir(tmp_path / "m", vocab_size=256, weights_seed=0)
    config = json.loads((made / "config.json").read_text())
    moe = config | {"num_local_experts": 3}
    tensors = load_file(str(write_weights(tmp_path / "m", moe, seed=0)))
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}"
        assert tensors[f"{at}.block_sparse_moe.gate.weight"].shape == (3, hidden)
        for expert in range(3):
            ex = f"{at}.block_sparse_moe.experts.{expert}"
            assert tensors[f"{ex}.w1.weight"].shape == (inner, hidden)
            assert tensors[f"{ex}.w2.weight"].shape == (hidden, inner)
        assert not any(name.startswith(f"{at}.mlp.") for name in tensors)
        assert f"{at}.self_attn.q_proj.weight" in tensors
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" not in tensors


def test_stack_starts_again_when_its_ports_are_taken(tmp_path: Path) -> None:
    """Another process takes the ports the stack chose before vLLM binds them (the race
    of two test runs on one machine): the API server exits with "address already in
    use", and start() starts again on fresh ports and comes up healthy."""
    model_dir = write_model_dir(tmp_path / "model")
    stack = ServeStack(model_dir, port=0, client="vllm", log_dir=tmp_path / "logs")
    taken = (stack.port, stack.rpc_port)
    squatters = []
    for port in taken:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        squatters.append(sock)
        sock.bind(("127.0.0.1", port))
        sock.listen()
    try:
        stack.start(timeout=90)
        try:
            assert stack.health() == 200
            assert stack.port not in taken and stack.rpc_port not in taken
        finally:
            stack.stop()
    finally:
        for sock in squatters:
            sock.close()
    assert stack.server is not None and stack.server.poll() is not None


def test_stack_start_fails_fast_when_an_engine_dies(tmp_path: Path) -> None:
    """An engine that cannot start ends start() with StackError naming it and showing its
    log, at once (not after the start-up timeout), and nothing is left running."""
    model_dir = write_model_dir(tmp_path / "model")
    stack = ServeStack(
        model_dir,
        port=0,
        client="vllm",
        engine_args={"vocab_size": 2},  # the eos id 2 is outside: the engine refuses
        log_dir=tmp_path / "logs",
    )
    started = time.monotonic()
    with pytest.raises(StackError, match=r"engine 0 exited(?s:.*)eos_token_id"):
        stack.start(timeout=60)
    assert time.monotonic() - started < 30
    assert stack.server is not None and stack.server.poll() is not None
