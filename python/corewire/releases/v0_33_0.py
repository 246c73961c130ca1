"""vLLM 0.33.0: what changed since 0.32.0 beyond the struct layouts (docs/protocol.md §11,
docs/vllm-0.33.0-notes.md)."""

from __future__ import annotations

from typing import Any

from corewire.releases.v0_32_0 import Release0320

__all__ = ["Release0330"]


class Release0330(Release0320):
    """vLLM 0.33.0: engine-led DP waves (front-ends send no first-request notices),
    ``pause_generation``, session affinity, and the ready response's coordination-store
    port and coordinator addresses (notes §5.1, §6.1), on top of 0.32.0's front-end."""

    __slots__ = ()
    NAME = "0.33.0"
    LIVE_CHECKED = ("0.33.0",)

    engine_led_waves = True
    generation_pause_utilities = True
    session_affinity = True
    # Held to 0.33.0's OutputProcessor by tests/test_vllm_output_diff.py.
    NATIVE_OUTPUT = True

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
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

    def request_writer(self) -> Any:
        from corewire.client import wire_requests

        return wire_requests.to_0_33_0 if self.written_for else wire_requests.as_given(self)

    def native_output_processor(self) -> type:
        from corewire.vllm.output_0_33_0 import NativeOutputProcessor0330

        return NativeOutputProcessor0330
