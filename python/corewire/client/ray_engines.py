"""DP engines as Ray actors, placed by one placement group (``data_parallel_backend="ray"``).

A DP client with the Ray backend starts no engine process of its own. It asks Ray for a
placement group with one bundle per engine (the resources each engine asks for, with
the strategy the caller chose), starts one :class:`~corewire.engine.ray_actor.EngineActor`
per bundle, and the engines connect back to the front-end's TCP endpoints on the
driver's node address (behind CURVE when that address is not loopback: the keys are
written into a private 0700 directory on the front-end's host and handed to the actors
in memory). From there on the group is the same DP group as with local processes: the
coordinator, waves, routing and health checks do not know where the engines run.

Each engine is held as a :class:`RayEngineHandle`, which looks like a process to the
client's :class:`~corewire.client.processes.ProcessGroup`: its ``sentinel`` turns
readable when the actor's ``serve`` call ends, normally or not. An actor that dies, or
a node that leaves the cluster, ends that call with Ray's death notice at once, so the
client learns the loss from Ray before its health check would.

``ray`` is an optional dependency (``pip install 'corewire[ray]'``), imported only here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PLACEMENT_STRATEGIES",
    "RayBackend",
    "RayEngineHandle",
    "RayEngines",
    "RayPlacement",
    "import_ray",
]

logger = logging.getLogger("corewire.client")

#: Ray's placement strategies: all bundles on as few nodes as possible (``PACK``), on
#: one node or fail (``STRICT_PACK``), on as many nodes as possible (``SPREAD``), or each
#: on a node of its own or fail (``STRICT_SPREAD``).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
#: How an engine's actor is told apart in Ray's own listings (``ray list actors``).
ACTOR_NAME_PREFIX = "corewire-engine"
#: How often a wait for placement looks whether it was given up.
_PLACEMENT_POLL_S = 0.25
#: Exit code a handle reports for an actor Ray declared dead (killed, or its node gone):
#: the code a SIGKILLed process would have.
ACTOR_DIED_EXITCODE = -9


def import_ray() -> Any:
    """The ``ray`` module; without it, an ``ImportError`` that names the extra."""
    try:
        import ray
        import ray.util.placement_group
        import ray.util.scheduling_strategies
    except ImportError as exc:
        raise ImportError(
            "data_parallel_backend='ray' needs Ray: pip install 'corewire[ray]'"
        ) from exc
    return ray


@dataclass(frozen=True)
class RayPlacement:
    """Where and how the engines of one client are placed on a Ray cluster.

    Parameters:
        address: the cluster to join (``ray.init(address=...)``: ``"auto"``, a GCS
            address ``HOST:PORT``) when this process has not joined one yet (a process
            holds one Ray connection: another address is then logged and not used);
            None: the Ray this process already joined, else the cluster
            ``RAY_ADDRESS`` names, else a local one Ray starts.
        strategy: one of :data:`PLACEMENT_STRATEGIES` (default ``"PACK"``, Ray's).
        bundle: the resources of each engine's bundle, as Ray names them (``"CPU"``,
            ``"GPU"``, ``"memory"`` in bytes, or any custom resource). An engine with
            ``"GPU"`` sees only the GPUs Ray assigned it (``CUDA_VISIBLE_DEVICES``).
        placement_timeout: seconds to wait for the cluster to reserve every bundle
            before giving up (the error names what was asked and what is free).
        node_ip: the address the engines connect back to; None: this node's address as
            Ray sees it. Give it when that address is not reachable from the others.
        runtime_env: Ray's runtime environment for the engine actors (``env_vars``,
            ``pip``, ``working_dir``...: how the engine's own package and settings reach
            nodes that lack them); None: the job's.
    """

    address: str | None = None
    strategy: str = "PACK"
    bundle: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement_timeout: float = 120.0
    node_ip: str | None = None
    runtime_env: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {self.strategy!r}"
            )
        if not self.bundle or any(
            not isinstance(v, (int, float)) or v < 0 for v in self.bundle.values()
        ):
            raise ValueError(
                f"bundle must map resource names to amounts >= 0, got {dict(self.bundle)!r}"
            )
        if self.placement_timeout <= 0:
            raise ValueError(f"placement_timeout must be > 0, got {self.placement_timeout}")


def actor_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """The ``ray.remote`` options that ask for exactly ``bundle`` (an actor in a
    placement group must fit its bundle)."""
    custom = {k: float(v) for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {
        "num_cpus": float(bundle.get("CPU", 0)),
        "num_gpus": float(bundle.get("GPU", 0)),
    }
    if "memory" in bundle:
        options["memory"] = float(bundle["memory"])
    if custom:
        options["resources"] = custom
    return options


class RayEngineHandle:
    """One engine's Ray actor, seen as a process (:class:`~corewire.client.processes.
    ProcessHandle`) by the client's process group.

    A thread (``corewire-engine-K-ray-watch``) waits for the actor's ``serve`` call and
    records how it ended: the engine's exit status, 1 when ``serve`` raised (the error
    is :attr:`startup_error`), or :data:`ACTOR_DIED_EXITCODE` when Ray declared the
    actor dead (:attr:`death_detail` says why, from Ray's notice); then the sentinel
    turns readable.
    """

    def __init__(self, ray: Any, actor: Any, serve_ref: Any, index: int, where: dict[str, Any]):
        self.name = f"{ACTOR_NAME_PREFIX}-{index}"
        #: The engine's index in its DP group.
        self.index = index
        #: Where the engine runs, as it reported it (node id, node address, pid, GPUs).
        self.where = where
        #: Why ``serve`` failed before the engine ran, when it did.
        self.startup_error: str | None = None
        #: Ray's account of the actor's death, when Ray declared it dead.
        self.death_detail: str | None = None
        self._ray = ray
        self._actor = actor
        self._exitcode: int | None = None
        self._read_fd, self._write_fd = os.pipe()
        self._fd_lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(
            target=self._wait, args=(serve_ref,), name=f"{self.name}-ray-watch", daemon=True
        )
        self._thread.start()

    def _wait(self, serve_ref: Any) -> None:
        exceptions = self._ray.exceptions
        try:
            code = int(self._ray.get(serve_ref))
        except exceptions.RayActorError as exc:  # killed, crashed, or its node left
            code = ACTOR_DIED_EXITCODE
            self.death_detail = _first_line(exc)
        except exceptions.RayTaskError as exc:  # serve raised: the engine did not build
            code = 1
            self.startup_error = _first_line(exc.cause if exc.cause is not None else exc)
        except Exception as exc:  # anything else Ray raises still ends the engine
            code = 1
            self.death_detail = _first_line(exc)
        self._exitcode = code
        os.close(self._write_fd)  # EOF on the read end: the sentinel is readable
        with self._fd_lock:
            if self._closing:  # close() came first: the sentinel is this thread's to free
                self._close_read_fd()

    @property
    def node_id(self) -> str:
        """The Ray node the engine runs on."""
        return str(self.where["node_id"])

    @property
    def sentinel(self) -> int:
        """Readable once the actor's ``serve`` call has ended."""
        return self._read_fd

    @property
    def pid(self) -> int | None:
        """The actor's process id on its node."""
        return int(self.where["pid"])

    @property
    def exitcode(self) -> int | None:
        """None while the engine runs; see the class docstring."""
        return self._exitcode

    def is_alive(self) -> bool:
        """Whether the actor's ``serve`` call is still running."""
        return self._exitcode is None

    def terminate(self) -> None:
        """Ask the engine to stop (it sends what it still has queued)."""
        with contextlib.suppress(Exception):
            self._actor.stop.remote()

    def kill(self) -> None:
        """End the actor now (Ray's ``ray.kill``: its process is killed)."""
        with contextlib.suppress(Exception):
            self._ray.kill(self._actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the ``serve`` call to end."""
        self._thread.join(timeout)

    def close(self) -> None:
        """End the actor's process (its engine has stopped, or the group gave up on it)
        and release the sentinel, now or, while Ray has not declared the actor ended
        yet, when it does."""
        # Now, rather than when its placement group goes: Ray would SIGTERM an idle
        # worker then, whose handler raises in the middle of whatever it collects.
        self.kill()
        with self._fd_lock:
            self._closing = True
            if self._exitcode is not None:
                self._close_read_fd()

    def _close_read_fd(self) -> None:
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


class RayEngines:
    """The Ray side of one client's engines: the connection to the cluster, the
    placement group, and the engine actors; :meth:`close` removes the placement group
    (its actors end with it)."""

    def __init__(self, placement: RayPlacement) -> None:
        self.placement = placement
        self._ray = ray = import_ray()
        if not ray.is_initialized():
            # Ray's defaults otherwise: no dashboard (a web server nobody asked for).
            ray.init(address=placement.address, include_dashboard=False, log_to_driver=True)
        elif placement.address not in (None, "auto"):
            joined = getattr(ray.get_runtime_context(), "gcs_address", None)
            if joined != placement.address:
                # One Ray connection per process: the one made first is the one used.
                logger.warning(
                    "RayPlacement(address=%r) not used: this process already joined the Ray "
                    "cluster at %s",
                    placement.address,
                    joined,
                )
        #: The address engines connect back to (this node's, unless given).
        self.node_ip = placement.node_ip or ray.util.get_node_ip_address()
        from corewire.engine.ray_actor import EngineActor

        self._actor_class = ray.remote(EngineActor)
        #: Each placement group reserved, with the engine indices still placed in it.
        self._groups: list[tuple[Any, set[int]]] = []
        self._groups_lock = threading.Lock()  # start() may run off the client's thread
        self._closed = False

    def start(
        self,
        options_of: Mapping[int, dict[str, Any]],
        timeout: float,
        *,
        join: bool = False,
        cancel: threading.Event | None = None,
    ) -> list[RayEngineHandle]:
        """Reserve one bundle per engine in a new placement group, start the engines of
        ``options_of`` (index -> options of :meth:`EngineActor.serve`, or of
        :meth:`EngineActor.join` with ``join``: engines that join a vLLM API server) in
        index order, and return their handles once each reported where it runs.

        Raises ``TimeoutError`` when the cluster cannot place every bundle within
        ``placement.placement_timeout`` seconds, or an actor does not start within
        ``timeout``, and ``RuntimeError`` once ``cancel`` is set or the client closed
        while the cluster was still placing; nothing is left reserved then."""
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group

        indices = sorted(options_of)
        bundle = {k: float(v) for k, v in self.placement.bundle.items()}
        group = placement_group([dict(bundle) for _ in indices], strategy=self.placement.strategy)
        actors: list[Any] = []
        try:
            self._wait_placed(group, len(indices), bundle, cancel)
            actors = self._create_actors(group, indices, bundle)
            wheres = ray.get([a.where.remote() for a in actors], timeout=timeout)
            with self._groups_lock:
                if self._closed:  # the client shut down while this start ran (off its thread)
                    raise RuntimeError("the client was shut down while its engines started")
                self._groups.append((group, set(indices)))
        except BaseException:
            # Nothing of a failed start stays reserved or running.
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            raise
        handles = []
        for index, actor, where in zip(indices, actors, wheres, strict=True):
            method = actor.join if join else actor.serve
            serve_ref = method.remote(options_of[index])
            handles.append(RayEngineHandle(ray, actor, serve_ref, index, where))
            logger.info(
                "engine %d: Ray actor pid %s on node %s (%s)",
                index,
                where["pid"],
                where["node_id"][:12],
                where["node_ip"],
            )
        return handles

    def _wait_placed(
        self, group: Any, count: int, bundle: Mapping[str, float], cancel: threading.Event | None
    ) -> None:
        """Wait until ``group`` is placed, looking every quarter second whether the wait
        was given up (a cancelled scale-up, a client shut down meanwhile)."""
        ray = self._ray
        ready = group.ready()
        deadline = time.monotonic() + self.placement.placement_timeout
        while not ray.wait([ready], timeout=_PLACEMENT_POLL_S)[0]:
            if self._closed or (cancel is not None and cancel.is_set()):
                raise RuntimeError("the engines' start was given up while Ray placed them")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"Ray could not place {count} engine bundle(s) {dict(bundle)} with "
                    f"strategy {self.placement.strategy} within "
                    f"{self.placement.placement_timeout:g} s (free in the cluster: "
                    f"{ray.available_resources()})"
                )
        ray.get(ready)  # raises what placing raised

    def _create_actors(
        self, group: Any, indices: Sequence[int], bundle: Mapping[str, float]
    ) -> list[Any]:
        """One engine actor per bundle of ``group``, in ``indices`` order."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = self.placement.runtime_env
        runtime = {"runtime_env": dict(env)} if env is not None else {}
        actors = []
        for position, index in enumerate(indices):
            strategy = PlacementGroupSchedulingStrategy(
                group,
                placement_group_bundle_index=position,
                placement_group_capture_child_tasks=True,
            )
            actors.append(
                self._actor_class.options(
                    name=f"{ACTOR_NAME_PREFIX}-{index}-{os.getpid()}-{id(self):x}",
                    max_concurrency=2,  # serve() runs the loop; where() and stop() answer
                    scheduling_strategy=strategy,
                    **actor_options(bundle),
                    **runtime,
                ).remote()
            )
        return actors

    @property
    def placement_groups(self) -> Sequence[Any]:
        """The placement groups this client holds (one per :meth:`start` whose engines
        are not all released)."""
        with self._groups_lock:
            return tuple(group for group, _ in self._groups)

    def release(self, indices: Sequence[int]) -> None:
        """The engines at ``indices`` have stopped (a scale-down): remove each placement
        group none of whose engines is left."""
        emptied = []
        with self._groups_lock:
            for entry in list(self._groups):
                entry[1].difference_update(indices)
                if not entry[1]:
                    self._groups.remove(entry)
                    emptied.append(entry[0])
        self._remove(emptied)

    def close(self) -> None:
        """Remove the placement groups (their actors, already stopped, end with them);
        the Ray connection stays (it is the process's, not this client's)."""
        with self._groups_lock:
            self._closed = True
            groups, self._groups = [group for group, _ in self._groups], []
        self._remove(groups)

    @staticmethod
    def _remove(groups: Sequence[Any]) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)


class RayBackend:
    """What a DP client with ``data_parallel_backend="ray"`` holds: its
    :class:`RayEngines`, the ``data_parallel_address`` its engines connect to, and the
    CURVE keys it made for them (:meth:`close` releases all of it; idempotent)."""

    def __init__(
        self,
        engines: RayEngines,
        data_parallel_address: str,
        keys_dir: str | None,
        client_keys: list[str] | None,
    ) -> None:
        #: The placement group and actors.
        self.engines = engines
        #: ``tcp://HOST:PORT`` on the front-end's node, where the engines connect.
        self.data_parallel_address = data_parallel_address
        #: The private 0700 directory of the keys this client made (None: loopback).
        self.keys_dir = keys_dir
        #: The engines' CURVE client keys (z85 text, handed to each actor in memory).
        self.client_keys = client_keys
        self._closed = False

    @property
    def server_keys_dir(self) -> str | None:
        """The front-end's side of the keys (its ``curve_keys``), None on loopback."""
        return None if self.keys_dir is None else os.path.join(self.keys_dir, "server")

    @classmethod
    def prepare(
        cls,
        placement: RayPlacement | None,
        data_parallel_address: str | None,
        curve_keys: str | None,
        engine_count: int,
    ) -> RayBackend:
        """Join the cluster, choose the address engines connect to (this node's
        address as Ray sees it, four free ports, unless ``data_parallel_address`` is
        given), and, when it is not loopback, make CURVE keys for this client alone."""
        from corewire.curve import is_loopback_address
        from corewire.ipcdir import make_private_dir
        from corewire.keygen import CurveClientKeys, write_key_layout
        from corewire.ports import unused_port_block

        if curve_keys is not None:
            raise ValueError(
                "with data_parallel_backend='ray' the client makes its engines' CURVE keys "
                "itself (handed to its actors in memory): leave curve_keys unset"
            )
        engines = RayEngines(placement or RayPlacement())
        if data_parallel_address is None:
            host = engines.node_ip
            # An IPv6 address goes in brackets in a ZeroMQ endpoint.
            shown = f"[{host}]" if ":" in host else host
            data_parallel_address = f"tcp://{shown}:{unused_port_block(host)}"
        keys_dir = client_keys = None
        if not is_loopback_address(data_parallel_address):
            keys_dir = make_private_dir("keys")
            write_key_layout(keys_dir, clients=1)
            client_keys = CurveClientKeys.from_dir(os.path.join(keys_dir, "client-0")).to_wire()
        logger.info(
            "Ray backend: %d engine(s) connect to %s%s",
            engine_count,
            data_parallel_address,
            " behind CURVE" if keys_dir else "",
        )
        return cls(engines, data_parallel_address, keys_dir, client_keys)

    def close(self) -> None:
        """Remove the placement groups and the keys (after the engines stopped)."""
        if self._closed:
            return
        self._closed = True
        self.engines.close()
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
