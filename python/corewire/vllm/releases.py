"""What differs between the vLLM releases whose ``AsyncLLM`` the plugin's clients serve.

One small class per release, chosen by :func:`release_for` from the protocol of the
installed vLLM (``corewire.versions.protocol_for_vllm``). Each knows only how that
release's front-end helpers are called: where its client sockets are planned to bind, how
its engines are launched and handshaken, and how a ready response is applied to the
``VllmConfig``. The client members that differ live in :mod:`corewire.vllm.client` (0.25.1)
and :mod:`corewire.vllm.v0_33_0` (0.33.0). vLLM's modules are imported inside the methods,
so importing this module never fails on the other release's moved names.

Wire format: docs/protocol.md §3.1 (the ready response applied to vLLM's config) and §3.2
(engines joining a vLLM front-end); the 0.33.0 differences in docs/vllm-0.33.0-notes.md
§5.1 and §6.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from corewire.versions import V0_25_1, V0_33_0, check_protocol

__all__ = ["Launch", "Release", "Release0251", "Release0330", "release_for"]


@dataclass
class Launch:
    """What vLLM's ``launch_core_engines`` made: its engine manager, its DP coordinator
    and the engine addresses (whose ``frontend_stats_publish_address`` is final once the
    handshake, at the end of the ``with`` block, is over)."""

    engine_manager: Any
    coordinator: Any
    addresses: Any


class Release:
    """The front-end helpers of one vLLM release (see the module docstring)."""

    #: The vLLM version (and wire protocol) this class speaks.
    protocol: ClassVar[str]

    def planned_addresses(self, vllm_config: Any) -> tuple[str, str]:
        """Where vLLM would bind its client's request and output sockets."""
        raise NotImplementedError

    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> contextlib.AbstractContextManager[Launch]:
        """vLLM's ``launch_core_engines`` with the client's bound endpoints: starts local
        engines and the DP coordinator; the handshake runs when the block exits."""
        raise NotImplementedError

    def listeners(self, client_addresses: dict[str, Any]) -> dict[int, Any]:
        """The already-bound listening sockets ``client_addresses`` hands over, by the
        ZeroMQ socket kind that must adopt them (none before 0.33.0)."""
        return {}

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        """Decode one engine's ready map as vLLM decodes it and apply it to the client's
        ``vllm_config`` (and client) as vLLM's client does; returns the response."""
        raise NotImplementedError


def _apply_common(vllm_config: Any, response: Any) -> None:
    """The part of applying a ready response both releases share."""
    model_config = vllm_config.model_config
    model_config.max_model_len = min(model_config.max_model_len, response.max_model_len)
    cache_config = vllm_config.cache_config
    # KV-cache blocks add up over a DP group; the block size is the engine's own.
    cache_config.num_gpu_blocks = (cache_config.num_gpu_blocks or 0) + response.num_gpu_blocks
    cache_config.block_size = response.block_size
    # Capacity figures are per engine: the first engine's stay.
    for key in ("kv_cache_size_tokens", "kv_cache_max_concurrency"):
        if getattr(cache_config, key, None) is None:
            setattr(cache_config, key, getattr(response, key))


class Release0251(Release):
    """vLLM 0.25.1: ``get_engine_zmq_addresses``, a 4-tuple from ``launch_core_engines``."""

    protocol = V0_25_1

    def planned_addresses(self, vllm_config: Any) -> tuple[str, str]:
        from vllm.v1.engine.utils import get_engine_zmq_addresses

        planned = get_engine_zmq_addresses(vllm_config)
        return planned.inputs[0], planned.outputs[0]

    @contextlib.contextmanager
    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> Iterator[Launch]:
        from vllm.v1.engine.utils import get_engine_zmq_addresses, launch_core_engines

        addresses = get_engine_zmq_addresses(vllm_config)
        addresses.inputs[0] = inputs
        addresses.outputs[0] = outputs
        with launch_core_engines(vllm_config, executor_class, log_stats, addresses) as (
            engine_manager,
            coordinator,
            launched,
            _tensor_queue,
        ):
            yield Launch(engine_manager, coordinator, launched)

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        from vllm.v1.engine import EngineCoreReadyResponse

        response = msgspec.convert(info, EngineCoreReadyResponse)
        _apply_common(client.vllm_config, response)
        return response


class Release0330(Release):
    """vLLM 0.33.0: ``get_engine_zmq_bind_addresses``, a ``CoreEngineLaunch`` object, the
    28-key ready response (notes §5.1, §6.1)."""

    protocol = V0_33_0

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
        _apply_common(vllm_config, response)
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


_RELEASES: dict[str, type[Release]] = {V0_25_1: Release0251, V0_33_0: Release0330}


def release_for(protocol: str) -> Release:
    """The helpers of vLLM release ``protocol`` (``"0.25.1"`` or ``"0.33.0"``)."""
    return _RELEASES[check_protocol(protocol)]()
