"""vLLM 0.25.1: the release whose wire ``corewire.protocol`` declares (docs/protocol.md
§3-§9), and the behaviour every later release is described against."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec

from corewire.releases.base import Launch, Release, apply_common_ready

__all__ = ["Release0251"]


class Release0251(Release):
    """vLLM 0.25.1: ``get_engine_zmq_addresses``, a 4-tuple from ``launch_core_engines``,
    the 10-key ready response; the default behaviour of :class:`Release`."""

    __slots__ = ()
    NAME = "0.25.1"
    # 0.26.0 changed nothing its front-end helpers, client members, DP coordinator or
    # ready response do (docs/protocol.md §11.3); checked live against this class.
    LIVE_CHECKED = ("0.25.1", "0.26.0")

    NATIVE_OUTPUT = True
    VLLM_CLIENT = True

    def planned_addresses(self, vllm_config: Any) -> tuple[str, str]:
        from vllm.v1.engine.utils import get_engine_zmq_addresses

        planned = get_engine_zmq_addresses(vllm_config)
        return planned.inputs[0], planned.outputs[0]

    @contextlib.contextmanager
    def launch(
        self, vllm_config: Any, executor_class: Any, log_stats: bool, inputs: str, outputs: str
    ) -> Iterator[Launch]:
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

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        from vllm.v1.engine import EngineCoreReadyResponse

        response = msgspec.convert(info, EngineCoreReadyResponse)
        apply_common_ready(client.vllm_config, response)
        return response

    def vllm_client_members(self) -> type:
        from corewire.vllm.client import VllmClientMixin

        return VllmClientMixin
