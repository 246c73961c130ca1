"""What vLLM's own front-end code does differently in each release, as corewire's clients
inside ``AsyncLLM`` call it: where vLLM plans its client's sockets, how its
``launch_core_engines`` starts engines, which listening sockets a multi-API-server parent
hands over, and how a ready response applies to the ``VllmConfig`` (vLLM imported inside
each method, where it is called).

One class per release whose front-end changed (docs/protocol.md §11.3), each on top of the
one before; :func:`frontend_for` picks a release's from :data:`FRONTENDS`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from corewire.releases import Release

__all__ = ["FRONTENDS", "Frontend", "Launch", "apply_common_ready", "frontend_for"]


@dataclass
class Launch:
    """What vLLM's ``launch_core_engines`` made: its engine manager, its DP coordinator
    and the engine addresses (whose ``frontend_stats_publish_address`` is final once the
    handshake, at the end of the ``with`` block, is over), and the queue of multimodal
    tensors sent out of band (``mm_tensor_ipc="torch_shm"``; None otherwise)."""

    engine_manager: Any
    coordinator: Any
    addresses: Any
    tensor_queue: Any = None


class Frontend:
    """vLLM 0.25.1's front-end (and 0.26.0's, 0.27.0's): ``get_engine_zmq_addresses``, a
    4-tuple from ``launch_core_engines``, the 10-key ready response."""

    def planned_addresses(self, vllm_config: Any) -> tuple[str, str]:
        """Where vLLM would bind its client's request and output sockets."""
        from vllm.v1.engine.utils import get_engine_zmq_addresses

        planned = get_engine_zmq_addresses(vllm_config)
        return planned.inputs[0], planned.outputs[0]

    @contextlib.contextmanager
    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> Iterator[Launch]:
        """vLLM's ``launch_core_engines`` with the client's bound endpoints: starts local
        engines and the DP coordinator; the handshake runs when the block exits."""
        from vllm.v1.engine.utils import launch_core_engines

        addresses = self.launch_addresses(vllm_config, inputs, outputs)
        with launch_core_engines(vllm_config, executor_class, log_stats, addresses) as (
            engine_manager,
            coordinator,
            launched,
            tensor_queue,
        ):
            yield Launch(engine_manager, coordinator, launched, tensor_queue)

    def launch_addresses(self, vllm_config: Any, inputs: str, outputs: str) -> Any:
        """vLLM's planned engine addresses with the client's bound endpoints in place of
        its own request and output sockets (before 0.32.0)."""
        from vllm.v1.engine.utils import get_engine_zmq_addresses

        addresses = get_engine_zmq_addresses(vllm_config)
        addresses.inputs[0] = inputs
        addresses.outputs[0] = outputs
        return addresses

    def listeners(self, client_addresses: dict[str, Any]) -> dict[int, Any]:
        """The already-bound listening sockets ``client_addresses`` hands over, by the
        ZeroMQ socket kind that must adopt them (none before 0.32.0)."""
        return {}

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        """Decode one engine's ready map as vLLM decodes it and apply it to the client's
        ``vllm_config`` (and client) as vLLM's client does; returns the response."""
        from vllm.v1.engine import EngineCoreReadyResponse

        response = msgspec.convert(info, EngineCoreReadyResponse)
        apply_common_ready(client.vllm_config, response)
        return response


class Frontend0280(Frontend):
    """vLLM 0.28.0: ``launch_core_engines`` yields a ``CoreEngineLaunch`` (before: a
    4-tuple)."""

    @contextlib.contextmanager
    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> Iterator[Launch]:
        """vLLM's ``launch_core_engines``, whose launch is an object now."""
        from vllm.v1.engine.utils import launch_core_engines

        addresses = self.launch_addresses(vllm_config, inputs, outputs)
        with launch_core_engines(vllm_config, executor_class, log_stats, addresses) as launched:
            yield _launch_of(launched)


class Frontend0290(Frontend0280):
    """vLLM 0.29.0 (and 0.30.0): the client applies the ready response's
    ``mamba_block_size`` to ``cache_config``."""

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        """0.25.1's rule, and the engine's mamba block size."""
        response = super().apply_ready(client, info)
        client.vllm_config.cache_config.mamba_block_size = response.mamba_block_size
        return response


class Frontend0310(Frontend0290):
    """vLLM 0.31.0: ``effective_attention_block_size`` kept only when every engine names
    the same one (an empty ready payload counts as unknown), and each engine's
    ``kv_events_config`` (``get_kv_event_sources``)."""

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        """Every engine's attention block size and KV-event sources, then 0.29.0's rule."""
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


class Frontend0320(Frontend0310):
    """vLLM 0.32.0: ``get_engine_zmq_bind_addresses``, and the listening sockets a
    multi-API-server parent hands its children."""

    def planned_addresses(self, vllm_config: Any) -> tuple[str, str]:
        """Where vLLM binds its client's sockets (``get_engine_zmq_bind_addresses``)."""
        from vllm.v1.engine.utils import get_engine_zmq_bind_addresses

        planned = get_engine_zmq_bind_addresses(vllm_config)
        return planned.inputs[0], planned.outputs[0]

    @contextlib.contextmanager
    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> Iterator[Launch]:
        """vLLM's ``launch_core_engines`` given only the client's two endpoints."""
        from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

        addresses = EngineZmqAddresses(inputs=[inputs], outputs=[outputs])
        with launch_core_engines(vllm_config, executor_class, log_stats, addresses) as launched:
            yield _launch_of(launched)

    def listeners(self, client_addresses: dict[str, Any]) -> dict[int, Any]:
        """The request and output listeners vLLM's parent bound for this child."""
        # vLLM's multi-API-server parent binds each server's endpoints itself and hands
        # over the listening sockets; the engines already know them.
        import zmq

        handed = {
            zmq.ROUTER: client_addresses.get("input_listener"),
            zmq.PULL: client_addresses.get("output_listener"),
        }
        return {kind: listener for kind, listener in handed.items() if listener is not None}


class Frontend0330(Frontend0320):
    """vLLM 0.33.0: the ready response's coordination-store port and coordinator
    addresses, which every engine must agree on (docs/vllm-0.33.0-notes.md §5.1, §6.1)."""

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        """0.31.0's rule, and the group's coordination store and coordinator."""
        response = super().apply_ready(client, info)
        if response is None:
            return None
        parallel_config = client.vllm_config.parallel_config
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


#: Each release's front-end, by the release it was written for (a later release without
#: an entry behaves as the one before it: ``Release.choose``).
FRONTENDS: dict[str, type[Frontend]] = {
    "0.25.1": Frontend,
    "0.28.0": Frontend0280,
    "0.29.0": Frontend0290,
    "0.31.0": Frontend0310,
    "0.32.0": Frontend0320,
    "0.33.0": Frontend0330,
}


@functools.cache
def frontend_for(release: Release) -> Frontend:
    """The front-end helpers of vLLM ``release`` (one object per release)."""
    return release.choose(FRONTENDS)()


def _launch_of(launched: Any) -> Launch:
    return Launch(
        launched.engine_manager,
        launched.coordinator,
        launched.addresses,
        getattr(launched, "tensor_queue", None),
    )


def apply_common_ready(vllm_config: Any, response: Any) -> None:
    """The part of applying a ready response every release shares."""
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
