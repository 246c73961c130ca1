"""corewire's clients built from vLLM's client-factory arguments (0.25.1 here; 0.33.0's
members in :mod:`corewire.vllm.adapters.v0_33_0`).

vLLM's ``AsyncLLM`` builds its engine-core client with
``(vllm_config, executor_class, log_stats, client_addresses, client_count, client_index)``
(0.33.0 adds ``renderer=``) and then reads a few attributes of it. The classes here take
exactly those arguments and differ from corewire's own clients only where vLLM's
front-end needs it; what differs between vLLM releases is in
:mod:`corewire.vllm.adapters.frontend` (how engines are launched, how a ready response applies);
:func:`corewire.vllm.adapters.classes.make_async_mp_client` is the factory that builds them:

- **Engines.** Without ``client_addresses`` the client binds its sockets and lets vLLM's
  own ``launch_core_engines`` start local engines and run the start-up handshake with
  engines that join from elsewhere (``vllm serve --data-parallel-size-local 0`` with
  ``corewire engine --handshake-address ...`` or vLLM's ``--headless`` engines). Local
  engine processes join corewire's engine monitor; every engine is also watched by
  corewire's health watchdog, which vLLM's own client lacks for remote engines.
- **Ready responses** are decoded as strictly as vLLM decodes them and applied to the
  ``VllmConfig`` the same way (``max_model_len``, KV-cache blocks, block size ...).
- **Decoded outputs** stay native; only ``prefill_stats`` and ``scheduler_stats`` maps
  are turned into vLLM's own stats dataclasses by the decoder (vLLM reads them by
  attribute), once per request and once per message, never per output.
- **Engine death** raises :class:`EngineDeadError`, which both ``except
  corewire.EngineDeadError`` and vLLM's ``except EngineDeadError`` catch.

Health watchdog settings come from the environment: ``COREWIRE_HEALTH_CHECK_INTERVAL_S``
(default 5) and ``COREWIRE_HEALTH_CHECK_TIMEOUT_S`` (default 10); an interval of 0 turns
the watchdog off.

Wire format: docs/protocol.md §3.1 (the ready response applied to vLLM's config), §5 and
§9.2 (outputs, a bad frame fails alone), §11 (0.33.0); how 0.33.0's ``AsyncLLM`` makes and
calls its client: docs/vllm-0.33.0-notes.md §6.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import vllm
import zmq
from vllm import envs
from vllm.v1.engine.exceptions import EngineDeadError as _VllmEngineDeadError
from vllm.v1.metrics.stats import PrefillStats, SchedulerStats

import corewire.errors
from corewire import releases
from corewire.codec import NativeDecoder, native_decoder
from corewire.curve import require_curve_for
from corewire.errors import ProtocolError
from corewire.protocol import FinishReason, finished_outputs
from corewire.releases import Release
from corewire.vllm.adapters.frontend import frontend_for
from corewire.vllm.adapters.multimodal import multimodal_encoder_for

__all__ = [
    "INSTALLED_RELEASE",
    "EngineDeadError",
    "VllmArgs",
    "VllmClientMixin",
    "apply_ready_response",
    "make_output_decoder",
]

logger = logging.getLogger("vllm.corewire")

#: Environment variables of the health watchdog (seconds).
HEALTH_INTERVAL_ENV = "COREWIRE_HEALTH_CHECK_INTERVAL_S"
HEALTH_TIMEOUT_ENV = "COREWIRE_HEALTH_CHECK_TIMEOUT_S"
DEFAULT_HEALTH_INTERVAL_S = 5.0
DEFAULT_HEALTH_TIMEOUT_S = 10.0
#: Seconds vLLM gives the engine processes it launched between SIGTERM and SIGKILL.
VLLM_TERMINATE_GRACE_S = 5.0


#: The wire of the installed vLLM (refused at import when corewire does not speak it).
INSTALLED_RELEASE = releases.installed(vllm)


class EngineDeadError(corewire.errors.EngineDeadError, _VllmEngineDeadError):
    """An engine death under vLLM: caught by ``except corewire.EngineDeadError`` and by
    vLLM's ``except EngineDeadError`` (its serving code and health endpoint)."""


def apply_ready_response(vllm_config: Any, info: dict[str, Any]) -> Any:
    """Decode one engine's ready map as vLLM 0.25.1 does (every required key) and apply
    it to ``vllm_config`` as vLLM's client does; returns the decoded response.

    Raises ``msgspec.ValidationError`` for a map vLLM would refuse. (Each release's own
    rule: :func:`corewire.vllm.adapters.frontend.frontend_for`.)
    """
    holder = _ConfigHolder(vllm_config)
    return frontend_for(releases.get("0.25.1")).apply_ready(holder, info)


class _ConfigHolder:
    """Just a ``vllm_config``, for a release's ``apply_ready`` outside a client."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config


def make_output_decoder(release: str | None = None) -> NativeDecoder:
    """The native decoder of ``release`` (default: the installed vLLM's) as vLLM's
    front-end needs it: stats maps become vLLM's ``PrefillStats`` / ``SchedulerStats``
    (nested stats included), all else as usual."""
    return native_decoder(
        release or INSTALLED_RELEASE,
        prefill_stats=_stats_converter(PrefillStats),
        scheduler_stats=_stats_converter(SchedulerStats),
    )


def _stats_converter(cls: type) -> Callable[[dict[str, Any]], Any]:
    def convert(stats: dict[str, Any]) -> Any:
        # Validated like vLLM's typed msgpack decoder does it (nested stats included).
        return msgspec.convert(stats, cls)

    convert.__qualname__ = f"convert_to_{cls.__name__}"
    return convert


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {raw!r}")
    return value


@dataclass
class VllmArgs:
    """vLLM's client-factory arguments (see :func:`make_async_mp_client`)."""

    vllm_config: Any
    executor_class: Any
    log_stats: bool
    client_addresses: dict[str, Any] | None
    client_count: int
    client_index: int
    renderer: Any


class VllmClientMixin:
    """The parts every corewire client shares under vLLM (see the module docstring).

    Mixed in before a corewire client class, whose constructor it calls with the keyword
    arguments :meth:`_vllm_setup` makes of vLLM's factory arguments. :attr:`release` is
    the vLLM release whose helpers launch the engines and apply their ready responses.
    """

    #: The vLLM release this client serves (its wire is the engines'): the installed
    #: vLLM's unless the factory names another.
    release: Release

    # Provided by the corewire client class this is mixed into.
    resources: Any
    input_socket: Any
    output_socket: Any
    input_address: str
    output_address: str
    ready_info: dict[bytes, dict[str, Any]]
    engine_indices: list[int]

    def __init__(
        self,
        vllm_config: Any,
        executor_class: Any,
        log_stats: bool,
        client_addresses: dict[str, Any] | None = None,
        client_count: int = 1,
        client_index: int = 0,
        renderer: Any = None,
        *,
        release: str | None = None,
    ) -> None:
        """vLLM's client-factory arguments (see
        :func:`corewire.vllm.adapters.classes.make_async_mp_client`); ``release``: the vLLM release
        served (default: the installed one)."""
        self.release = INSTALLED_RELEASE if release is None else releases.get(release)
        args = VllmArgs(
            vllm_config,
            executor_class,
            log_stats,
            client_addresses,
            client_count,
            client_index,
            renderer,
        )
        super().__init__(**self._vllm_setup(args))
        self._vllm_finish_setup()

    def _vllm_setup(self, args: VllmArgs) -> dict[str, Any]:
        """Record vLLM's arguments; return the corewire client's keyword arguments."""
        vllm_config = self.vllm_config = args.vllm_config
        self.stats_update_address: str | None = None
        #: vLLM's engine manager and DP coordinator, when vLLM launched engines.
        self.vllm_engine_manager: Any = None
        self.vllm_coordinator: Any = None
        self._vllm_launch: tuple[Any, bool] | None = None
        #: vLLM's renderer (0.33.0): its multimodal warm-up starts once engines exist.
        self._vllm_renderer = args.renderer
        #: vLLM's multi-API-server parent waits on this pipe for the endpoints we bind.
        self._vllm_address_pipe: Any = None
        #: vLLM's queue of out-of-band multimodal tensors (handed over or launched).
        self._vllm_tensor_queue: Any = None
        #: Listening sockets vLLM's multi-API-server parent bound for us (0.33.0), by the
        #: ZeroMQ socket kind that adopts them.
        self._vllm_listeners: dict[int, Any] = {}
        client_addresses = args.client_addresses
        if client_addresses:
            # Engines managed elsewhere (e.g. by vLLM's multi-API-server parent).
            self._vllm_listeners = frontend_for(self.release).listeners(client_addresses)
            addresses: dict[str, str] | None = {
                "input_address": client_addresses["input_address"],
                "output_address": client_addresses["output_address"],
            }
            self.stats_update_address = client_addresses.get("stats_update_address")
            self._vllm_address_pipe = client_addresses.get("actual_address_pipe")
            self._vllm_tensor_queue = client_addresses.get("tensor_queue")
        else:
            self._vllm_launch = (args.executor_class, args.log_stats)
            inputs, outputs = frontend_for(self.release).planned_addresses(vllm_config)
            if inputs.startswith("ipc://"):
                # Local engines only: corewire's own endpoints in a private 0700 dir,
                # handed to the engines by vLLM's handshake.
                addresses = None
            else:
                addresses = {"input_address": inputs, "output_address": outputs}
        interval = _env_seconds(HEALTH_INTERVAL_ENV, DEFAULT_HEALTH_INTERVAL_S)
        return {
            "client_addresses": addresses,
            "engine_indices": _ranks_managed(vllm_config.parallel_config),
            "client_index": args.client_index,
            "client_count": args.client_count,
            "ready_timeout": float(envs.VLLM_ENGINE_READY_TIMEOUT_S),
            "health_check_interval": interval or None,
            "health_check_timeout": _env_seconds(HEALTH_TIMEOUT_ENV, DEFAULT_HEALTH_TIMEOUT_S),
            "release": self.release,
        }

    def _vllm_finish_setup(self) -> None:
        """Apply every engine's ready response to the VllmConfig (after the ready wait);
        a multimodal model's requests with items go through vLLM's encoder from now on."""
        self.encoder = multimodal_encoder_for(
            self.encoder, self.vllm_config, self._vllm_tensor_queue
        )
        for info in self.ready_info.values():
            response = frontend_for(self.release).apply_ready(self, info)
            if response is None:
                continue
            if response.dp_stats_address is not None and self.stats_update_address is None:
                self.stats_update_address = response.dp_stats_address

    def _make_output_decoder(self) -> Any:
        return make_output_decoder(self.release)

    def _make_socket(self, kind: int, address: str, *, asyncio_mode: bool = False) -> Any:
        listener = self._vllm_listeners.pop(kind, None)
        if listener is None:
            return super()._make_socket(kind, address, asyncio_mode=asyncio_mode)  # type: ignore[misc]
        # Adopt the listening socket vLLM's parent bound on ``address`` (engines already
        # connect there): ZeroMQ takes an open descriptor for the next bind (USE_FD). The
        # socket is made, configured and owned as any other, bound first to a private
        # in-process name nothing uses, since the base binds as it makes.
        placeholder = f"inproc://corewire-adopt-{id(self)}-{kind}"
        sock = super()._make_socket(kind, placeholder, asyncio_mode=asyncio_mode)  # type: ignore[misc]
        sock.unbind(placeholder)
        require_curve_for(address, None)
        sock.setsockopt(zmq.USE_FD, listener.detach())
        sock.bind(address)
        return sock

    def _start_mm_warmup(self) -> None:
        """Start vLLM's multimodal warm-up of the renderer (0.33.0), as vLLM's client
        does once the engines are started or known to run elsewhere (no-op for text)."""
        if self._vllm_renderer is not None:
            self._vllm_renderer.start_mm_warmup_in_background()

    async def get_output_async(self) -> Any:
        """The next outputs for vLLM's output handler; a frame that breaks the protocol
        never reaches it as an exception.

        vLLM's handler stops on any exception and fails every request with it, so one bad
        frame would take the server down (vLLM's own client does exactly that). Here the
        requests the frame named finish with ``FinishReason.ERROR`` (a frame that names
        none never gets here: the output link drops it). Every bad frame is counted
        (:attr:`protocol_errors`) and logged by the output link.

        Once vLLM shut the client down (engines alive), the call waits to be cancelled, as
        under vLLM's own client, rather than raise an engine death into vLLM's log.
        """
        while True:
            try:
                return await super().get_output_async()  # type: ignore[misc]
            except ProtocolError as exc:
                request_ids = getattr(exc, "request_ids", ())
                self._note_protocol_error(exc, request_ids)
                if request_ids:
                    return finished_outputs(request_ids, FinishReason.ERROR)
            except corewire.errors.EngineDeadError:
                if not self.resources.shut_down:
                    raise
                # vLLM shut this client down and cancels its output handler next, as its
                # own client expects: that handler waits here to be cancelled instead of
                # logging an engine death that did not happen.
                await asyncio.Future()

    def _note_protocol_error(self, exc: BaseException, request_ids: tuple[str, ...]) -> None:
        metrics = self.resources.metrics
        if metrics is not None:  # the frame itself was counted where it failed to decode
            metrics.protocol_error_requests(len(request_ids))

    def _report_bound_endpoints(self, pipe: Any) -> None:
        """Tell vLLM's multi-API-server parent the endpoints this client bound.

        The parent forwards them to the engines in its start-up handshake and starts
        that handshake only once every API server has reported, so the ready wait that
        follows would hang without this. The pipe is vLLM's own local parent-child link
        (a ``multiprocessing`` connection), not the engine wire.
        """
        self._vllm_address_pipe = None
        try:
            pipe.send(
                {
                    "input_address": _bound_endpoint(self.input_socket),
                    "output_address": _bound_endpoint(self.output_socket),
                }
            )
        finally:
            pipe.close()

    def _launch_engines(self, engine_main: Any, external: bool) -> None:
        # Raised from now on, including by a death during the ready wait below.
        self.resources.dead_error_class = EngineDeadError
        if self._vllm_address_pipe is not None:
            self._report_bound_endpoints(self._vllm_address_pipe)
        if self._vllm_launch is None:
            # Engines run elsewhere: no process of ours is forked, warm up at once.
            self._start_mm_warmup()
            return
        executor_class, log_stats = self._vllm_launch
        # The sockets are bound: hand the engines the real endpoints (a tcp port 0
        # placeholder resolved, or corewire's private ipc paths).
        self.input_address = _bound_endpoint(self.input_socket)
        self.output_address = _bound_endpoint(self.output_socket)
        with frontend_for(self.release).launch(
            self.vllm_config, executor_class, log_stats, self.input_address, self.output_address
        ) as launched:
            engine_manager = launched.engine_manager
            self.vllm_engine_manager = engine_manager
            self.vllm_coordinator = launched.coordinator
            self._vllm_tensor_queue = launched.tensor_queue
            # The local engines are forked: a warm-up thread is safe now, and overlaps
            # their start-up.
            self._start_mm_warmup()
            # Watched by corewire's monitor and stopped with the client. vLLM starts the
            # local engines in rank order from the first rank this front-end drives (the
            # ranks after them may be remote).
            processes = self.resources.processes
            local = list(getattr(engine_manager, "processes", None) or ())
            if len(local) > len(self.engine_indices):
                # Never leave an engine unwatched and unstopped: refuse what cannot be owned.
                raise RuntimeError(
                    f"vLLM started {len(local)} local engines for ranks {self.engine_indices}"
                )
            # vLLM's own grace between SIGTERM and SIGKILL (vllm.v1.utils.shutdown): its
            # engine core stops its workers first, which takes longer than corewire's own
            # engines need.
            processes.terminate_grace = VLLM_TERMINATE_GRACE_S
            # Borrowed: vLLM's manager and coordinator close these handles in their own
            # finalizers, which raise on a handle already closed ("process object is
            # closed", a traceback at every shutdown of the API server).
            for index, proc in zip(self.engine_indices, local, strict=False):
                processes.add_engine(index, proc, borrowed=True)
            if launched.coordinator is not None:
                processes.set_coordinator(launched.coordinator.proc, borrowed=True)
        self.stats_update_address = launched.addresses.frontend_stats_publish_address


def _ranks_managed(parallel_config: Any) -> list[int]:
    """The DP ranks a front-end drives, as vLLM's client computes them."""
    dp_rank = parallel_config.data_parallel_index
    if parallel_config.data_parallel_rank_local is not None:  # offline mode: one engine
        return [dp_rank]
    if parallel_config.local_engines_only:
        count = parallel_config.data_parallel_size_local
    else:
        count = parallel_config.data_parallel_size
    return list(range(dp_rank, dp_rank + count))


def _bound_endpoint(sock: Any) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
