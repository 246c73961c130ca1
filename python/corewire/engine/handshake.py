"""Joining a vLLM front-end the way a vLLM ``--headless`` engine does.

A vLLM 0.25.1 API server started front-end only (``vllm serve MODEL
--data-parallel-size N --data-parallel-size-local 0 --data-parallel-address HOST
--data-parallel-rpc-port PORT``) binds a handshake ROUTER on ``tcp://HOST:PORT`` and waits
for N remote engines. Each corewire engine joins it with::

    corewire engine --handshake-address tcp://HOST:PORT --engine-index N \\
        [--engine module:Class] [--engine-args JSON] [--data-parallel-size N]

and then serves requests like any vLLM engine core. A vLLM 0.33.0 front-end does the same
handshake; its engines need ``--release 0.33.0`` (the handshake does not tell the
version, and 0.33.0's front-end refuses a 0.25.1 ready response). Start order does not
matter: the engine's HELLO waits in ZeroMQ until the front-end listens (up to
``--handshake-timeout`` seconds for the front-end's answer).

The steps (vLLM's ``startup_handshake`` / ``wait_for_engine_startup``, engine side):

1. build the engine first, so that an engine that cannot start never registers (vLLM's
   front-end refuses a second HELLO from the same index);
2. DEALER to the handshake address, identity = engine index as 2 bytes little-endian;
   send msgpack ``{"status": "HELLO", "local": false, "headless": true}``;
3. receive the metadata map: ``addresses`` (``inputs`` and ``outputs``, one per API
   server; ``coordinator_input`` / ``coordinator_output`` /
   ``frontend_stats_publish_address`` with DP > 1) and ``parallel_config``;
4. connect a DEALER to each input and a PUSH to each output, and send the ready response
   (:mod:`corewire.engine.ready`) on each input; with a DP coordinator, subscribe to it
   and wait for its READY (:class:`~corewire.engine.vllm_dp.VllmDPEngineCoreProc`);
5. send ``{"status": "READY", "local": false, "headless": true}`` on the handshake
   socket and close it.

Rejoining: with ``--join-record PATH`` the engine writes the metadata of step 3 to
``PATH`` (a private file); an engine started again for the same index with ``--join-record
PATH --rejoin`` skips the handshake (vLLM's front-end has closed it) and does step 4 with
those addresses. corewire's DP client takes such an engine back in place of a lost one
(``engine_loss="replace"`` for engines it did not start); vLLM's client would not.

Stopping (SIGTERM / SIGINT): the engine finishes its requests in flight with ABORT, as
vLLM's engines do, and then sends ENGINE_CORE_DEAD: a vLLM front-end cannot take a
stopped engine back, and its own client never notices a remote engine leaving, so it
would keep routing requests into the void.

A non-empty ``parallel_config`` means a coordinated (MoE) DP group whose ranks step in
lockstep through torch collectives and must prove identical vLLM parallel configs; a
corewire engine cannot take part, so it refuses with a clear error instead. (vLLM's own
engines for other models send no ``parallel_config_hash`` either: they run as
independent DP = 1 engines, and the front-end checks the hash only for MoE groups.)

Wire format: docs/protocol.md §3.2 (joining a vLLM front-end: HELLO, metadata, READY).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from corewire.engine.core import EngineCoreProc
from corewire.engine.link import connect_socket
from corewire.protocol import READY_STATUS, engine_identity

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "FrontEndHandshake",
    "HandshakeError",
    "HandshakeMetadata",
    "join_frontend",
    "read_join_record",
    "write_join_record",
]

logger = logging.getLogger("corewire.engine")

#: How long to wait for the front-end's answer to HELLO (vLLM's engines wait 5 minutes).
DEFAULT_HANDSHAKE_TIMEOUT_S = 300.0
_LINGER_MS = 5000


class HandshakeError(RuntimeError):
    """The front-end's side of the start-up handshake was missing or unusable."""


@dataclasses.dataclass(frozen=True)
class HandshakeMetadata:
    """What the front-end answers to HELLO (vLLM's ``EngineHandshakeMetadata``)."""

    #: Request links (the front-ends' ROUTERs), one per API server.
    inputs: list[str]
    #: Output links (the front-ends' PULLs), one per API server.
    outputs: list[str]
    #: vLLM's DP coordinator: its XPUB for engines (None without DP).
    coordinator_input: str | None = None
    #: vLLM's DP coordinator: its PULL for engine stats (None without DP).
    coordinator_output: str | None = None
    #: Where front-ends subscribe to DP stats (reported in the ready response).
    frontend_stats_publish_address: str | None = None
    #: DP settings of a coordinated (MoE) group; empty otherwise.
    parallel_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def decode(cls, payload: bytes) -> HandshakeMetadata:
        """Parse the metadata map; raises :class:`HandshakeError` when it is unusable."""
        try:
            msg = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError as exc:
            raise HandshakeError(f"handshake metadata is not msgpack: {exc}") from exc
        addresses = msg.get("addresses") if isinstance(msg, dict) else None
        if not isinstance(addresses, dict):
            raise HandshakeError(f"handshake metadata has no addresses map: {msg!r:.200}")
        inputs, outputs = addresses.get("inputs"), addresses.get("outputs")
        if (
            not isinstance(inputs, list)
            or not isinstance(outputs, list)
            or not _str_list(inputs)
            or not _str_list(outputs)
            or len(inputs) != len(outputs)
        ):
            raise HandshakeError(
                f"handshake metadata needs as many input as output addresses: {addresses!r:.200}"
            )
        optional = {}
        for key in ("coordinator_input", "coordinator_output", "frontend_stats_publish_address"):
            value = addresses.get(key)
            if value is not None and not isinstance(value, str):
                raise HandshakeError(f"handshake metadata: {key} is not an address: {value!r}")
            optional[key] = value
        if (optional["coordinator_input"] is None) != (optional["coordinator_output"] is None):
            raise HandshakeError("handshake metadata names only one DP coordinator address")
        parallel_config = msg.get("parallel_config") or {}
        if not isinstance(parallel_config, dict):
            raise HandshakeError(f"handshake metadata: bad parallel_config {parallel_config!r}")
        return cls(
            inputs=list(inputs), outputs=list(outputs), parallel_config=parallel_config, **optional
        )


def write_join_record(path: str, meta: HandshakeMetadata) -> None:
    """Keep ``meta`` at ``path`` (owner-only: it names the front-end's endpoints) for an
    engine started again in this one's place (:func:`read_join_record`)."""
    document = json.dumps(dataclasses.asdict(meta)).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as record:
        record.write(document)


def read_join_record(path: str) -> HandshakeMetadata:
    """The metadata :func:`write_join_record` kept; :class:`HandshakeError` when the
    file is missing or not such a record."""
    try:
        with open(path, "rb") as record:
            document = record.read()
    except OSError as exc:
        raise HandshakeError(f"no join record at {path}: {exc}") from exc
    try:
        fields = json.loads(document)
        # Through the handshake's own checks: a record is the front-end's answer, kept.
        payload = msgspec.msgpack.encode(
            {
                "addresses": {k: v for k, v in fields.items() if k != "parallel_config"},
                "parallel_config": fields.get("parallel_config") or {},
            }
        )
    except (ValueError, AttributeError) as exc:
        raise HandshakeError(f"{path} is not a join record: {exc}") from exc
    return HandshakeMetadata.decode(payload)


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


class FrontEndHandshake:
    """The engine's end of vLLM's start-up handshake: HELLO, metadata, READY.

    Owns its own ZeroMQ context and DEALER. :meth:`hello` runs on the constructing
    thread; :meth:`ready` and :meth:`close` may run on another thread afterwards (the
    socket is handed over, never shared).
    """

    def __init__(self, address: str, engine_index: int) -> None:
        if not 0 <= engine_index < 1 << 16:
            raise ValueError(f"engine_index must fit in 2 bytes, got {engine_index}")
        self.address = address
        self.engine_index = engine_index
        self._ctx = zmq.Context()
        try:
            self._sock = connect_socket(
                self._ctx,
                zmq.DEALER,
                address,
                linger_ms=_LINGER_MS,
                identity=engine_identity(engine_index),
            )
        except BaseException:
            self._ctx.term()
            raise
        self._closed = False

    def _status(self, status: str) -> bytes:
        # A joining engine is remote and headless (vLLM refuses anything else here).
        return msgspec.msgpack.encode({"status": status, "local": False, "headless": True})

    def hello(self, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> HandshakeMetadata:
        """Register with the front-end and return its metadata."""
        self._sock.send(self._status("HELLO"))
        if not self._sock.poll(int(timeout_s * 1000)):
            raise HandshakeError(
                f"no answer to HELLO from the front-end at {self.address} within {timeout_s:g} s"
            )
        return HandshakeMetadata.decode(self._sock.recv())

    def ready(self) -> None:
        """Tell the front-end this engine is serving (after its ready responses)."""
        self._sock.send(self._status(READY_STATUS))

    def close(self) -> None:
        """Close the socket (lingering so that READY still goes out) and the context."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=_LINGER_MS)
        self._ctx.term()


def _build_proc(
    built: Any,
    meta: HandshakeMetadata,
    engine_index: int,
    data_parallel_size: int,
    release: str | None = None,
) -> EngineCoreProc:
    common: dict[str, Any] = {
        "engine_index": engine_index,
        "release": release,
        "input_address": meta.inputs,
        "output_address": meta.outputs,
        "dp_stats_address": meta.frontend_stats_publish_address,
        # vLLM's front-end never takes a stopped engine back: tell it when stopping.
        "stop_notice": True,
    }
    if meta.coordinator_input is None or meta.coordinator_output is None:
        return EngineCoreProc(built, **common)
    from corewire.engine.vllm_dp import VllmDPEngineCoreProc

    return VllmDPEngineCoreProc(
        built,
        coordinator_input=meta.coordinator_input,
        coordinator_output=meta.coordinator_output,
        data_parallel_size=data_parallel_size,
        **common,
    )


def _send_ready_when_serving(proc: EngineCoreProc, handshake: FrontEndHandshake) -> None:
    """Thread body: READY once the proc's ready responses went out (never, if the
    proc stops first); then close the handshake socket, as vLLM's engines do."""
    try:
        while not proc.ready_event.wait(0.2):
            if proc.stop_requested:
                logger.warning("engine stopped before it was ready; no READY sent")
                return
        handshake.ready()
        logger.info("engine %d joined the front-end at %s", proc.engine_index, handshake.address)
    finally:
        handshake.close()


def join_frontend(
    *,
    handshake_address: str,
    engine_index: int,
    engine: str | None = None,
    engine_args: dict[str, Any] | None = None,
    parent_pid: int | None = None,
    data_parallel_size: int = 1,
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    release: str | None = None,
    on_built: Callable[[Any], None] | None = None,
    join_record: str | None = None,
    rejoin: bool = False,
) -> int:
    """Join the vLLM front-end whose handshake ROUTER is at ``handshake_address`` and
    serve until stopped; return the exit status (0 clean stop, 1 failure).

    ``join_record``: a file where the handshake's answer is kept; with ``rejoin`` the
    engine takes its addresses from that file instead of a handshake (it is started
    again in place of a lost engine of the same index; see the module docstring).

    ``data_parallel_size`` is only reported in the ready response; ``release`` is the
    front-end's vLLM wire version (the handshake does not tell it). ``on_built`` is
    given the engine core once it is built, before it runs (to stop it from another
    thread: a Ray actor's). See the module docstring for the steps and their order.
    """
    from corewire.engine.launch import configure_logging, load_engine, run_proc

    configure_logging(engine_index)
    try:
        built = load_engine(engine, engine_args)
    except Exception:
        logger.exception("engine %d failed to start", engine_index)
        return 1
    if rejoin:
        if join_record is None:
            raise ValueError("rejoin needs the join_record of the engine it replaces")
        return _rejoin(built, join_record, engine_index, data_parallel_size, release, parent_pid)
    handshake = FrontEndHandshake(handshake_address, engine_index)
    try:
        meta = handshake.hello(handshake_timeout_s)
        if join_record is not None:
            write_join_record(join_record, meta)
        if meta.parallel_config:
            raise HandshakeError(
                "the front-end runs a coordinated (MoE) data-parallel group, whose ranks "
                "step in lockstep through torch collectives; corewire engines can join "
                "front-ends of other models only"
            )
        proc = _build_proc(built, meta, engine_index, data_parallel_size, release)
        if on_built is not None:
            on_built(proc)
    except Exception:
        logger.exception(
            "engine %d could not join the front-end at %s", engine_index, handshake_address
        )
        handshake.close()
        _shutdown_quietly(built)
        return 1
    announcer = threading.Thread(
        target=_send_ready_when_serving,
        args=(proc, handshake),
        name=f"corewire-engine-{engine_index}-handshake",
        daemon=True,
    )
    announcer.start()
    try:
        return run_proc(proc, parent_pid)
    finally:
        # It ends within a poll interval once the proc stopped (plus READY's linger).
        announcer.join(timeout=_LINGER_MS / 1000 + 1.0)


def _rejoin(
    built: Any,
    join_record: str,
    engine_index: int,
    data_parallel_size: int,
    release: str | None,
    parent_pid: int | None,
) -> int:
    """Serve with the addresses a former engine of ``engine_index`` was given."""
    from corewire.engine.launch import run_proc

    try:
        meta = read_join_record(join_record)
        proc = _build_proc(built, meta, engine_index, data_parallel_size, release)
    except Exception:
        logger.exception("engine %d could not rejoin with %s", engine_index, join_record)
        _shutdown_quietly(built)
        return 1
    logger.info("engine %d rejoins the front-end at %s", engine_index, meta.inputs[0])
    return run_proc(proc, parent_pid)


def _shutdown_quietly(engine: Any) -> None:
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is None:
        return
    try:
        shutdown()
    except Exception:
        logger.exception("engine shutdown() failed")
