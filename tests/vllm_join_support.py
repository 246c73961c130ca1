"""``corewire engine`` processes that join a front-end-only vLLM (``vllm serve
--data-parallel-size-local 0``) through vLLM's start-up handshake, for the modules that
test this under either release (``test_vllm_engine_handshake.py`` under 0.25.1,
``test_vllm_0_33_0_engine_handshake.py`` and ``test_vllm_0_33_0_plugin.py`` under
0.33.0; imported only by modules that skip without vllm).

- :func:`private_root`: a private (0700) directory for sockets, logs and the model.
- :func:`join_args`, :func:`frontend_only_config`: the engine's command line and the
  front-end's ``VllmConfig`` that meet at one handshake port.
- :class:`Joining`: what differs between releases (the wire, the handshake timeout, how
  that release's ``AsyncLLM`` calls the client factory, what its step messages carry),
  with the front-end's run (:meth:`Joining.run_frontend`) and output collection
  (:meth:`Joining.generate`).
- :func:`assert_one_engine_joins`, :func:`two_engines_behind_vllms_coordinator`: the
  scenarios both releases run the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

from corewire.dp_messages import XPUB_SUBSCRIBE
from port_support import retry_port_conflicts, unused_tcp_port
from vllm_support import (
    ENGINE_ARGS,
    EngineProcs,
    close_client,
    reference_run,
    vllm_config,
    vllm_request,
    write_model_dir,
)


@contextlib.contextmanager
def private_root(prefix: str) -> Iterator[Path]:
    """A fresh private (0700) directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


def request(rid: str, prompt: list[int], max_tokens: int = 6) -> Any:
    """A greedy vLLM request (see ``vllm_support.vllm_request``)."""
    return vllm_request(rid, prompt, temperature=0.0, max_tokens=max_tokens)


def join_args(
    port: int, index: int, *extra: str, timeout_s: int = 60, release: str | None = None
) -> list[str]:
    """``corewire engine`` arguments that join the front-end at ``port`` (``protocol``
    on the wire; none: the engine's default, 0.25.1)."""
    return [
        "--handshake-address",
        f"tcp://127.0.0.1:{port}",
        "--engine-index",
        str(index),
        "--handshake-timeout",
        str(timeout_s),
        *(() if release is None else ("--release", release)),
        *extra,
    ]


def frontend_only_config(model_dir: Path, port: int, dp_size: int = 1) -> Any:
    """vLLM's config of a front-end with no engines of its own (``dp_size`` of them
    join at ``port``)."""
    return vllm_config(
        write_model_dir(model_dir),
        data_parallel_size=dp_size,
        data_parallel_size_local=0,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_rpc_port=port,
    )


@dataclasses.dataclass(frozen=True)
class Joining:
    """One release's way of joining: ``protocol`` (None: 0.25.1, the default),
    ``timeout_s`` for the engines' handshake and the scenario's deadline, ``make_client``
    (config -> client, as that release's ``AsyncLLM`` calls vLLM's factory), and
    ``weight_versions``: what every step message may carry as its weight version (None:
    the release has no such field)."""

    release: str | None
    timeout_s: int
    make_client: Callable[[Any], Any]
    weight_versions: tuple[str | None, ...] | None = None

    def join_args(self, port: int, index: int, *extra: str) -> list[str]:
        """``corewire engine`` arguments that join this release's front-end at ``port``."""
        return join_args(port, index, *extra, timeout_s=self.timeout_s, release=self.release)

    def run_frontend(self, config: Any, engines: EngineProcs, scenario: Any) -> Any:
        """Build vLLM's client (it waits for the engines' handshake), run
        ``scenario(client)`` on its loop, and shut everything down: the engines must exit
        cleanly."""
        loop = asyncio.new_event_loop()
        client = None
        try:

            async def main() -> Any:
                nonlocal client
                client = self.make_client(config)
                return await scenario(client)

            return loop.run_until_complete(asyncio.wait_for(main(), self.timeout_s))
        finally:
            close_client(client, loop)
            codes = engines.stop()
            assert codes == [0] * len(codes), engines.logs()

    async def generate(self, client: Any, requests: list[Any]) -> dict[str, Any]:
        """Send the requests; per request id, ``(tokens, engine indices that served it)``;
        every request must finish by its length."""
        from vllm.v1.engine import FinishReason

        for r in requests:
            await client.add_request_async(r)
        result: dict[str, Any] = {r.request_id: ([], set()) for r in requests}
        pending = set(result)
        while pending:
            batch = await client.get_output_async()
            if self.weight_versions is not None:
                assert batch.weight_version in self.weight_versions
            for out in batch.outputs:
                if out.request_id in result:
                    result[out.request_id][0].extend(out.new_token_ids)
                    result[out.request_id][1].add(batch.engine_index)
                    if out.finish_reason is not None:
                        assert out.finish_reason == FinishReason.LENGTH
                        pending.discard(out.request_id)
        return result


def assert_same_tokens(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Per request, the tokens of :meth:`Joining.generate` are the reference run's."""
    assert {rid: toks for rid, (toks, _) in got.items()} == {
        rid: toks for rid, (toks, _) in expected.items()
    }


@retry_port_conflicts
def assert_one_engine_joins(root: Path, joining: Joining) -> None:
    """One engine joins a front-end-only vLLM client (a plain ``AsyncMPClient``), which
    takes its ready response (the engine's smaller length limit wins) and gets the
    reference engine's tokens from it."""
    from vllm.v1.engine.core_client import AsyncMPClient

    port = unused_tcp_port()
    engines = EngineProcs(root)
    engines.start(*joining.join_args(port, 0))
    config = frontend_only_config(root / "model", port)

    async def scenario(client: Any) -> Any:
        assert type(client) is AsyncMPClient
        tasks = await client.get_supported_tasks_async()
        got = await joining.generate(client, [request("a", [5, 6, 7]), request("b", [8])])
        return tasks, got

    tasks, got = joining.run_frontend(config, engines, scenario)
    assert tasks == ["generate", "embed"]
    assert config.model_config.max_model_len == ENGINE_ARGS["max_model_len"]
    expected = reference_run(
        [(r, p, {"temperature": 0.0, "max_tokens": 6}) for r, p in (("a", [5, 6, 7]), ("b", [8]))]
    )
    assert_same_tokens(got, expected)
    assert "joined the front-end" in engines.logs()


@retry_port_conflicts
def two_engines_behind_vllms_coordinator(root: Path, joining: Joining) -> list[Any]:
    """Two engines join a DP 2 front-end (vLLM's ``DPLBAsyncMPClient`` and its own DP
    coordinator process); ten requests spread over both (each served by one), with the
    reference engine's tokens. The per-engine counts vLLM's coordinator published to
    front-ends meanwhile (for the release's own checks)."""
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    port = unused_tcp_port()
    engines = EngineProcs(root)
    for index in (0, 1):
        engines.start(*joining.join_args(port, index, "--data-parallel-size", "2"))
    config = frontend_only_config(root / "model", port, dp_size=2)

    async def scenario(client: Any) -> Any:
        assert type(client) is DPLBAsyncMPClient
        # Listen to what vLLM's coordinator publishes to front-ends, as its client does.
        ctx = zmq.Context()
        stats = ctx.socket(zmq.XSUB)
        try:
            stats.connect(client.stats_update_address)
            stats.send(XPUB_SUBSCRIBE)
            await asyncio.sleep(0.2)
            prompts = {f"r{i}": [3 + i, 4] for i in range(10)}
            got = await joining.generate(client, [request(r, p, 40) for r, p in prompts.items()])
            await asyncio.sleep(0.3)
            published = []
            while stats.poll(0):
                published.append(msgspec.msgpack.decode(stats.recv()))
        finally:
            stats.close(linger=0)
            ctx.term()
        return prompts, got, published

    prompts, got, published = joining.run_frontend(config, engines, scenario)
    sp = {"temperature": 0.0, "max_tokens": 40}
    expected = reference_run([(r, p, sp) for r, p in prompts.items()])
    served = {rid: engines_seen for rid, (_, engines_seen) in got.items()}
    assert all(len(s) == 1 for s in served.values())  # one engine per request
    per_engine = [sum(1 for s in served.values() if s == {i}) for i in (0, 1)]
    assert per_engine[0] >= 2 and per_engine[1] >= 2, per_engine
    assert_same_tokens(got, expected)
    return [c for c, _wave, _running in published if c is not None]
