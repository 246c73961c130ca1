"""vLLM 0.32.0: bound listening sockets for multi-API-server children, and all-engine
utility calls (docs/protocol.md §11.3); what 0.33.0 added on top is :mod:`.v0_33_0`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from corewire.releases.base import Launch
from corewire.releases.v0_31_0 import Release0310

__all__ = ["Release0320"]


class Release0320(Release0310):
    """vLLM 0.32.0: ``get_engine_zmq_bind_addresses``, and listening sockets handed to
    multi-API-server children; ``profile`` with four arguments; ``reset_prefix_cache``,
    ``wake_up`` and ``compute_weight_checksums`` go to every engine, ``is_sleeping``,
    ``is_scheduler_paused`` and ``get_weight_version`` must agree across engines. Front-ends
    still send first-request notices (waves are not yet engine-led) and there is no
    ``pause_generation``, session affinity or coordinator address in the ready response:
    those are 0.33.0's."""

    __slots__ = ()
    NAME = "0.32.0"
    LIVE_CHECKED = ("0.32.0",)

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
            yield Launch(
                launched.engine_manager,
                launched.coordinator,
                launched.addresses,
                getattr(launched, "tensor_queue", None),
            )

    def listeners(self, client_addresses: dict[str, Any]) -> dict[int, Any]:
        # vLLM's multi-API-server parent binds each server's endpoints itself and hands
        # over the listening sockets; the engines already know them.
        import zmq

        handed = {
            zmq.ROUTER: client_addresses.get("input_listener"),
            zmq.PULL: client_addresses.get("output_listener"),
        }
        return {kind: listener for kind, listener in handed.items() if listener is not None}
