"""vLLM 0.33.0: what changed since 0.25.1 beyond the struct layouts (docs/protocol.md §11,
docs/vllm-0.33.0-notes.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec

from corewire.releases.base import Launch, apply_common_ready
from corewire.releases.v0_25_1 import Release0251

__all__ = ["Release0330"]


class Release0330(Release0251):
    """vLLM 0.33.0: engine-led DP waves with KV-usage counts, pause/weight utilities,
    ``RequestError`` refusals, weight versions, session affinity;
    ``get_engine_zmq_bind_addresses``, a ``CoreEngineLaunch`` object, the 28-key ready
    response (notes §5.1, §6.1)."""

    __slots__ = ()
    NAME = "0.33.0"

    counts_carry_kv_usage = True
    engine_led_waves = True
    generation_pause_utilities = True
    kv_pressure_routing = True
    session_affinity = True
    # Held to 0.33.0's OutputProcessor by tests/test_vllm_output_diff.py.
    NATIVE_OUTPUT = True

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
        # vLLM's multi-API-server parent binds each server's endpoints itself (notes
        # §6.4) and hands over the listening sockets; the engines already know them.
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
        parallel_config = vllm_config.parallel_config
        if response.coord_store_port:
            known = parallel_config._coord_store_port
            if known and known != response.coord_store_port:
                raise RuntimeError(
                    f"engines name different coordination store ports: {known}, "
                    f"{response.coord_store_port}"
                )
            parallel_config._coord_store_port = response.coord_store_port
        for key in ("coordinator_input_address", "coordinator_output_address"):
            address = getattr(response, key)
            if address is None:
                continue
            known = getattr(client, key)
            if known is not None and known != address:
                raise RuntimeError(f"engines name different {key}s: {known}, {address}")
            setattr(client, key, address)
        return response

    def engine_utilities(self, proc: Any) -> Any:
        from corewire.engine.utilities_0_33_0 import Utilities0330

        return Utilities0330(proc)

    def request_writer(self) -> Any:
        from corewire.client import wire_requests

        return wire_requests.to_0_33_0 if self.verified else wire_requests.as_given(self)

    def native_output_processor(self) -> type:
        from corewire.vllm.output_0_33_0 import NativeOutputProcessor0330

        return NativeOutputProcessor0330

    def vllm_client_members(self) -> type:
        from corewire.vllm.v0_33_0 import Members0330

        return Members0330
