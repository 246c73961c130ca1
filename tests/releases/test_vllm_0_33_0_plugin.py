"""corewire's client inside vLLM 0.33.0's real ``AsyncLLM`` (runs only where vLLM 0.33.0 is
installed; skipped with vLLM 0.25.1, failed where CI requires 0.33.0 and it is missing).

``AsyncLLM`` is built as ``vllm serve --data-parallel-size-local 0`` builds it: no engines
of its own, ``corewire engine --release 0.33.0`` processes joining through vLLM's start-up
handshake, and corewire's client factory in place of vLLM's (what the plugin installs;
here for the test only, restored after it). Through vLLM's own API it checks generation
(the reference engine's tokens and logprobs), an abort mid-request, every utility call
``AsyncLLM`` makes, and an engine death turning into vLLM's ``EngineDeadError``. A thread
speaking the protocol by hand sends what corewire's engine does not (request errors).

Checks ``docs/protocol.md`` §3.2 (engines join a vLLM front-end), §4 (requests, aborts,
utility calls) and §7 (a killed engine), with vLLM 0.33.0's layouts (§11).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_0_33_0_gate import RELEASE, require_vllm_0_33_0

vllm = require_vllm_0_33_0()

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.v1.engine import (  # noqa: E402
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.core_client import EngineCoreClient  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402
from vllm.v1.executor import Executor  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from corewire import releases  # noqa: E402
from corewire.engine.interface import EngineInfo  # noqa: E402
from corewire.engine.ready_layouts import ReadyFacts, ready_response_for  # noqa: E402
from corewire.vllm.adapters.classes import client_classes, make_async_mp_client  # noqa: E402
from corewire.vllm.adapters.client import HEALTH_INTERVAL_ENV, HEALTH_TIMEOUT_ENV  # noqa: E402
from corewire.vllm.adapters.v0_33_0 import FT_UTILITY_METHOD  # noqa: E402
from corewire.vllm.output.by_release import native_output_processor  # noqa: E402
from corewire.wire.layouts import FT_STATUS_CALL_ID, RequestError  # noqa: E402
from port_support import ATTEMPTS, address_in_use, unused_tcp_port  # noqa: E402
from vllm_join_support import frontend_only_config, join_args, private_root  # noqa: E402
from vllm_support import (  # noqa: E402
    ENGINE_ARGS,
    EngineProcs,
    factory_after_plugins,
    offline_environment,
    reference_run,
    vllm_config,
    write_model_dir,
)

offline_environment()

_DEADLINE_S = 90.0
#: Whether the release under test has vLLM 0.34.0's client calls (the sleep and KV
#: release flag, process checkpoints, the managed engine's status map).
NEWER_CALLS = releases.get(RELEASE).process_checkpoints
#: Whether the release under test has vLLM 0.33.0's ``pause_generation`` (refusing new
#: requests while paused); before it (0.32.0) ``AsyncLLM`` pauses the scheduler, and new
#: requests wait for the resume.
PAUSE_REFUSES = releases.get(RELEASE).generation_pause_utilities
#: Whether the client factory takes vLLM's renderer, whose multimodal warm-up the client
#: starts once its engines are forked (0.30.0 on); the calls of it a client start makes.
WARMS_UP = hasattr(
    importlib.import_module("vllm.renderers.base").BaseRenderer, "start_mm_warmup_in_background"
)
WARMUP_CALLS = [1] if WARMS_UP else []
#: Whether step outputs carry the engine's weight version (0.32.0 on).
WEIGHT_VERSIONS = releases.get(RELEASE).weight_versions
#: Whether the release's engines refuse requests with a ``RequestError`` (0.33.0 on).
REQUEST_ERRORS = releases.get(RELEASE).request_errors


@pytest.fixture
def root() -> Iterator[Path]:
    with private_root("corewire-vllm33-") as path:
        yield path


@pytest.fixture
def warmups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of vLLM's renderer's multimodal warm-up (which still runs)."""
    from vllm.renderers.base import BaseRenderer

    calls: list[int] = []
    if not WARMS_UP:
        return calls
    original = BaseRenderer.start_mm_warmup_in_background

    def counted(self: Any) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(BaseRenderer, "start_mm_warmup_in_background", counted)
    return calls


@pytest.fixture
def corewire_factory(monkeypatch: pytest.MonkeyPatch, warmups: list[int]) -> list[int]:
    """vLLM's client factory replaced by corewire's, as the plugin does, for this test;
    the renderer's warm-up calls counted."""
    monkeypatch.setattr(
        EngineCoreClient, "make_async_mp_client", staticmethod(make_async_mp_client)
    )
    return warmups


@pytest.fixture
async def frontend(
    root: Path, corewire_factory: list[int]
) -> AsyncIterator[tuple[Any, EngineProcs]]:
    """vLLM 0.33.0's ``AsyncLLM`` (front-end only) and one ``corewire engine --release
    0.33.0`` that joined it; both stopped after the test."""
    # vLLM binds the handshake port the engine was given: on a port taken meanwhile
    # (EADDRINUSE), start again on a fresh one.
    for attempt in range(1, ATTEMPTS + 1):
        port = unused_tcp_port()
        engines = EngineProcs(root)
        engines.start(*join_args(port, 0, release=RELEASE))
        config = frontend_only_config(root / "model", port)
        try:
            llm = AsyncLLM(
                vllm_config=config, executor_class=Executor.get_class(config), log_stats=False
            )
            break
        except Exception as exc:
            engines.stop()
            if attempt == ATTEMPTS or not address_in_use(exc):
                raise
            corewire_factory.clear()
    try:
        # vLLM's launch path: the warm-up started once, after the (no) local engines forked.
        assert corewire_factory == WARMUP_CALLS
        yield llm, engines
    finally:
        llm.shutdown()
        await asyncio.sleep(0)
        engines.stop()


def greedy(max_tokens: int, **more: Any) -> SamplingParams:
    """Greedy sampling with token ids only (the model directory has no tokenizer)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, **more)


async def generate(llm: Any, rid: str, prompt: list[int], params: SamplingParams) -> Any:
    """The last ``RequestOutput`` of one request."""
    last = None
    async for out in llm.generate({"prompt_token_ids": prompt}, params, rid):
        last = out
    return last


# ---------------------------------------------------------------------- the plugin


@pytest.mark.parametrize(
    ("switch", "factory"),
    [
        (None, "vllm.v1.engine.core_client.EngineCoreClient.make_async_mp_client"),
        ("1", "corewire.vllm.adapters.classes.make_async_mp_client"),
    ],
)
def test_plugin_switches_vllm_0_33_0s_factory(switch: str | None, factory: str) -> None:
    """Under vLLM 0.33.0 the plugin is accepted (not refused by version) and installs
    corewire's factory exactly when switched on."""
    assert factory_after_plugins(switch) == factory


_OUTPUT_PROBE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
import vllm.v1.engine.async_llm as async_llm
import vllm.v1.engine.llm_engine as llm_engine
for cls in (async_llm.OutputProcessor, llm_engine.OutputProcessor):
    print(cls.__module__ + "." + cls.__qualname__)
"""


@pytest.mark.parametrize("output", [None, "0"], ids=["output-unset", "output-0"])
def test_client_switch_brings_the_releases_native_output_processor(output: str | None) -> None:
    """With corewire's client, ``AsyncLLM`` builds the installed release's native output
    processor (held to that release's by ``test_vllm_output_diff.py``) unless
    ``COREWIRE_VLLM_OUTPUT=0``; ``LLMEngine`` keeps vLLM's."""
    import subprocess
    import sys

    from corewire.vllm import plugin

    env = {k: v for k, v in os.environ.items() if k != plugin.OUTPUT_SWITCH}
    env[plugin.ENV_SWITCH] = "1"
    if output is not None:
        env[plugin.OUTPUT_SWITCH] = output
    done = subprocess.run(
        [sys.executable, "-c", _OUTPUT_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    built = done.stdout.strip().splitlines()[-2:]
    vllms = "vllm.v1.engine.output_processor.OutputProcessor"
    native = native_output_processor(releases.get(RELEASE))
    # Off where it was not held to the release's OutputProcessor (0.26.0-0.32.0).
    off = output == "0" or not releases.get(RELEASE).native_output
    expected = vllms if off else f"{native.__module__}.{native.__qualname__}"
    assert built == [expected, vllms]


# ---------------------------------------------------------------------- real engines


async def test_generation_abort_and_utilities_through_asyncllm(
    frontend: tuple[Any, EngineProcs],
) -> None:
    """vLLM's ``AsyncLLM`` over corewire's client and engine: the reference engine's greedy
    tokens and logprobs; an abort ends the request at once; every utility call
    ``AsyncLLM`` makes answers with 0.33.0's semantics."""
    llm, engines = frontend
    assert type(llm.engine_core) is client_classes(RELEASE)["plain"]
    # The engine's ready response reached vLLM's config (its smaller limit won).
    assert llm.vllm_config.model_config.max_model_len == ENGINE_ARGS["max_model_len"]

    prompt = [5, 6, 7]
    out = await asyncio.wait_for(generate(llm, "g", prompt, greedy(8, logprobs=2)), _DEADLINE_S)
    completion = out.outputs[0]
    expected_tokens, expected_logprobs = reference_run(
        [("g", prompt, {"temperature": 0.0, "max_tokens": 8, "logprobs": 2})]
    )["g"]
    assert completion.token_ids == expected_tokens
    assert completion.finish_reason == "length"
    sampled = [
        entry[tok].logprob for entry, tok in zip(completion.logprobs, expected_tokens, strict=True)
    ]
    assert sampled == pytest.approx([float(rows[0][0]) for rows in expected_logprobs], abs=1e-4)
    # vLLM 0.33.0's engine stamps its weight version on step outputs; so does corewire's
    # (where the release's wire carries it: 0.32.0 on).
    if WEIGHT_VERSIONS:
        assert [s.version for s in completion.weight_versions or ()] == ["default"]

    # An abort mid-request: the stream ends with finish "abort" long before max_tokens.
    tokens: list[int] = []
    started = time.monotonic()

    async def long_request() -> Any:
        last = None
        async for part in llm.generate({"prompt_token_ids": [9]}, greedy(400), "long"):
            last = part
            tokens[:] = part.outputs[0].token_ids
        return last

    task = asyncio.ensure_future(long_request())
    while len(tokens) < 3:
        await asyncio.sleep(0.01)
    await llm.abort("long")
    final = await asyncio.wait_for(task, 10)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 400
    assert time.monotonic() - started < 400 * ENGINE_ARGS["step_delay"]

    # The utility calls vLLM 0.33.0's AsyncLLM makes, with their return types (their
    # exact wire arguments: test_0_33_0_utility_calls_on_the_wire).
    assert set(await llm.get_supported_tasks()) >= {"generate"}
    assert await llm.reset_prefix_cache() is True
    await llm.reset_mm_cache()
    await llm.reset_encoder_cache()
    await llm.sleep(1)
    assert await llm.is_sleeping() is True
    await llm.wake_up()
    assert await llm.is_sleeping() is False
    assert await llm.is_paused() is False
    # Paused generation: the engine refuses a new request with its RequestError, which
    # reaches the caller as vLLM's retryable error (503 over HTTP); resumed, it serves.
    await llm.pause_generation(mode="abort", clear_cache=False)
    assert await llm.is_paused() is True
    if PAUSE_REFUSES:
        with pytest.raises(Exception, match="paused") as refused:
            await asyncio.wait_for(generate(llm, "while-paused", [5], greedy(2)), _DEADLINE_S)
        assert type(refused.value).__name__ == "RetryableRequestError"
        await llm.resume_generation()
    else:
        # Before 0.33.0 a request waits while the scheduler is paused, then runs.
        queued = asyncio.ensure_future(generate(llm, "while-paused", [5], greedy(2)))
        await asyncio.sleep(0.5)
        assert not queued.done()
        await llm.resume_generation()
        out = await asyncio.wait_for(queued, _DEADLINE_S)
        assert len(out.outputs[0].token_ids) == 2 and out.finished
    assert await llm.is_paused() is False
    # Weights: the label the engine stamps on its outputs, and their checksums.
    assert await llm.get_weight_version() == "default"
    await llm.update_weight_version("v2")
    assert await llm.get_weight_version() == "v2"
    if hasattr(llm, "compute_weight_checksums"):  # 0.32.0 on
        checksums = await llm.compute_weight_checksums()
        assert checksums and all(isinstance(c, dict) for c in checksums)
        # AsyncLLM.wake_up answers whether every engine is awake (0.32.0 on; None before).
        assert await llm.wake_up() is True
    if hasattr(llm, "get_kv_event_sources"):  # 0.31.0 on
        assert llm.get_kv_event_sources() == {}
    with pytest.raises(Exception, match="LoRA"):
        await llm.list_loras()
    # Generation goes on after all of it, under the new weight label.
    out = await asyncio.wait_for(generate(llm, "after", [5, 6, 7], greedy(4)), _DEADLINE_S)
    assert out.outputs[0].token_ids == expected_tokens[:4]
    if WEIGHT_VERSIONS:
        assert [s.version for s in out.outputs[0].weight_versions or ()] == ["v2"]
    assert "joined the front-end" in engines.logs()


@pytest.fixture
def quick_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """corewire's health watchdog made quick: a check every second, 2 s to answer."""
    monkeypatch.setenv(HEALTH_INTERVAL_ENV, "1")
    monkeypatch.setenv(HEALTH_TIMEOUT_ENV, "2")


async def test_engine_death_raises_vllms_engine_dead_error(
    quick_watchdog: None, frontend: tuple[Any, EngineProcs]
) -> None:
    """SIGKILL of the engine mid-request: the request ends with vLLM's own
    ``EngineDeadError`` (the class its serving code and /health catch) within the health
    timeout, and so do later calls."""
    llm, engines = frontend
    tokens: list[int] = []

    async def long_request() -> None:
        async for part in llm.generate({"prompt_token_ids": [9]}, greedy(400), "doomed"):
            tokens[:] = part.outputs[0].token_ids

    task = asyncio.ensure_future(long_request())
    while len(tokens) < 3:
        await asyncio.sleep(0.01)
    killed_at = time.monotonic()
    os.kill(engines.procs[0].pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, 30)
    # A check every second, 2 s to answer, and slack for a loaded machine.
    assert time.monotonic() - killed_at < 1 + 2 + 5
    assert llm.errored
    with pytest.raises(EngineDeadError):
        await llm.check_health()


# ---------------------------------------------------------------------- by hand


class _HandEngine(threading.Thread):
    """An engine speaking vLLM 0.33.0's wire by hand (vLLM's own encoder), for what
    corewire's engine does not send. Utility calls are recorded and answered from
    ``results`` (None for others), after pushing the fault-tolerance status ``statuses``
    names for that method (call id -2, as a 0.33.0 engine's sentinel pushes one); every
    request is refused with ``error``, as a 0.33.0 engine refuses one while paused (finish
    ERROR, the id in ``finished_requests``)."""

    def __init__(
        self,
        addresses: dict[str, str],
        error: RequestError | None = None,
        results: dict[str, Any] | None = None,
        statuses: dict[str, dict[str, Any]] | None = None,
        facts: ReadyFacts | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.error = error
        self.statuses = statuses or {}
        self.results = {"get_supported_tasks": ["generate"], **(results or {})}
        #: ``(method, args)`` of every utility call but the watchdog's health checks.
        self.calls: list[tuple[str, list[Any]]] = []
        self.stopped = threading.Event()
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.DEALER)
        self.requests.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self.requests.connect(addresses["input_address"])
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(addresses["output_address"])
        info = EngineInfo(max_model_len=512)
        ready = ready_response_for(RELEASE, info, engine_index=0, facts=facts)
        self.requests.send(msgspec.msgpack.encode(ready))

    def run(self) -> None:
        encoder = MsgpackEncoder()
        decoder = MsgpackDecoder(EngineCoreRequest)
        while not self.stopped.is_set():
            if not self.requests.poll(20):
                continue
            kind, *frames = self.requests.recv_multipart()
            if kind == b"\x03":
                _, call_id, method, args = msgspec.msgpack.decode(frames[0])
                if method != "is_sleeping":
                    self.calls.append((method, args))
                if method in self.statuses:
                    status = UtilityOutput(
                        FT_STATUS_CALL_ID, None, UtilityResult(self.statuses[method])
                    )
                    pushed = EngineCoreOutputs(engine_index=0, utility_output=status)
                    self.outputs.send_multipart(encoder.encode(pushed))
                result = UtilityResult(self.results.get(method))
                reply = EngineCoreOutputs(utility_output=UtilityOutput(call_id, None, result))
                self.outputs.send_multipart(encoder.encode(reply))
            elif kind == b"\x00" and self.error is not None:
                request = decoder.decode(frames)
                error = vllm.outputs.RequestError(
                    self.error.code, self.error.message, self.error.retryable
                )
                refused = EngineCoreOutput(
                    request.request_id, [], finish_reason=FinishReason.ERROR, error=error
                )
                message = EngineCoreOutputs(
                    outputs=[refused], finished_requests={request.request_id}
                )
                self.outputs.send_multipart(encoder.encode(message))

    def close(self) -> None:
        self.stopped.set()
        self.join(5)
        self.requests.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()


@contextlib.asynccontextmanager
async def hand_frontend(root: Path, **engine: Any) -> AsyncIterator[tuple[Any, _HandEngine]]:
    """vLLM 0.33.0's ``AsyncLLM`` on ``client_addresses`` with a :class:`_HandEngine`
    (``engine``: its arguments) connected to them."""
    addresses = {"input_address": f"ipc://{root}/in", "output_address": f"ipc://{root}/out"}
    config = vllm_config(write_model_dir(root / "model"))
    joined: list[_HandEngine] = []
    # The client waits for the ready map in its constructor: connect meanwhile.
    joiner = threading.Timer(0.3, lambda: joined.append(_HandEngine(addresses, **engine)))
    joiner.start()
    llm = AsyncLLM(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
        client_addresses=addresses,
    )
    joiner.join()
    hand = joined[0]
    hand.start()
    try:
        yield llm, hand
    finally:
        llm.shutdown()
        await asyncio.sleep(0)
        hand.close()


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (RequestError("engine_paused", "Generation is paused.", True), "RetryableRequestError"),
        (RequestError("validation_error", "bad grammar"), "VLLMValidationError"),
        (RequestError("boom", "the engine failed it"), "GenerationError"),
    ],
)
async def test_request_errors_reach_vllm_as_its_exceptions(
    root: Path, corewire_factory: list[int], error: RequestError, raised: str
) -> None:
    """An engine's ``RequestError`` becomes the exception vLLM's serving code maps to
    503 / 400 / 500, with the engine's message; the client and engine stay up."""
    if not REQUEST_ERRORS:
        pytest.skip(f"vLLM {RELEASE}'s outputs carry no RequestError (0.33.0 on)")
    async with hand_frontend(root, error=error) as (llm, _hand):
        with pytest.raises(Exception, match=error.message) as caught:
            await asyncio.wait_for(generate(llm, "r", [5, 6], greedy(4)), 30)
        assert type(caught.value).__name__ == raised
        if raised == "VLLMValidationError":
            assert isinstance(caught.value, VLLMValidationError)
        assert not llm.errored


@pytest.mark.skipif(
    not hasattr(AsyncLLM, "compute_weight_checksums"),
    reason=f"vLLM {RELEASE}'s AsyncLLM makes few of these calls (0.32.0 on)",
)
async def test_0_33_0_utility_calls_on_the_wire(root: Path, corewire_factory: list[int]) -> None:
    """The calls vLLM 0.33.0's ``AsyncLLM`` makes that 0.25.1's did not, or made with other
    arguments, reach the engine as 0.33.0's client sends them, and their answers come
    back as it returns them (the engine here records and answers by hand)."""
    results = {
        "wake_up": True,
        "is_scheduler_paused": True,
        "get_weight_version": "v7",
        "compute_weight_checksums": [{"layer.0": "ab12"}, {"layer.1": "cd34"}],
        "checkpoint_prepare": "not now",
        "checkpoint_state": ["failed", "disk full"],
    }
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5599"}
    facts = ReadyFacts(kv_events_config=kv_events, effective_attention_block_size=32)
    async with hand_frontend(root, results=results, facts=facts) as (llm, hand):
        # The ready response's 0.33.0 facts applied as vLLM's client applies them.
        sources = llm.get_kv_event_sources()
        assert list(sources) == [0]
        assert (sources[0].publisher, sources[0].endpoint) == ("zmq", "tcp://*:5599")
        assert llm.vllm_config.cache_config.effective_attention_block_size == 32
        await llm.pause_generation(mode="wait", clear_cache=False)
        assert await llm.is_paused() is True
        await llm.resume_generation()
        assert await llm.wake_up(["weights"]) is True
        await llm.release_kv_cache_memory()
        await llm.update_weight_version("v7")
        assert await llm.get_weight_version() == "v7"
        assert await llm.compute_weight_checksums() == results["compute_weight_checksums"]
        await llm.engine_core.profile_async(True, "p", 2, 5, {"with_stack": True})
        with pytest.raises(NotImplementedError, match="elastic EP"):
            await llm.engine_core.prepare_elastic_ep(2)
        assert await llm.engine_core.get_external_elastic_ep_status() is None
        if NEWER_CALLS:
            # 0.34.0's sleep flag and process-checkpoint calls, and their answers.
            await llm.sleep(1, mode="wait", reset_connector=False)
            assert await llm.checkpoint_prepare(mode="keep") == "not now"
            from vllm.v1.engine import CheckpointState

            assert await llm.checkpoint_state() == (CheckpointState.FAILED, "disk full")
        calls = [c for c in hand.calls if c[0] not in ("get_supported_tasks", "reset_mm_cache")]
    # The client started the renderer's warm-up once: engines elsewhere, at once.
    assert corewire_factory == WARMUP_CALLS
    expected = [
        ("pause_generation" if PAUSE_REFUSES else "pause_scheduler", ["wait", False]),
        ("is_scheduler_paused", []),
        ("resume_scheduler", []),
        ("wake_up", [["weights"]]),
        ("release_kv_cache_memory", [True] if NEWER_CALLS else []),
        ("set_weight_version", ["v7"]),
        ("get_weight_version", []),
        ("compute_weight_checksums", []),
        ("profile", [True, "p", 2, 5, {"with_stack": True}]),
    ]
    if NEWER_CALLS:
        expected += [
            ("sleep", [1, "wait", False]),
            ("checkpoint_prepare", ["keep"]),
            ("checkpoint_state", []),
        ]
    assert calls == expected


async def test_fault_tolerance_status_and_handling(root: Path, corewire_factory: list[int]) -> None:
    """``AsyncLLM.get_status`` reports the status the engine pushed (call id -2), and
    ``handle_fault`` sends vLLM's ``FaultToleranceRequest`` to the engine's
    ``handle_fault_tolerance``, returns vLLM's ``FaultToleranceResult`` and records a
    refusal in the engine's status, as vLLM 0.33.0's client does."""
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest, FaultToleranceResult

    unhealthy = {"id": 0, "status": "unhealthy", "fault_info": "RuntimeError"}
    refusal = {"request_id": "ft-1", "success": False, "reason": "retry failed"}
    engine = {
        "results": {FT_UTILITY_METHOD: refusal},
        "statuses": {FT_UTILITY_METHOD: unhealthy},
    }
    async with hand_frontend(root, **engine) as (llm, hand):
        assert await llm.get_status() == {"schema_version": 1, "total_engines": 1, "engines": []}
        request = FaultToleranceRequest("retry", {"timeout": 5}, "ft-1")
        result = await llm.handle_fault(request)
        assert result == FaultToleranceResult("ft-1", False, "retry failed")
        status = await llm.get_status()
    # 0.34.0 on also keeps the recovery's progress (failed, here) in the engine's map.
    progress = {"ft_state": "failed"} if NEWER_CALLS else {}
    assert status["engines"] == [
        {**unhealthy, **progress, "last_ft_request_id": "ft-1", "ft_error": "retry failed"}
    ]
    method, args = hand.calls[-1]
    assert method == FT_UTILITY_METHOD
    assert args == [{"instruction": "retry", "params": {"timeout": 5}, "request_id": "ft-1"}]
