"""What every vLLM release corewire speaks is: :class:`Release`, the defaults of its
behaviour (vLLM 0.25.1's), and the front-end helpers each release overrides."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Launch", "Release"]


@dataclass
class Launch:
    """What vLLM's ``launch_core_engines`` made: its engine manager, its DP coordinator
    and the engine addresses (whose ``frontend_stats_publish_address`` is final once the
    handshake, at the end of the ``with`` block, is over)."""

    engine_manager: Any
    coordinator: Any
    addresses: Any


class Release(str):
    """One vLLM release: its engine-core wire and what its engines and front-end do
    beyond the wire's struct layouts.

    A release *is* its version string (``"0.33.0"``: a ``str`` subclass), because that is
    how the wire itself names it (the ready response's ``vllm_version``) and how callers
    choose one (``protocol="0.33.0"``); everything else about it is an attribute. Code
    outside :mod:`corewire.releases` reads those attributes and never compares version
    strings: a further release is one more class here (or none at all, when only its
    struct layouts changed), not a hunt through ``if`` statements.

    Each class stands for the release it names and, as registered in
    :mod:`corewire.releases`, for the releases after it until the next class; there is
    one instance per release (:func:`corewire.releases.get`).
    """

    __slots__ = ()

    #: The release this class was written for (an instance may name a later one that
    #: behaves the same).
    NAME: ClassVar[str]

    # -- behaviour (docs/protocol.md §11); vLLM 0.25.1's values here --------------------

    #: DP counts are ``[waiting, running, kv_cache_usage]`` (else ``[waiting, running]``),
    #: and engines report the KV cache's use to the coordinator.
    counts_carry_kv_usage: ClassVar[bool] = False
    #: Front-ends send no first-request notices: an idle engine that takes a request
    #: starts the wave itself (else the front-end's notice starts it).
    engine_led_waves: ClassVar[bool] = False
    #: Engines answer ``pause_generation`` (refusing new work with ``RequestError``),
    #: weight versions, ``release_kv_cache_memory``, ``compute_weight_checksums``.
    generation_pause_utilities: ClassVar[bool] = False
    #: Internal load balancing adds the KV-pressure term to an engine's waiting count.
    kv_pressure_routing: ClassVar[bool] = False
    #: Internal load balancing keeps a streaming-input session on its engine and aborts
    #: an open session on every engine.
    session_affinity: ClassVar[bool] = False
    #: ``EngineCoreOutput`` has an ``error`` field (a ``RequestError``) that an engine's
    #: refusals carry; before it, the reason travels in ``stop_reason``.
    request_errors: ClassVar[bool] = False
    #: Every message a step produces carries the engine's ``weight_version``.
    weight_versions: ClassVar[bool] = False
    #: corewire's native output processing (``corewire.vllm.output``) is held to this
    #: release's own ``OutputProcessor`` by the differential tests, so the plugin may
    #: install it.
    native_output: ClassVar[bool] = False

    def __new__(cls, name: str | None = None) -> Release:
        return super().__new__(cls, cls.NAME if name is None else name)

    def __repr__(self) -> str:
        return f"<vLLM release {str.__str__(self)}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (multiprocessing's spawn arguments) as the registered instance.
        from corewire.releases import get

        return (get, (str.__str__(self),))

    @property
    def name(self) -> str:
        """The version string, as a plain ``str``."""
        return str.__str__(self)

    @property
    def speaks_protocol_structs(self) -> bool:
        """Whether this release's wire is the one ``corewire.protocol``'s structs lay out
        (what engines build and clients are given): then nothing is converted on either
        side. Read off the struct tables, not declared."""
        from corewire import protocol

        return self.types["EngineCoreOutputs"] is protocol.EngineCoreOutputs

    @property
    def types(self) -> Any:
        """This release's wire structs by name, both directions
        (``corewire.layouts.types_for``)."""
        from corewire.layouts import types_for

        return types_for(self)

    # -- the front-end helpers of vLLM's own code (vLLM imported inside) ----------------

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
