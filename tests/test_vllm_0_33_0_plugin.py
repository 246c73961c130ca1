"""corewire's client inside vLLM 0.33.0's real ``AsyncLLM`` (runs only where vLLM 0.33.0 is
installed; skipped with vLLM 0.25.1, failed where CI requires 0.33.0 and it is missing).

``AsyncLLM`` is built as ``vllm serve --data-parallel-size-local 0`` builds it: no engines
of its own, ``corewire engine --protocol 0.33.0`` processes joining through vLLM's start-up
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
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

_REQUIRED = os.environ.get("COREWIRE_REQUIRE_VLLM")
if _REQUIRED:
    import vllm
else:
    vllm = pytest.importorskip("vllm")
if vllm.__version__.split("+")[0] != "0.33.0":
    if _REQUIRED:
        raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={_REQUIRED}, found vLLM {vllm.__version__}")
    pytest.skip(f"needs vLLM 0.33.0 (found {vllm.__version__})", allow_module_level=True)

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

from corewire.engine.interface import EngineInfo  # noqa: E402
from corewire.layouts import RequestError  # noqa: E402
from corewire.ready_layouts import ready_response_for  # noqa: E402
from corewire.vllm import plugin  # noqa: E402
from corewire.vllm.client import make_async_mp_client  # noqa: E402
from corewire.vllm.v0_33_0 import Vllm0330AsyncMPClient  # noqa: E402
from dp_support import free_tcp_port  # noqa: E402
from vllm_support import (  # noqa: E402
    ENGINE_ARGS,
    EngineProcs,
    offline_environment,
    reference_run,
    vllm_config,
    write_model_dir,
)

offline_environment()

_DEADLINE_S = 90.0


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="corewire-vllm33-") as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


@pytest.fixture
def corewire_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's client factory replaced by corewire's, as the plugin does, for this test."""
    monkeypatch.setattr(
        EngineCoreClient, "make_async_mp_client", staticmethod(make_async_mp_client)
    )


@pytest.fixture
async def frontend(root: Path, corewire_factory: None) -> AsyncIterator[tuple[Any, EngineProcs]]:
    """vLLM 0.33.0's ``AsyncLLM`` (front-end only) and one ``corewire engine --protocol
    0.33.0`` that joined it; both stopped after the test."""
    port = free_tcp_port()
    engines = EngineProcs(root)
    engines.start(
        "--handshake-address",
        f"tcp://127.0.0.1:{port}",
        "--engine-index",
        "0",
        "--handshake-timeout",
        "60",
        "--protocol",
        "0.33.0",
    )
    config = vllm_config(
        write_model_dir(root / "model"),
        data_parallel_size=1,
        data_parallel_size_local=0,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_rpc_port=port,
    )
    llm = None
    try:
        llm = AsyncLLM(
            vllm_config=config, executor_class=Executor.get_class(config), log_stats=False
        )
        yield llm, engines
    finally:
        if llm is not None:
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


_PROBE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.engine.core_client import EngineCoreClient
factory = EngineCoreClient.make_async_mp_client
print(factory.__module__ + "." + factory.__qualname__)
"""


@pytest.mark.parametrize(
    ("switch", "factory"),
    [
        (None, "vllm.v1.engine.core_client.EngineCoreClient.make_async_mp_client"),
        ("1", "corewire.vllm.client.make_async_mp_client"),
    ],
)
def test_plugin_switches_vllm_0_33_0s_factory(switch: str | None, factory: str) -> None:
    """Under vLLM 0.33.0 the plugin is accepted (not refused by version) and installs
    corewire's factory exactly when switched on."""
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_SWITCH}
    if switch is not None:
        env[plugin.ENV_SWITCH] = switch
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == factory


def test_factory_refuses_what_corewire_cannot_serve_yet(root: Path) -> None:
    """Data parallelism under vLLM 0.33.0's coordinator and the multi-API-server sockets
    are refused by name before anything starts, not run half-working."""
    config = vllm_config(write_model_dir(root / "model"), data_parallel_size=2)
    with pytest.raises(NotImplementedError, match=r"kv_cache_usage"):
        make_async_mp_client(config, None, False)
    single = vllm_config(write_model_dir(root / "model1"))
    listeners = {
        "input_address": "tcp://127.0.0.1:1",
        "output_address": "tcp://127.0.0.1:2",
        "input_listener": object(),
    }
    with pytest.raises(NotImplementedError, match=r"api-server-count"):
        make_async_mp_client(single, None, False, client_addresses=listeners)


# ---------------------------------------------------------------------- real engines


async def test_generation_abort_and_utilities_through_asyncllm(
    frontend: tuple[Any, EngineProcs],
) -> None:
    """vLLM's ``AsyncLLM`` over corewire's client and engine: the reference engine's greedy
    tokens and logprobs; an abort ends the request at once; every utility call
    ``AsyncLLM`` makes answers with 0.33.0's semantics."""
    llm, engines = frontend
    assert type(llm.engine_core) is Vllm0330AsyncMPClient
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
    # vLLM 0.33.0's engine stamps its weight version on step outputs; so does corewire's.
    assert out.weight_versions, "no weight version reached vLLM"

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

    # The utility calls vLLM 0.33.0's AsyncLLM makes, with its return types.
    assert set(await llm.get_supported_tasks()) >= {"generate"}
    assert await llm.reset_prefix_cache() is True
    await llm.reset_mm_cache()
    await llm.reset_encoder_cache()
    await llm.sleep(1)
    assert await llm.is_sleeping() is True
    await llm.wake_up()
    assert await llm.is_sleeping() is False
    await llm.pause_generation(mode="abort", clear_cache=False)
    assert await llm.is_paused() is True
    await llm.resume_generation()
    assert await llm.is_paused() is False
    await llm.set_weight_version("v2")
    assert await llm.get_weight_version() == "v2"
    assert llm.get_kv_event_sources() == {}
    with pytest.raises(Exception, match="LoRA"):
        await llm.list_loras()
    # Generation still works after all of it, and the outputs carry the new version.
    out = await asyncio.wait_for(generate(llm, "after", [5, 6, 7], greedy(4)), _DEADLINE_S)
    assert out.outputs[0].token_ids == expected_tokens[:4]
    assert "v2" in {span.version for span in out.weight_versions}
    assert "joined the front-end" in engines.logs()


async def test_engine_death_raises_vllms_engine_dead_error(
    frontend: tuple[Any, EngineProcs],
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
    # The default watchdog: a check every 5 s, 10 s to answer.
    assert time.monotonic() - killed_at < 5 + 10 + 5
    assert llm.errored
    with pytest.raises(EngineDeadError):
        await llm.check_health()


# ---------------------------------------------------------------------- by hand


class _HandEngine(threading.Thread):
    """An engine speaking vLLM 0.33.0's wire by hand (vLLM's own encoder): it refuses
    every request with the ``RequestError`` it is given, as a 0.33.0 engine refuses one
    while paused (finish ERROR, the id in ``finished_requests``)."""

    def __init__(self, input_address: str, output_address: str, error: RequestError) -> None:
        super().__init__(daemon=True)
        self.error = error
        self.stopped = threading.Event()
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.DEALER)
        self.requests.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self.requests.connect(input_address)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(output_address)
        ready = ready_response_for("0.33.0", EngineInfo(max_model_len=512), engine_index=0)
        self.requests.send(msgspec.msgpack.encode(ready))

    def run(self) -> None:
        encoder = MsgpackEncoder()
        decoder = MsgpackDecoder(EngineCoreRequest)
        from vllm.outputs import RequestError as VllmRequestError

        error = VllmRequestError(self.error.code, self.error.message, self.error.retryable)
        while not self.stopped.is_set():
            if not self.requests.poll(20):
                continue
            kind, *frames = self.requests.recv_multipart()
            if kind == b"\x03":  # a utility call: AsyncLLM asks the tasks, the watchdog pings
                _, call_id, method, _ = msgspec.msgpack.decode(frames[0])
                result = UtilityResult(["generate"] if method == "get_supported_tasks" else None)
                reply = EngineCoreOutputs(utility_output=UtilityOutput(call_id, None, result))
                self.outputs.send_multipart(encoder.encode(reply))
                continue
            if kind != b"\x00":
                continue
            request = decoder.decode(frames)
            refused = EngineCoreOutput(
                request.request_id, [], finish_reason=FinishReason.ERROR, error=error
            )
            message = EngineCoreOutputs(outputs=[refused], finished_requests={request.request_id})
            self.outputs.send_multipart(encoder.encode(message))

    def close(self) -> None:
        self.stopped.set()
        self.join(5)
        self.requests.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (RequestError("engine_paused", "Generation is paused.", True), "RetryableRequestError"),
        (RequestError("validation_error", "bad grammar"), "VLLMValidationError"),
        (RequestError("boom", "the engine failed it"), "GenerationError"),
    ],
)
async def test_request_errors_reach_vllm_as_its_exceptions(
    root: Path, corewire_factory: None, error: RequestError, raised: str
) -> None:
    """An engine's ``RequestError`` becomes the exception vLLM's serving code maps to
    503 / 400 / 500, with the engine's message; the client and engine stay up."""
    addresses = {"input_address": f"ipc://{root}/in", "output_address": f"ipc://{root}/out"}
    config = vllm_config(write_model_dir(root / "model"))
    engine: list[_HandEngine] = []
    joiner = threading.Timer(
        0.3,
        lambda: engine.append(
            _HandEngine(addresses["input_address"], addresses["output_address"], error)
        ),
    )
    joiner.start()
    llm = AsyncLLM(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
        client_addresses=addresses,
    )
    joiner.join()
    hand = engine[0]
    hand.start()
    try:
        with pytest.raises(Exception, match=error.message) as caught:
            await asyncio.wait_for(generate(llm, "r", [5, 6], greedy(4)), 30)
        assert type(caught.value).__name__ == raised
        if raised == "VLLMValidationError":
            assert isinstance(caught.value, VLLMValidationError)
        assert not llm.errored
    finally:
        llm.shutdown()
        await asyncio.sleep(0)
        hand.close()
