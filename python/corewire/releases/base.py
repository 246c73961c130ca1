"""What every vLLM release corewire speaks is: :class:`Release`, the defaults of its
behaviour (vLLM 0.25.1's), and the front-end helpers each release overrides."""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

__all__ = ["Launch", "Release"]


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
    #: ``SamplingParams`` drops repeated ``stop_token_ids`` and ``bad_words`` when built,
    #: so a front-end writes each once (0.28.0 on).
    drops_repeated_stops: ClassVar[bool] = False
    #: Front-ends call the process-checkpoint utilities (``checkpoint_prepare`` /
    #: ``_restore`` / ``_state``), pass ``reset_connector`` to ``sleep`` and
    #: ``release_kv_cache_memory``, and read the managed engine's status map as the
    #: client's ``engine_status``.
    process_checkpoints: ClassVar[bool] = False
    #: corewire's native output processing (``corewire.vllm.output``) is held to the
    #: ``OutputProcessor`` of the release this class was written for by the differential
    #: tests (read through :attr:`native_output`).
    NATIVE_OUTPUT: ClassVar[bool] = False
    #: The per-token fast path of ``vllm serve`` (``corewire.vllm.fast_path``) is held to
    #: the OpenAI server of the release this class was written for by the differential HTTP
    #: tests (read through :attr:`fast_path`; installed by :meth:`install_fast_path`).
    FAST_PATH: ClassVar[bool] = False
    #: corewire's client inside vLLM (``corewire.vllm``) is built for the ``AsyncLLM`` of
    #: the release this class was written for: :meth:`vllm_client_members` (read through
    #: :attr:`vllm_client`, for the releases in :attr:`LIVE_CHECKED`).
    VLLM_CLIENT: ClassVar[bool] = False
    #: The releases this class stands for that were checked live against it: the plugin
    #: under that release's ``AsyncLLM`` and API server, and corewire engines behind that
    #: release's own client (the live modules of ``scripts/test``, run in a venv with that
    #: release). Each class names its own; a release it stands for that is not listed has
    #: only its wire checked (its record's golden frames) and is not :attr:`verified`.
    LIVE_CHECKED: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, name: str | None = None) -> Release:
        # ``name``: a later release this class describes (see the class docstring).
        return super().__new__(cls, cls.NAME if name is None else name)

    def __repr__(self) -> str:
        # As the version string it is: messages and logs that show a protocol with !r
        # read as they always did.
        return repr(str.__str__(self))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (multiprocessing's spawn arguments) as the registered instance.
        from corewire.releases import get

        return (get, (str.__str__(self),))

    @property
    def name(self) -> str:
        """The version string, as a plain ``str``."""
        return str.__str__(self)

    @property
    def verified(self) -> bool:
        """Whether this release's behaviour was checked against the release itself (its
        class's :attr:`LIVE_CHECKED` names it); else it behaves as the release its class
        was written for, unchecked, and only its wire (recorded from the release) is known
        to be its own."""
        return self.name in self.LIVE_CHECKED

    @property
    def written_for(self) -> bool:
        """Whether this release is the one its class was written for (not a later one
        it stands for): what is held to one release's own code, such as native output
        processing or a request converter into that release's layout, applies only there."""
        return self.name == self.NAME

    @property
    def native_output(self) -> bool:
        """Whether the plugin may install native output processing under this release:
        only where it was checked against this very release's ``OutputProcessor``."""
        return self.written_for and self.verified and self.NATIVE_OUTPUT

    @property
    def fast_path(self) -> bool:
        """Whether the plugin may install ``vllm serve``'s fast path under this release:
        only where it was checked against this very release's OpenAI server, with native
        output processing (which it writes from)."""
        return self.native_output and self.FAST_PATH

    def install_fast_path(self) -> None:
        """Installs the fast path into this release's OpenAI server (vLLM imported
        inside; only for a release whose :attr:`fast_path` holds)."""
        raise NotImplementedError(f"vLLM {self.name} has no fast path")

    def native_output_processor(self) -> type:
        """corewire's ``OutputProcessor`` for this release's ``AsyncLLM`` (vLLM imported
        inside): vLLM's own class with plain outputs processed natively, as this
        release's ``OutputProcessor`` processes them."""
        from corewire.vllm.output import NativeOutputProcessor

        return NativeOutputProcessor

    @property
    def vllm_client(self) -> bool:
        """Whether the plugin may put corewire's client inside this release's
        ``AsyncLLM``: only where its client classes were written and tested for this very
        release (a release only recorded may have moved the front-end code they call)."""
        return self.verified and self.VLLM_CLIENT

    # -- facts of the wire, read off the struct tables ---------------------------------

    @property
    def request_errors(self) -> bool:
        """``EngineCoreOutput`` has an ``error`` field (a ``RequestError``) that an
        engine's refusals carry; before it, the reason travels in ``stop_reason``."""
        return "error" in self._fields("EngineCoreOutput")

    @property
    def weight_versions(self) -> bool:
        """Every message a step produces carries the engine's ``weight_version``."""
        return "weight_version" in self._fields("EngineCoreOutputs")

    @property
    def packs_prompts(self) -> bool:
        """``EngineCoreRequest.prompt_token_ids`` is an ndarray on the wire (0.34.0 on:
        its front-end packs each prompt as int32, inline below 256 bytes, an aux frame
        above), else a list of ints."""
        import numpy as np

        request = self.types["EngineCoreRequest"]
        field = next(f for f in msgspec.structs.fields(request) if f.name == "prompt_token_ids")
        return np.ndarray in typing.get_args(field.type) or field.type is np.ndarray

    def _fields(self, name: str) -> tuple[str, ...]:
        from corewire.releases.structs import wire_names

        return wire_names(self.types[name]) or ()

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

    #: The structs whose positions the native decoder reads (``NativeDecoder(layout=)``).
    NATIVE_STRUCTS: ClassVar[tuple[str, ...]] = (
        "EngineCoreOutputs",
        "EngineCoreOutput",
        "UtilityOutput",
        "LogprobsLists",
        "LogprobsTensors",
        "SamplingMaskLists",
    )

    @property
    def native_layout(self) -> dict[str, tuple[str, ...]]:
        """Where this release puts each field the native decoder reads: each struct's
        wire names in wire order, read off this release's struct tables (:attr:`types`),
        so that the decoder follows the release rather than a table of its own."""
        layout = {}
        for name in self.NATIVE_STRUCTS:
            cls = self.types.get(name)
            if cls is None:
                continue
            fields = getattr(cls, "__struct_encode_fields__", None)
            layout[name] = tuple(fields if fields is not None else cls._fields)
        return layout

    def engine_utilities(self, proc: Any) -> Any:
        """The utilities a front-end of this release calls that a corewire engine core
        answers from its own state (``corewire.engine.utilities_0_33_0`` and on), for the
        engine core ``proc``; None where the engine's own methods answer every call."""
        return None

    def vllm_client_members(self) -> type:
        """The members corewire's clients have inside this release's ``AsyncLLM`` (what
        its front-end calls on its engine-core client), mixed in front of each kind of
        client by :func:`corewire.vllm.classes.client_class`."""
        raise NotImplementedError

    def native_decoder(self, **kwargs: Any) -> Any:
        """A ``NativeDecoder`` of this release's outputs (``kwargs``: its other
        arguments). Raises ``ValueError`` naming the field when the release has one the
        native decoder cannot read."""
        from corewire._native import NativeDecoder

        return NativeDecoder(protocol=self.name, layout=self.native_layout, **kwargs)

    def request_writer(self) -> Any:
        """The function that turns a request into what a client of this release sends,
        or None when requests go as given (``corewire.client.wire_requests``): a release
        only recorded, not verified, takes requests in its own layout only."""
        if self.speaks_protocol_structs:
            return None
        from corewire.client import wire_requests

        return wire_requests.as_given(self)

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
