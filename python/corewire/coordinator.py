"""The data-parallel coordinator: one process per DP group that tracks load and runs waves.

A DP group is N engine processes that run request *waves* together: while any engine has
work, every engine counts as running (an engine with collectives, such as expert
parallelism, must step in lockstep); when all are idle the wave ends and the engines
pause until a request arrives anywhere. The coordinator sees every engine's request
counts, tells the front-ends, and starts and ends the waves.

Sockets (the coordinator binds all three; ``ipc://`` in a private directory by default)::

    front XPUB  <- front-ends connect XSUB and send b"\\x01" to subscribe
    stats PULL  <- engines connect PUSH and send EngineCoreOutputs with scheduler_stats
    wave  XPUB  -> engines connect SUB (subscribed to everything)

Only the engine <-> front-end links are vLLM's protocol; everything here is corewire's
own and every message is msgpack (nothing is pickled), each a named type of
:mod:`corewire.dp_messages`:

- coordinator -> front-ends: ``[counts, current_wave, engines_running]`` with counts one
  ``[waiting, running]`` pair per engine in rank order, at most every 100 ms while
  something changed, and once for each new subscriber. A coordinator of vLLM 0.33.0
  engines (``release="0.33.0"``) publishes a triple per engine instead, ``[waiting,
  running, kv_cache_usage]`` (the float the engine reports, 0.0 without one), as vLLM
  0.33.0's coordinator does.
- front-end -> coordinator: ``[engine_index, wave]``, the first-request notice a front-end
  sends when it puts a request on ``engine_index`` while the engines are paused;
  ``["scale", new_size]`` after an elastic resize (the next counts have the new length).
- engines -> coordinator: ``EngineCoreOutputs`` frames (the engine-core encoding, only the
  fields below are read): ``engine_index``, ``scheduler_stats`` (``num_waiting_reqs``,
  ``num_running_reqs``, ``current_wave``), ``start_wave`` (an engine got a request for a
  wave that already ended while it was paused) and ``wave_complete`` (an engine declares a
  wave over, as vLLM's rank 0 does after its all-reduce; corewire's engines do not send it
  but the coordinator honours it).
- coordinator -> engines, ``[request_type, msgpack payload]`` like the engines' input link:
  ``b"\\x02"`` START_DP_WAVE ``[new_wave, exclude_engine_index]`` (-1 excludes none) and
  ``b"\\x10"`` WAVE_COMPLETE ``[finished_wave]`` (corewire's own type byte, never sent on
  the front-end link).

How the coordinator reaches the engines' input: over its own wave XPUB, not through the
front-end. Every engine's input thread subscribes to it next to the request links and
feeds what arrives into its input queue, so waves never wait on a front-end's event loop
and a front-end that owns no engines (external load balancing) still wakes them all.

How a wave ends: corewire's engines have no collective to agree that all are idle, so the
coordinator is the reduction point. Engines report counts on every change; when every
engine of the group reports ``[0, 0]`` while a wave runs, the coordinator ends it:
``current_wave += 1``, paused, WAVE_COMPLETE to the engines, new state to the front-ends.
An engine named by a first-request notice counts as busy until it reports (or for
half a second), so the wave its request starts does not end before the request lands.
A request that races the end of its wave is never lost: the engine that receives it runs
it regardless, and (now at the next wave, paused) sends ``start_wave`` so the coordinator
wakes the others with START_DP_WAVE. An engine that subscribes late gets the current
state (START_DP_WAVE or WAVE_COMPLETE) at once.

Lifetime: :class:`DPCoordinator` starts the process (``python -m corewire.coordinator``),
hands it its configuration over stdin and keeps that pipe open; the process exits when the
pipe closes (``shutdown()``, the owner's finalizer, or the owner's process dying), on
SIGTERM, or when its parent pid changes.

TCP addresses reachable from other hosts require CURVE keys (:mod:`corewire.keygen`); the
coordinator then runs a ZAP handler and accepts only the authorized client keys.

Wire format: docs/protocol.md §8.2 (corewire's own coordinator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from corewire import releases
from corewire.curve import require_curve_for
from corewire.dp_messages import (
    XPUB_SUBSCRIBE,
    XPUB_UNSUBSCRIBE,
    CoordinatorLinks,
    DPState,
    EngineReport,
    LostNotice,
    ScaleNotice,
    StartWave,
    WaveComplete,
    WaveMessage,
    decode_front_message,
)
from corewire.fast_exit import exit_now
from corewire.ipcdir import make_private_dir
from corewire.keygen import CurveAuthenticator, CurveServerKeys, apply_server
from corewire.logtext import bounded

__all__ = [
    "CoordinatorAddresses",
    "CoordinatorState",
    "DPCoordinator",
    "TcpEndpoints",
]

logger = logging.getLogger("corewire.coordinator")

#: Minimum time between two stats messages to the front-ends.
PUBLISH_INTERVAL_S = 0.1
#: How often the loop wakes to check its parent when nothing happens.
_IDLE_POLL_S = 0.2
#: How long an engine named by a first-request notice counts as busy without reporting.
PENDING_REQUEST_S = 0.5


@dataclass(frozen=True)
class CoordinatorAddresses:
    """Where a coordinator listens.

    ``engine_stats`` / ``engine_publish`` serve engines on this host (``ipc://``);
    ``remote_engine_stats`` / ``remote_engine_publish``, when set, are ``tcp://``
    endpoints for engines on other hosts, bound behind CURVE.
    """

    #: XPUB: front-ends connect XSUB here.
    front_publish: str
    #: PULL: engines connect PUSH here to send their stats.
    engine_stats: str
    #: XPUB: engines connect SUB here to receive START_DP_WAVE / WAVE_COMPLETE.
    engine_publish: str
    #: The same PULL, bound once more for engines on other hosts (CURVE).
    remote_engine_stats: str | None = None
    #: The same XPUB, bound once more for engines on other hosts (CURVE).
    remote_engine_publish: str | None = None

    @classmethod
    def in_dir(cls, directory: str | os.PathLike[str]) -> CoordinatorAddresses:
        """``ipc://`` addresses inside ``directory`` (which should be private, 0700)."""
        d = os.fspath(directory)
        return cls(f"ipc://{d}/dp-front", f"ipc://{d}/dp-stats", f"ipc://{d}/dp-wave")

    def with_remote(self, stats: str, publish: str) -> CoordinatorAddresses:
        """A copy that also listens on ``stats`` and ``publish`` for remote engines."""
        return dataclasses.replace(self, remote_engine_stats=stats, remote_engine_publish=publish)

    def for_engine(self, remote: bool = False) -> CoordinatorLinks:
        """What an engine needs (its ``coordinator_addresses`` option)."""
        if remote:
            if self.remote_engine_stats is None or self.remote_engine_publish is None:
                raise ValueError("this coordinator does not listen for remote engines")
            return CoordinatorLinks(
                self.front_publish, self.remote_engine_stats, self.remote_engine_publish
            )
        return CoordinatorLinks(self.front_publish, self.engine_stats, self.engine_publish)

    def to_wire(self) -> list[str | None]:
        """The addresses as a list, for a child process's configuration."""
        return [
            self.front_publish,
            self.engine_stats,
            self.engine_publish,
            self.remote_engine_stats,
            self.remote_engine_publish,
        ]

    @classmethod
    def from_wire(cls, value: list[str | None]) -> CoordinatorAddresses:
        """Inverse of :meth:`to_wire` (also accepts the three local addresses alone)."""
        front, stats, publish, *remote = value
        if front is None or stats is None or publish is None:
            raise ValueError("the three local coordinator addresses are required")
        remote_stats, remote_publish = [*remote, None, None][:2]
        return cls(front, stats, publish, remote_stats, remote_publish)


@dataclass(frozen=True)
class TcpEndpoints:
    """The four ports behind one ``data_parallel_address="tcp://HOST:PORT"``."""

    #: The front-end's ROUTER (requests): PORT.
    input: str
    #: The front-end's PULL (outputs): PORT + 1.
    output: str
    #: The coordinator's stats PULL: PORT + 2.
    coordinator_stats: str
    #: The coordinator's wave XPUB: PORT + 3.
    coordinator_publish: str

    @classmethod
    def from_address(cls, address: str) -> TcpEndpoints:
        """Splits ``tcp://HOST:PORT`` into the four consecutive ports."""
        scheme, sep, rest = address.partition("://")
        host, colon, port_text = rest.rpartition(":")
        if scheme != "tcp" or not sep or not colon or not host or not port_text.isdigit():
            raise ValueError(f"data_parallel_address must be tcp://HOST:PORT, got {address!r}")
        port = int(port_text)
        if not 0 < port <= 65535 - 3:
            raise ValueError(f"port {port} leaves no room for the 3 ports after it")
        return cls(*(f"tcp://{host}:{port + i}" for i in range(4)))


class CoordinatorState:
    """The coordinator's bookkeeping, free of sockets so tests can drive it directly.

    Each ``on_*`` method returns the messages to broadcast to the engines
    (:class:`~corewire.dp_messages.StartWave`, :class:`~corewire.dp_messages.WaveComplete`).
    ``release`` is the engines' vLLM version: under ``"0.33.0"`` each engine's counts
    are ``[waiting, running, kv_cache_usage]``, under 0.25.1 (the default)
    ``[waiting, running]``.
    """

    def __init__(self, num_engines: int, release: str | None = None) -> None:
        if num_engines < 1:
            raise ValueError("a DP group needs at least one engine")
        #: Whether counts carry the KV cache's use (vLLM 0.33.0 on).
        self.kv_cache_usage = releases.get(release).counts_carry_kv_usage
        self.counts: list[list[Any]] = [self._idle() for _ in range(num_engines)]
        self.current_wave = 0
        self.engines_running = False
        #: Whether the front-ends have not seen the latest state yet.
        self.changed = True
        #: Engines a front-end just sent a request to (first-request notice), until they
        #: report or the deadline passes: the request may not have reached them yet, so
        #: their last ``[0, 0]`` must not end the wave it started.
        self.pending: dict[int, float] = {}

    def _idle(self) -> list[Any]:
        return [0, 0, 0.0] if self.kv_cache_usage else [0, 0]

    @property
    def num_engines(self) -> int:
        """Engines in the group."""
        return len(self.counts)

    def snapshot(self) -> DPState:
        """The message for the front-ends."""
        return DPState(self.counts, self.current_wave, self.engines_running)

    def wave_state_message(self) -> WaveMessage:
        """What a late engine needs: the running wave, or the last one that ended."""
        if self.engines_running:
            return StartWave(self.current_wave, -1)
        return WaveComplete(self.current_wave - 1)

    def _start(self, wave: int, exclude: int) -> list[WaveMessage]:
        self.current_wave = wave
        self.engines_running = True
        self.changed = True
        return [StartWave(wave, exclude)]

    def _complete(self, wave: int) -> list[WaveMessage]:
        self.current_wave = wave + 1
        self.engines_running = False
        self.changed = True
        return [WaveComplete(wave)]

    def on_first_request(self, engine_index: int, wave: int, now: float = 0.0) -> list[WaveMessage]:
        """A front-end sent a request to ``engine_index`` while it saw the engines paused."""
        if 0 <= engine_index < len(self.counts):
            self.pending[engine_index] = now + PENDING_REQUEST_S
        if wave < self.current_wave:
            # The front-end's view is stale: the target engine may not wake on the request's
            # wave number, so wake every engine, the target included.
            engine_index = -1
        elif wave > self.current_wave:
            self.current_wave = wave  # cannot come from our own publications; be lenient
        if self.engines_running:
            return []
        return self._start(self.current_wave, engine_index)

    def on_engine_report(
        self,
        engine_index: int,
        stats: dict[str, Any] | None,
        start_wave: int | None,
        wave_complete: int | None,
    ) -> list[WaveMessage]:
        """An engine sent its counts and/or a wave event."""
        if not 0 <= engine_index < len(self.counts):
            return []  # an engine removed by a scale-down, still draining
        out: list[WaveMessage] = []
        if stats is not None:
            self.pending.pop(engine_index, None)
            entry: list[Any] = [
                int(stats.get("num_waiting_reqs", 0)),
                int(stats.get("num_running_reqs", 0)),
            ]
            if self.kv_cache_usage:
                entry.append(float(stats.get("kv_cache_usage", 0.0)))
            if entry != self.counts[engine_index]:
                self.counts[engine_index] = entry
                self.changed = True
        if wave_complete is not None and wave_complete >= self.current_wave:
            out += self._complete(wave_complete)
        if start_wave is not None and (
            start_wave > self.current_wave
            or (start_wave == self.current_wave and not self.engines_running)
        ):
            out += self._start(start_wave, engine_index)
        elif stats is not None and self._group_idle():
            # Only a fresh report can show the group idle: a wave event alone says nothing
            # about counts that may be stale.
            out += self._complete(self.current_wave)
        return out

    def _group_idle(self) -> bool:
        return (
            self.engines_running
            and not self.pending
            and all(c[0] == 0 and c[1] == 0 for c in self.counts)
        )

    def next_deadline(self) -> float | None:
        """When :meth:`on_tick` has something to do (a pending engine expires)."""
        return min(self.pending.values(), default=None)

    def on_tick(self, now: float) -> list[WaveMessage]:
        """Expire pending engines whose report never came (their request finished before
        the notice arrived); end the wave if that leaves the group idle."""
        expired = [e for e, deadline in self.pending.items() if deadline <= now]
        for e in expired:
            del self.pending[e]
        if expired and self._group_idle():
            return self._complete(self.current_wave)
        return []

    def on_engine_lost(self, engine_index: int) -> list[WaveMessage]:
        """Engine ``engine_index`` died and the group serves on: count it idle (its last
        report no longer stands) until it reports again; end the wave if that leaves the
        group idle."""
        if not 0 <= engine_index < len(self.counts):
            return []
        self.pending.pop(engine_index, None)
        if self.counts[engine_index] != self._idle():
            self.counts[engine_index] = self._idle()
            self.changed = True
        if self._group_idle():
            return self._complete(self.current_wave)
        return []

    def on_scale(self, new_size: int) -> None:
        """The group now has ``new_size`` engines: new ones start idle, removed ones drop."""
        if new_size < 1:
            raise ValueError("a DP group needs at least one engine")
        del self.counts[new_size:]
        self.counts += [self._idle() for _ in range(new_size - len(self.counts))]
        self.pending = {e: t for e, t in self.pending.items() if e < new_size}
        self.changed = True


def _bind(
    sock: zmq.Socket[Any], local: str, remote: str | None, keys: CurveServerKeys | None
) -> None:
    """Binds ``local`` plainly, then ``remote`` behind CURVE when there are keys (socket
    options are taken per bind, so engines on this host need no keys); a ``remote`` that
    other hosts can reach requires keys."""
    require_curve_for(local, None)
    sock.bind(local)
    if remote is not None:
        require_curve_for(remote, keys)
        if keys is not None:
            apply_server(sock, keys)
        sock.bind(remote)


class _Coordinator:
    """The coordinator process's loop; see the module docstring."""

    def __init__(
        self,
        num_engines: int,
        addresses: CoordinatorAddresses,
        keys: CurveServerKeys | None,
        control_fd: int,
        parent_pid: int,
        release: str | None = None,
    ) -> None:
        self.state = CoordinatorState(num_engines, release)
        self.control_fd = control_fd
        self.parent_pid = parent_pid
        self.stop = False
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.zap = CurveAuthenticator(self.ctx, keys.authorized) if keys is not None else None
        self.front = self.ctx.socket(zmq.XPUB)
        self.stats = self.ctx.socket(zmq.PULL)
        self.wave = self.ctx.socket(zmq.XPUB)
        for sock in (self.front, self.stats, self.wave):
            sock.linger = 0
        # Verbose: every subscriber's subscription reaches us, so each gets the state.
        self.front.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.wave.setsockopt(zmq.XPUB_VERBOSE, 1)
        _bind(self.front, addresses.front_publish, None, None)
        _bind(self.stats, addresses.engine_stats, addresses.remote_engine_stats, keys)
        _bind(self.wave, addresses.engine_publish, addresses.remote_engine_publish, keys)
        self.report_decoder = msgspec.msgpack.Decoder(EngineReport)
        self.last_publish = 0.0

    def close(self) -> None:
        for sock in (self.front, self.stats, self.wave):
            sock.close(linger=0)
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.stats, zmq.POLLIN)
        # Engines' (re)subscriptions: each gets the current wave state at once.
        poller.register(self.wave, zmq.POLLIN)
        poller.register(self.control_fd, zmq.POLLIN)
        while not self.stop:
            now = time.monotonic()
            wake = now + _IDLE_POLL_S
            if self.state.changed:
                wake = min(wake, self.last_publish + PUBLISH_INTERVAL_S)
            deadline = self.state.next_deadline()
            if deadline is not None:
                wake = min(wake, deadline)
            ready = dict(poller.poll(int(max(0.0, wake - now) * 1000)))
            # EOF on the pipe: the owner closed its end (shutdown) or died.
            if self.control_fd in ready and not os.read(self.control_fd, 4096):
                return
            if self.front in ready:
                self._drain_front()
            if self.stats in ready:
                self._drain_stats()
            if self.wave in ready:
                self._drain_wave_subscriptions()
            if self.state.pending:
                self._broadcast(self.state.on_tick(time.monotonic()))
            if os.getppid() != self.parent_pid:
                logger.warning("DP coordinator: parent process %d is gone", self.parent_pid)
                return
            if self.state.changed and time.monotonic() >= self.last_publish + PUBLISH_INTERVAL_S:
                self._publish()

    def _publish(self) -> None:
        self.front.send(self.state.snapshot().encode())
        self.state.changed = False
        self.last_publish = time.monotonic()

    def _broadcast(self, messages: list[WaveMessage]) -> None:
        for message in messages:
            self.wave.send_multipart(message.to_frames())

    def _drain_front(self) -> None:
        # Edge-triggered readiness: take everything that is there before polling again.
        while True:
            try:
                frame = self.front.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frame[:1] in (XPUB_UNSUBSCRIBE, XPUB_SUBSCRIBE):
                if frame[:1] == XPUB_SUBSCRIBE:
                    self.state.changed = True  # a new front-end: send it the state soon
                continue
            self._handle_front_message(frame)

    def _handle_front_message(self, frame: bytes) -> None:
        try:
            msg = decode_front_message(frame)
            if isinstance(msg, ScaleNotice):
                self.state.on_scale(msg.new_size)
            elif isinstance(msg, LostNotice):
                self._broadcast(self.state.on_engine_lost(msg.engine_index))
            else:
                self._broadcast(
                    self.state.on_first_request(msg.engine_index, msg.wave, time.monotonic())
                )
        except ValueError as exc:  # ProtocolError included
            logger.warning("DP coordinator: ignoring bad front-end message: %s", bounded(exc))

    def _drain_stats(self) -> None:
        while True:
            try:
                frames = self.stats.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                report = self.report_decoder.decode(frames[0])
                messages = self.state.on_engine_report(
                    report.engine_index,
                    report.scheduler_stats,
                    report.start_wave,
                    report.wave_complete,
                )
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
                logger.warning("DP coordinator: ignoring bad engine report: %s", bounded(exc))
                continue
            self._broadcast(messages)

    def _drain_wave_subscriptions(self) -> None:
        # An engine that (re)subscribes gets the current wave state at once.
        subscribed = False
        while True:
            try:
                frame = self.wave.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            subscribed = subscribed or frame[:1] == XPUB_SUBSCRIBE
        if subscribed:
            self._broadcast([self.state.wave_state_message()])


class _Config(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """What the owner hands the coordinator process on stdin."""

    num_engines: int
    addresses: list[str | None]
    parent_pid: int
    curve_server_dir: str | None = None
    #: The engines' vLLM wire version (None: the default).
    release: str | None = None


def _child_main() -> int:
    """Entry point of ``python -m corewire.coordinator`` (started by :class:`DPCoordinator`)."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # Config: one length-prefixed msgpack message on stdin; the pipe then stays open as
    # the owner's lifeline.
    control_fd = sys.stdin.fileno()
    header = _read_exact(control_fd, 4)
    config = msgspec.msgpack.decode(
        _read_exact(control_fd, int.from_bytes(header, "little")), type=_Config
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the owner; it stops us
    coordinator: _Coordinator | None = None

    def on_term(_signum: int, _frame: Any) -> None:
        if coordinator is not None:
            coordinator.stop = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        keys = (
            CurveServerKeys.from_dir(config.curve_server_dir) if config.curve_server_dir else None
        )
        coordinator = _Coordinator(
            config.num_engines,
            CoordinatorAddresses.from_wire(config.addresses),
            keys,
            control_fd,
            config.parent_pid,
            config.release,
        )
    except Exception as exc:
        _report(f"error: {type(exc).__name__}: {exc}")
        return 1
    _report("ready")
    try:
        coordinator.run()
    finally:
        coordinator.close()
    return 0


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise SystemExit(0)  # the owner went away before configuring us
        buf += chunk
    return buf


def _report(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


def _cleanup(proc: subprocess.Popen[bytes], fds: list[int], directory: str | None) -> None:
    """Stops the process (lifeline, then SIGTERM, then SIGKILL), reaps it, closes the
    sentinel and removes the private ipc directory."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class DPCoordinator:
    """Owner of one coordinator process (see the module docstring).

    With ``addresses`` None it listens on ``ipc://`` endpoints in a private directory of
    its own; ``remote`` adds ``(stats, publish)`` ``tcp://`` endpoints for engines on other
    hosts, behind CURVE (``curve_server_dir``: its authorized client keys get in).
    ``shutdown()`` stops it and is idempotent; a finalizer does the same when the owner is
    collected, and the process exits by itself when this process dies. ``release`` is
    the engines' vLLM version (``"0.33.0"``: counts published as triples with the KV
    cache's use; None: the default, pairs).

    It is a process handle (:class:`corewire.client.processes.ProcessHandle`: ``sentinel``,
    ``pid``, ``name``, ``exitcode``, ``is_alive``, ``terminate``, ``kill``, ``join``,
    ``close``): a client holds it as its process group's coordinator, watched and stopped
    with the engines by the same monitor and stop routine.
    """

    def __init__(
        self,
        num_engines: int,
        addresses: CoordinatorAddresses | None = None,
        *,
        remote: tuple[str, str] | None = None,
        curve_server_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        release: str | None = None,
        protocol: str | None = None,
    ) -> None:
        # protocol=: the deprecated name of release=.
        release = releases.get(releases.named(release, protocol, "DPCoordinator"))
        directory = None
        if addresses is None:
            directory = make_private_dir("dp")
            addresses = CoordinatorAddresses.in_dir(directory)
        if remote is not None:
            addresses = addresses.with_remote(*remote)
        for address in (addresses.front_publish, addresses.engine_stats, addresses.engine_publish):
            require_curve_for(address, None)
        for remote_address in (addresses.remote_engine_stats, addresses.remote_engine_publish):
            if remote_address is not None:
                require_curve_for(remote_address, curve_server_dir)
        self.addresses = addresses
        self.name = "corewire-dp-coordinator"
        config = _Config(
            num_engines=num_engines,
            addresses=addresses.to_wire(),
            parent_pid=os.getpid(),
            curve_server_dir=os.fspath(curve_server_dir) if curve_server_dir else None,
            # The plain version string: msgspec writes no str subclass (a Release).
            release=release.name,
        )
        payload = msgspec.msgpack.encode(config)
        proc = subprocess.Popen(
            [sys.executable, "-m", "corewire.coordinator"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._proc = proc
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _cleanup, proc, self._fds, directory)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(len(payload).to_bytes(4, "little") + payload)
            proc.stdin.flush()
            line = _read_line(proc.stdout, startup_timeout)
            if line != "ready":
                raise RuntimeError(f"DP coordinator failed to start: {line or 'no answer'}")
            #: Readable once the process has exited: a pidfd where the kernel has them,
            #: else the end of the process's stdout pipe (it writes nothing after "ready").
            self.sentinel: int = proc.stdout.fileno()
            if hasattr(os, "pidfd_open"):
                with contextlib.suppress(OSError):
                    self.sentinel = os.pidfd_open(proc.pid)
                    self._fds.append(self.sentinel)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        """The coordinator's process id."""
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """Exit status once it has exited (negative: killed by that signal), else None."""
        return self._proc.poll()

    def is_alive(self) -> bool:
        """Whether the process is still running."""
        return self._proc.poll() is None

    def terminate(self) -> None:
        """Asks the process to exit: closes its lifeline and sends SIGTERM."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()

    def kill(self) -> None:
        """SIGKILL."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    def join(self, timeout: float | None = None) -> None:
        """Waits up to ``timeout`` seconds for the process to exit."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout)

    def close(self) -> None:
        """Releases everything (same as :meth:`shutdown`)."""
        self.shutdown()

    def shutdown(self) -> None:
        """Stops the process, waits for it and removes its files (idempotent)."""
        self._finalizer()


def _read_line(stream: Any, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"DP coordinator did not start within {timeout:.0f} s")
        readable, _, _ = select.select([fd], [], [], remaining)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.decode(errors="replace").strip()


if __name__ == "__main__":
    # Without the interpreter's teardown (corewire.fast_exit): the process is done.
    exit_now(_child_main())
