"""vLLM 0.32.0: the first release whose front-end helpers and client members are
0.33.0's (docs/protocol.md §11.3): what changed since 0.25.1 beyond the struct layouts,
less what 0.33.0 added on top (:mod:`.v0_33_0`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec

from corewire.releases.base import Launch, apply_common_ready
from corewire.releases.v0_25_1 import Release0251

__all__ = ["Release0320"]


class Release0320(Release0251):
    """vLLM 0.32.0: ``[waiting, running, kv_cache_usage]`` DP counts with the KV-pressure
    routing rule (both from 0.27.0); ``get_engine_zmq_bind_addresses`` and listening
    sockets handed to multi-API-server children (0.32.0); a ``CoreEngineLaunch`` object
    from ``launch_core_engines`` (0.28.0); the ready response's block and KV-event facts
    (0.29.0, 0.31.0); fault-tolerance status (0.27.0); all-engine and consensus utility
    calls (0.32.0). Front-ends still send first-request notices (waves are not yet
    engine-led) and there is no ``pause_generation``, session affinity or coordinator
    address in the ready response: those are 0.33.0's."""

    __slots__ = ()
    NAME = "0.32.0"
    LIVE_CHECKED = ("0.32.0",)

    counts_carry_kv_usage = True
    kv_pressure_routing = True
    # Checked against 0.25.1's OutputProcessor only.
    NATIVE_OUTPUT = False

    def planned_addresses(self, vllm_config: Any) -> tuple[str, str]:
        from vllm.v1.engine.utils import get_engine_zmq_bind_addresses

        planned = get_engine_zmq_bind_addresses(vllm_config)
        return planned.inputs[0], planned.outputs[0]

    @contextlib.contextmanager
    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> Iterator[Launch]:
        from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

        addresses = EngineZmqAddresses(inputs=[inputs], outputs=[outputs])
        with launch_core_engines(vllm_config, executor_class, log_stats, addresses) as launched:
            yield Launch(launched.engine_manager, launched.coordinator, launched.addresses)

    def listeners(self, client_addresses: dict[str, Any]) -> dict[int, Any]:
        # vLLM's multi-API-server parent binds each server's endpoints itself and hands
        # over the listening sockets; the engines already know them.
        import zmq

        handed = {
            zmq.ROUTER: client_addresses.get("input_listener"),
            zmq.PULL: client_addresses.get("output_listener"),
        }
        return {kind: listener for kind, listener in handed.items() if listener is not None}

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        from vllm.v1.engine import EngineCoreReadyResponse

        vllm_config = client.vllm_config
        # An empty payload is a ready engine that says nothing (vLLM skips it), and
        # counts as an unknown attention block size.
        response = msgspec.convert(info, EngineCoreReadyResponse) if info else None
        sizes = client.effective_attention_block_sizes
        sizes.add(None if response is None else response.effective_attention_block_size)
        cache_config = vllm_config.cache_config
        cache_config.effective_attention_block_size = next(iter(sizes)) if len(sizes) == 1 else None
        if response is None:
            return None
        apply_common_ready(vllm_config, response)
        cache_config.mamba_block_size = response.mamba_block_size
        if response.kv_events_config is not None:
            client.kv_event_sources[response.data_parallel_rank] = response.kv_events_config
        return response

    def request_writer(self) -> Any:
        from corewire.client import wire_requests

        # corewire's 0.25.1 struct converted into this release's own layout, as for
        # 0.33.0 (whose requests are this release's with fields appended).
        return wire_requests.converted_writer(self)

    def engine_utilities(self, proc: Any) -> Any:
        # 0.33.0's set: every call 0.32.0's front-end makes beyond the engine's own
        # methods (weight versions, all-engine wake_up, release_kv_cache_memory,
        # compute_weight_checksums) is in it; pause_generation is never called here.
        from corewire.engine.utilities_0_33_0 import Utilities0330

        return Utilities0330(proc)

    def vllm_client_members(self) -> type:
        # 0.33.0's client members: 0.32.0's AsyncLLM calls a subset of them, with the
        # same arguments (0.33.0 only added profiler_kwargs, a trailing default).
        from corewire.vllm.v0_33_0 import Members0330

        return Members0330
