"""``corewire engine --handshake-address`` joins vLLM 0.25.1's own front-end.

The front-end is vLLM's real engine-core client built the way ``vllm serve
--data-parallel-size-local 0`` builds it: no engines of its own, a handshake ROUTER on
``--data-parallel-rpc-port``, and (DP > 1) vLLM's own DP coordinator process. The
engines are ``corewire engine`` processes started from the command line, before the
front-end (start order must not matter).

Checks ``docs/protocol.md`` §2 (identities, several front-ends), §3.2 (HELLO, metadata,
READY), §3.3 (the coordinator subscription), §4.7 and §8.1 (vLLM's coordinator and its
waves) and §7 (a stopped engine aborts its requests and sends ENGINE_CORE_DEAD).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from corewire import releases
from port_support import retry_port_conflicts, unused_tcp_port
from vllm_support import (
    EngineProcs,
    offline_environment,
    reference_run,
    vllm_config,
    write_model_dir,
)

offline_environment()
pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreRequestType, FinishReason  # noqa: E402
from vllm.v1.engine.core_client import AsyncMPClient, EngineCoreClient  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402

from vllm_join_support import (  # noqa: E402
    Joining,
    assert_one_engine_joins,
    assert_same_tokens,
    frontend_only_config,
    private_root,
    request,
    two_engines_behind_vllms_coordinator,
)


def _make_client(config: Any) -> Any:
    # vLLM's own factory, as its AsyncLLM calls it.
    return EngineCoreClient.make_async_mp_client(config, Executor, False)


#: 0.25.1's wire (the engine's default).
JOINING = Joining(None, 60, _make_client)
_DEADLINE_S = JOINING.timeout_s


@pytest.fixture
def root() -> Iterator[Path]:
    with private_root("corewire-vllm-join-") as path:
        yield path


def test_one_engine_joins_a_frontend_only_vllm_client(root: Path) -> None:
    # The ready response reaches vLLM's config: the engine's smaller limit wins.
    assert_one_engine_joins(root, JOINING)


def test_two_engines_join_behind_vllms_dp_coordinator(root: Path) -> None:
    counts = two_engines_behind_vllms_coordinator(root, JOINING)
    # The engines' [waiting, running] counts reached the coordinator, which published
    # them (both engines busy at some point, all idle at the end); from vLLM 0.27.0 on
    # with the KV cache's use (0.0 for the reference engine).
    idle = [0, 0, 0.0] if releases.DEFAULT.counts_carry_kv_usage else [0, 0]
    assert any(c[0] != idle for c in counts) and any(c[1] != idle for c in counts), counts
    assert counts[-1] == [idle, idle]


def test_handshake_refuses_a_coordinated_moe_group(root: Path) -> None:
    # A stand-in front-end (vLLM's handshake messages, hand-made) that answers HELLO
    # with the parallel_config a coordinated (MoE) DP group sends: the engine must
    # refuse and exit instead of joining collectives it cannot run.
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    engines = EngineProcs(root)
    try:
        proc = engines.start(*JOINING.join_args(port, 0))
        assert router.poll(30_000), engines.logs()
        identity, hello = router.recv_multipart()
        # Engine 0's identity spelled out, as vLLM's ROUTER sees it (docs/protocol.md §2).
        assert identity == b"\x00\x00"
        assert msgspec.msgpack.decode(hello) == {
            "status": "HELLO",
            "local": False,
            "headless": True,
        }
        router.send_multipart(
            [
                identity,
                msgspec.msgpack.encode(
                    {
                        "addresses": {
                            "inputs": ["tcp://127.0.0.1:1"],
                            "outputs": ["tcp://127.0.0.1:2"],
                        },
                        "parallel_config": {"data_parallel_size": 2},
                    }
                ),
            ]
        )
        assert proc.wait(30) == 1
        assert "coordinated (MoE) data-parallel group" in engines.logs()
        assert not router.poll(200)  # no READY
    finally:
        engines.stop()
        router.close(linger=0)
        ctx.term()


@retry_port_conflicts
def test_one_engine_serves_two_api_servers(root: Path) -> None:
    # vLLM's multi-API-server layout (``--api-server-count 2``): the handshake names two
    # request links and two output links; each API server's client has its own
    # client_index, and the engine answers each on its own link.
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

    port = unused_tcp_port()
    engines = EngineProcs(root)
    engines.start(*JOINING.join_args(port, 0))
    model_dir = write_model_dir(root / "model")
    parallel = {
        "data_parallel_size": 1,
        "data_parallel_size_local": 0,
        "data_parallel_master_ip": "127.0.0.1",
        "data_parallel_rpc_port": port,
    }
    links = [
        {"input_address": f"ipc://{root}/in{i}", "output_address": f"ipc://{root}/out{i}"}
        for i in (0, 1)
    ]
    results: dict[int, Any] = {}

    def api_server(index: int) -> None:
        async def main() -> Any:
            client = AsyncMPClient(
                vllm_config(model_dir, **parallel),
                Executor,
                False,
                client_addresses=links[index],
                client_count=2,
                client_index=index,
            )
            try:
                tasks = await client.get_supported_tasks_async()
                got = await JOINING.generate(
                    client, [request(f"s{index}-{i}", [index + 1, i]) for i in (0, 1)]
                )
                return tasks, got
            finally:
                client.shutdown()
                await asyncio.sleep(0)
                client.resources.ctx.destroy(linger=0)

        try:
            results[index] = asyncio.run(asyncio.wait_for(main(), _DEADLINE_S))
        except BaseException as exc:  # reported by the main thread
            results[index] = exc

    servers = [
        threading.Thread(target=api_server, args=(i,), name=f"api-server-{i}") for i in (0, 1)
    ]
    try:
        for server in servers:
            server.start()
        addresses = EngineZmqAddresses(
            inputs=[link["input_address"] for link in links],
            outputs=[link["output_address"] for link in links],
        )
        # vLLM's launcher side: binds the handshake port, waits for the engine's HELLO
        # and READY (on leaving the block), as `vllm serve` does.
        # vLLM 0.25.1 and 0.26.0 are told the API server count; later releases read it
        # off the addresses.
        takes_count = "num_api_servers" in inspect.signature(launch_core_engines).parameters
        with launch_core_engines(
            vllm_config(model_dir, **parallel),
            Executor,
            False,
            addresses,
            **({"num_api_servers": 2} if takes_count else {}),
        ):
            pass
        for server in servers:
            server.join(_DEADLINE_S)
    finally:
        codes = engines.stop()
    assert codes == [0], engines.logs()
    sp = {"temperature": 0.0, "max_tokens": 6}
    for index in (0, 1):
        assert not isinstance(results[index], BaseException), results[index]
        tasks, got = results[index]
        assert tasks == ["generate", "embed"]
        expected = reference_run([(f"s{index}-{i}", [index + 1, i], sp) for i in (0, 1)])
        assert_same_tokens(got, expected)


def test_no_answer_to_hello_ends_the_engine_with_a_clear_error(root: Path) -> None:
    engines = EngineProcs(root)
    # A port held bound but not listening: connections are refused, nothing answers.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        proc = engines.start(
            "--handshake-address", f"tcp://127.0.0.1:{port}", "--handshake-timeout", "1"
        )
        try:
            assert proc.wait(30) == 1
        finally:
            engines.stop()
    assert f"no answer to HELLO from the front-end at tcp://127.0.0.1:{port}" in engines.logs()


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (b"\xc1", "not msgpack"),
        ({"addresses": None}, "no addresses map"),
        ({"addresses": {"inputs": ["a"], "outputs": []}}, "as many input as output"),
        ({"addresses": {"inputs": ["a"], "outputs": [1]}}, "as many input as output"),
        (
            {"addresses": {"inputs": ["a"], "outputs": ["b"], "coordinator_input": "c"}},
            "only one DP coordinator address",
        ),
        (
            {"addresses": {"inputs": ["a"], "outputs": ["b"], "coordinator_input": 5}},
            "coordinator_input is not an address",
        ),
    ],
)
def test_unusable_handshake_metadata_is_refused(metadata: Any, message: str) -> None:
    from corewire.engine.handshake import HandshakeError, HandshakeMetadata

    payload = metadata if isinstance(metadata, bytes) else msgspec.msgpack.encode(metadata)
    with pytest.raises(HandshakeError, match=message):
        HandshakeMetadata.decode(payload)


def test_handshake_metadata_from_vllms_own_type() -> None:
    from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses

    from corewire.engine.handshake import HandshakeMetadata

    sent = EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(
            inputs=["tcp://h:1", "tcp://h:2"],
            outputs=["tcp://h:3", "tcp://h:4"],
            coordinator_input="ipc:///c-in",
            coordinator_output="ipc:///c-out",
            frontend_stats_publish_address="ipc:///stats",
        ),
        parallel_config={},
    )
    got = HandshakeMetadata.decode(msgspec.msgpack.encode(sent))
    assert got == HandshakeMetadata(
        inputs=["tcp://h:1", "tcp://h:2"],
        outputs=["tcp://h:3", "tcp://h:4"],
        coordinator_input="ipc:///c-in",
        coordinator_output="ipc:///c-out",
        frontend_stats_publish_address="ipc:///stats",
        parallel_config={},
    )


def test_dp_rank_speaks_vllms_coordinator_protocol(root: Path) -> None:
    # vLLM's own message types and coordinator helpers on hand-bound sockets, to see each
    # step of a DP rank's start-up and its wave / stats traffic in order.
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreReadyResponse
    from vllm.v1.engine.coordinator import DPCoordinatorProc
    from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    ctx = zmq.Context()
    sockets: dict[str, zmq.Socket[bytes]] = {"handshake": ctx.socket(zmq.ROUTER)}
    port = sockets["handshake"].bind_to_random_port("tcp://127.0.0.1")
    for name, kind, address in (
        ("input", zmq.ROUTER, f"ipc://{root}/in"),
        ("output", zmq.PULL, f"ipc://{root}/out"),
        ("coord_in", zmq.XPUB, f"ipc://{root}/coord-in"),
        ("coord_out", zmq.PULL, f"ipc://{root}/coord-out"),
    ):
        sockets[name] = ctx.socket(kind)
        sockets[name].bind(address)
    hs, inp, out, cin, cout = (
        sockets[n] for n in ("handshake", "input", "output", "coord_in", "coord_out")
    )
    decoder = MsgpackDecoder(EngineCoreOutputs)
    engines = EngineProcs(root)
    try:
        proc = engines.start(*JOINING.join_args(port, 1, "--data-parallel-size", "2"))
        assert hs.poll(30_000), engines.logs()
        identity, _hello = hs.recv_multipart()
        # Raw wire bytes on purpose, here and below where this test plays vLLM's side:
        # spelled as vLLM spells them, not with corewire's constants (docs/protocol.md
        # §2, §3.3, §4.1): engine rank 1 as two little-endian bytes.
        assert identity == b"\x01\x00"
        metadata = EngineHandshakeMetadata(
            addresses=EngineZmqAddresses(
                inputs=[f"ipc://{root}/in"],
                outputs=[f"ipc://{root}/out"],
                coordinator_input=f"ipc://{root}/coord-in",
                coordinator_output=f"ipc://{root}/coord-out",
                frontend_stats_publish_address=f"ipc://{root}/stats",
            ),
            parallel_config={},
        )
        hs.send_multipart([identity, msgspec.msgpack.encode(metadata)])
        # The ready response on the request link, decoded as vLLM decodes it.
        assert inp.poll(10_000)
        identity, payload = inp.recv_multipart()
        ready = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
        assert ready.dp_stats_address == f"ipc://{root}/stats" and ready.data_parallel_size == 2
        # It subscribes to the coordinator (ZeroMQ's subscribe-all byte), and is not
        # READY until the coordinator says b"READY", as vLLM's coordinator does.
        assert cin.poll(10_000) and cin.recv() == b"\x01"
        assert not hs.poll(500)
        cin.send(b"READY")
        assert hs.poll(10_000)
        _, status = hs.recv_multipart()
        assert msgspec.msgpack.decode(status) == {
            "status": "READY",
            "local": False,
            "headless": True,
        }

        call_ids = iter(range(1, 1000))

        def dp_state() -> dict[str, Any]:
            call_id = next(call_ids)
            inp.send_multipart(
                [
                    identity,
                    EngineCoreRequestType.UTILITY.value,
                    msgspec.msgpack.encode([0, call_id, "dp_state", []]),
                ]
            )
            while True:
                assert out.poll(10_000)
                outputs = decoder.decode(out.recv_multipart())
                if outputs.utility_output is not None and outputs.utility_output.call_id == call_id:
                    return outputs.utility_output.result.result

        def wave_becomes(wave: int) -> bool:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if dp_state()["current_wave"] == wave:
                    return True
                time.sleep(0.05)
            return False

        # START_DP_WAVE as vLLM's coordinator sends it; an excluded engine ignores it.
        DPCoordinatorProc._send_start_wave(cin, 4, None)
        assert wave_becomes(4)
        DPCoordinatorProc._send_start_wave(cin, 9, 1)
        DPCoordinatorProc._send_start_wave(cin, 5, 0)
        assert wave_becomes(5)
        # A request: counts go to the coordinator as vLLM's SchedulerStats, and the
        # finished request's id comes back in finished_requests.
        encoded = MsgpackEncoder().encode(request("dp", [4, 5], max_tokens=3))
        inp.send_multipart([identity, EngineCoreRequestType.ADD.value, *encoded])
        finished: set[str] = set()
        deadline = time.monotonic() + 10
        while "dp" not in finished and time.monotonic() < deadline:
            if out.poll(100):
                finished |= decoder.decode(out.recv_multipart()).finished_requests or set()
        assert finished == {"dp"}
        reports = []
        while cout.poll(500):
            reports.append(decoder.decode(cout.recv()))
        stats = [r.scheduler_stats for r in reports]
        assert all(r.engine_index == 1 and not r.outputs for r in reports)
        assert any(s.num_running_reqs + s.num_waiting_reqs == 1 for s in stats), stats
        assert stats[-1].num_running_reqs == stats[-1].num_waiting_reqs == 0
        if releases.DEFAULT.counts_carry_kv_usage:
            # From vLLM 0.27.0 on, the reports of a non-MoE rank: counts and the KV
            # cache's use, no wave or step (vLLM's decoder fills in 0).
            assert {(s.current_wave, s.step_counter) for s in stats} == {(0, 0)}
            assert {s.kv_cache_usage for s in stats} == {0.0}
        else:
            assert {s.current_wave for s in stats} == {5}
        assert proc.poll() is None
    finally:
        codes = engines.stop()
        for sock in sockets.values():
            sock.close(linger=0)
        ctx.term()
    assert codes == [0], engines.logs()


@retry_port_conflicts
def test_a_stopped_engine_aborts_its_requests_and_tells_vllms_client(root: Path) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    port = unused_tcp_port()
    engines = EngineProcs(root)
    proc = engines.start(*JOINING.join_args(port, 0))
    config = frontend_only_config(root / "model", port)

    async def scenario(client: Any) -> Any:
        await client.add_request_async(request("long", [3], max_tokens=400))
        first = await client.get_output_async()
        assert first.outputs[0].request_id == "long"
        proc.terminate()  # SIGTERM, as an operator or orchestrator stops it
        finishes = []
        with pytest.raises(EngineDeadError):
            while True:
                batch = await client.get_output_async()
                finishes += [o.finish_reason for o in batch.outputs if o.finish_reason]
        return finishes

    # Without the notice, vLLM's client would wait for "long" forever (and route new
    # requests to the stopped engine).
    assert JOINING.run_frontend(config, engines, scenario) == [FinishReason.ABORT]
    assert "aborted 1 request(s), telling the front-end" in engines.logs()
