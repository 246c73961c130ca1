"""A chaos run: a data-parallel group serving a steady stream while its
engines are killed, stopped and replaced, its callers cancelled and its links fed
malformed frames; at the end, what became of every request and what leaked.

Run from a checkout: ``tools/chaos --seconds 600`` (``--engines``, ``--rate``, ``--seed``...);
it is developer tooling, not in the wheel.

A :class:`~corewire.DPLBAsyncMPClient` drives ``--engines`` synthetic engines (or the
reference engine) with its health watchdog on. Callers arrive at ``--rate`` per second,
each sends one request and waits for its end. A front-end task reads the client's
outputs and ends each caller's stream, as a serving front-end does. Meanwhile, on a
schedule drawn from ``--seed`` (a fault every ``--fault-interval`` seconds on average;
the kinds in a shuffled order, every kind once per round), the run injects:

- ``kill``: SIGKILL one serving engine. What follows is ``--engine-loss``'s (below).
- ``stop_hang``: SIGSTOP one serving engine and leave it stopped: the health watchdog
  must find it hung within its timeout (and kill it, where the client serves on).
- ``stop_cont``: SIGSTOP one engine for a third of the health timeout, then SIGCONT:
  the group must live on.
- ``cancel``: cancel up to five waiting callers; each aborts its request, as a
  front-end does when its client hangs up.
- ``rogue_output``: a rogue PUSH socket connects to the client's output endpoint and
  sends three malformed frames: one that is not msgpack, one truncated, and one that
  names a live request sent for it (whose caller must get ``ProtocolError`` and abort it).
- ``bad_input``: three malformed messages into one engine's input: an unknown request
  type, an ADD that is not msgpack, and a truncated ADD naming a caller's request
  (which the engine must finish with ERROR).
- ``rescale``: ``scale_elastic_ep(N - 1)`` then ``scale_elastic_ep(N)`` while
  serving: the last engine is replaced by a fresh one (its requests end ABORT).

An engine lost: ``--engine-loss`` is the client's ``engine_loss`` (one policy, or several
separated by commas, run one after the other with the same seed and compared at the end):

- ``replace`` (the default): the lost engine's requests end with an error, the others run
  on, and a new engine is started for the rank and routed to once ready. Per fault the run
  records the requests that failed (all must have been the lost engine's), the seconds
  until the loss was seen and until the rank served again, and the throughput (tokens of
  completed requests per second) in the 5 s before, from the fault until the rank served
  again, and in the 5 s after. The restart budget is ``--restart-limit`` (a fault every 2 s
  would spend the library's default budget within a minute).
- ``isolate``: as ``replace`` without the new engine (the group shrinks; losing the last
  serving engine fails the group).
- ``fail``: vLLM's behaviour; any engine's death is the group's: every waiter gets
  ``EngineDeadError``.

A group that dies (under ``fail``, or when its last serving engine is lost) is rebuilt as
an operator's supervisor rebuilds a crashed front-end: the run shuts the dead client down
and builds a new one (new coordinator, new engines); callers arriving meanwhile wait.
Replacing an engine of a live group by hand is ``rescale``.

Every request must end within ``--deadline`` seconds, completed or failed with a typed
error; one that does not is counted as hung. So is a fault whose effect does not come
(a death not seen, a scaling step that does not return). Leaks are measured in this
process before (after a warm-up group) and after the run: file descriptors, threads,
child processes (live or unreaped), private ``ipc://`` directories, and resident memory.
The exit status is 1 when anything hung or leaked (or memory grew past
``--max-growth-mb``), else 0; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

from corewire.bench import common
from corewire.client.engine_loss import POLICIES
from corewire.errors import EngineDeadError, ProtocolError
from corewire.protocol import REQUEST_ADD, EngineCoreRequest, FinishReason, SamplingParams
from corewire_devtools.chaos_losses import (
    LossRecord,
    Timeline,
    describe,
    print_comparison,
    summarize,
)
from corewire_devtools.leaks import Leaks, leaked, snapshot, warm_up_pyzmq_zero_copy

__all__ = ["FAULTS", "add_arguments", "run"]

logger = logging.getLogger(__name__)

#: Every kind of fault the run injects (each once per round, in a shuffled order).
FAULTS = ("kill", "stop_hang", "stop_cont", "cancel", "rogue_output", "bad_input", "rescale")

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
#: How long a client may take to start or to shut down, and a scaling step to return.
OPERATION_DEADLINE_S = 120.0
#: Seconds the run waits for what it counted on, past the health timeout (load).
SLACK_S = 10.0


@dataclass
class Figures:
    """What the run counts; printed at the end and written by ``--json``."""

    #: The client's ``engine_loss`` in this run.
    engine_loss: str = "replace"
    sent: int = 0
    #: Finished with LENGTH or STOP.
    completed: int = 0
    #: Finished with ABORT: requests on an engine that scale-down removed.
    aborted: int = 0
    #: Finished with ERROR by an engine: the malformed ADDs of ``bad_input``.
    refused: int = 0
    #: Callers cancelled by ``cancel`` (their requests aborted).
    cancelled: int = 0
    #: Finished with ERROR because their engine was lost (``isolate``, ``replace``).
    lost: int = 0
    #: Of those, requests of a rank no fault had struck (must be 0).
    lost_unattributed: int = 0
    #: Exceptions callers got, by type.
    failed: Counter[str] = field(default_factory=Counter)
    #: Requests not ended within the deadline (must be 0).
    hung: int = 0
    #: Faults whose effect never came, or operations that did not return (must be empty).
    hung_operations: list[str] = field(default_factory=list)
    #: Operations that failed though the group was alive (must be empty).
    errors: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    rounds: int = 0
    #: Frames of ``rogue_output`` (into the clients' output sockets) and of ``bad_input``
    #: (into engines' inputs), and the clients' count of bad frames (``protocol_errors``).
    rogue_output_frames: int = 0
    bad_input_frames: int = 0
    protocol_errors: int = 0
    groups_started: int = 0
    deaths: int = 0
    unexpected_deaths: int = 0
    restart_seconds: list[float] = field(default_factory=list)
    #: Each engine lost on purpose (``kill``, ``stop_hang``) and what it cost.
    losses: list[LossRecord] = field(default_factory=list)
    #: Engines the clients replaced, and ranks they gave up (restart budget spent).
    replacements: int = 0
    ranks_given_up: int = 0
    #: Tokens of completed requests by time (for the losses' throughput; not written).
    timeline: Timeline = field(default_factory=Timeline, repr=False)
    leaks: dict[str, Any] = field(default_factory=dict)
    #: Requests the last client still counted in flight once every caller had ended.
    in_flight_left: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain JSON values (``asdict`` would rebuild the Counters from
        their items, counting the pairs)."""
        document = asdict(self)
        del document["timeline"]
        document["failed"] = dict(self.failed)
        document["loss_summary"] = summarize(self.losses)
        document["faults"] = {kind: self.faults[kind] for kind in FAULTS}
        return document

    def failed_total(self) -> int:
        """Callers that got a typed error."""
        return sum(self.failed.values())


class Serving:
    """One client's life: the client, its callers' streams, its front-end task."""

    def __init__(self, client: Any) -> None:
        self.client = client
        #: request id -> the future the front-end task resolves with the outcome's name.
        self.streams: dict[str, asyncio.Future[str]] = {}
        #: request id -> its caller's task.
        self.callers: dict[str, asyncio.Task[None]] = {}
        self.dead = asyncio.Event()
        #: Set by the fault that is meant to kill the group, before it strikes.
        self.death_expected = False
        #: The loss that is to take the whole group (its record counts the callers failed).
        self.death_record: LossRecord | None = None
        #: Rank -> the loss of it under way (its record counts the requests it ended).
        self.open_losses: dict[int, LossRecord] = {}
        #: Request id -> the rank it was routed to.
        self.sent_rank: dict[str, int] = {}
        #: Requests an engine is meant to refuse (``bad_input``): their ERROR is no loss.
        self.refusals: set[str] = set()
        self.front_end: asyncio.Task[None] | None = None


def _outcome(reason: FinishReason) -> str:
    if reason == FinishReason.ABORT:
        return "aborted"
    if reason == FinishReason.ERROR:
        return "refused"
    return "completed"


def _lost(serving: Serving, figures: Figures, rid: str, rank: int) -> str:
    """Count a request its lost engine ended against that loss."""
    record = serving.open_losses.get(rank)
    if record is None:
        figures.lost_unattributed += 1
        logger.error("request %s ended with an error from rank %d: no fault struck it", rid, rank)
    else:
        record.failed += 1
        if serving.sent_rank.get(rid, rank) != rank:
            record.failed_elsewhere += 1
    return "lost"


def _settle(future: asyncio.Future[str] | None, outcome: str) -> None:
    if future is not None and not future.done():
        future.set_result(outcome)


async def front_end(serving: Serving, figures: Figures) -> None:
    """Read the client's outputs and end each caller's stream (a serving front-end's
    output handler): finished -> its finish reason; a bad frame naming requests ->
    ``ProtocolError`` for them (and an abort); the group dead -> ``EngineDeadError``."""
    client = serving.client
    streams = serving.streams
    try:
        while True:
            try:
                outputs = await client.get_output_async()
            except ProtocolError as exc:
                ids = list(getattr(exc, "request_ids", ()) or ())
                for rid in ids:
                    _settle(streams.get(rid), "ProtocolError")
                if ids:
                    with contextlib.suppress(EngineDeadError):
                        await client.abort_requests_async(ids)
                continue
            for out in outputs.outputs:
                if out.finish_reason is None:
                    continue
                outcome = _outcome(out.finish_reason)
                if outcome == "refused" and out.request_id not in serving.refusals:
                    outcome = _lost(serving, figures, out.request_id, outputs.engine_index)
                _settle(streams.get(out.request_id), outcome)
    except EngineDeadError:
        failure = "EngineDeadError"
    except Exception as exc:  # anything else is a bug of the client: counted, never hidden
        logger.exception("the front-end task failed")
        failure = f"front-end {type(exc).__name__}"
    for future in list(streams.values()):
        _settle(future, failure)
    serving.dead.set()


async def caller(
    serving: Serving, rid: str, request: EngineCoreRequest | None, deadline: float, figures: Figures
) -> None:
    """One caller: send ``request`` (None: it is sent by someone else) and wait for its
    end; whatever happens is counted once."""
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    serving.streams[rid] = future
    client = serving.client
    try:
        if request is not None:
            await client.add_request_async(request)
            position = client.reqs_in_flight.get(rid)
            if position is not None:
                serving.sent_rank[rid] = client.engine_indices[position]
        outcome = await asyncio.wait_for(future, deadline)
    except asyncio.CancelledError:
        figures.cancelled += 1
        # The caller hung up: a front-end aborts its request (the group may be dead).
        with contextlib.suppress(EngineDeadError):
            await client.abort_requests_async([rid])
        return
    except asyncio.TimeoutError:
        figures.hung += 1
        logger.error("request %s did not end within %g s", rid, deadline)
        return
    except (EngineDeadError, ProtocolError) as exc:
        outcome = type(exc).__name__
    finally:
        serving.streams.pop(rid, None)
        rank = serving.sent_rank.pop(rid, None)
    record = serving.death_record
    if outcome == "EngineDeadError" and record is not None:
        record.failed += 1
        if rank is not None and rank != record.rank:
            record.failed_elsewhere += 1
    if outcome == "completed":
        figures.completed += 1
        if request is not None:
            figures.timeline.add(request.sampling_params.max_tokens or 0)
    elif outcome == "lost":
        figures.lost += 1
    elif outcome == "aborted":
        figures.aborted += 1
    elif outcome == "refused":
        figures.refused += 1
    else:
        figures.failed[outcome] += 1


def make_request(rid: str, rng: random.Random) -> EngineCoreRequest:
    """A short generation request (1..64 tokens)."""
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[rng.randrange(4, 1000) for _ in range(rng.randint(1, 16))],
        sampling_params=SamplingParams(
            max_tokens=rng.randint(1, 64), ignore_eos=True, temperature=0.0
        ),
        arrival_time=time.time(),
    )


def long_request(rid: str) -> EngineCoreRequest:
    """A request that outlives any fault (its caller ends it: it is aborted on the
    ProtocolError a rogue frame naming it brings)."""
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0),
        arrival_time=time.time(),
    )


class Chaos:
    """The run: a supervisor that keeps a group serving, a stream of callers, and the
    fault schedule (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, figures: Figures) -> None:
        self.args = args
        self.figures = figures
        self.rng = random.Random(args.seed)  # the fault schedule
        self.request_rng = random.Random(args.seed + 1)  # request shapes
        self.serving: Serving | None = None
        self.live = asyncio.Event()  # a group is serving
        self.stop = asyncio.Event()  # the run's time is over: stop sending
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="corewire-chaos-ops")
        self.zmq_ctx: zmq.Context[Any] = zmq.Context()
        self.next_id = 0
        self.supervisor: asyncio.Future[None] | None = None
        #: The tasks that watch a lost rank until it serves again.
        self.watchers: set[asyncio.Task[None]] = set()

    # -- the group's life ----------------------------------------------------------------

    def _build_client(self) -> Any:
        from corewire import DPLBAsyncMPClient

        args = self.args
        if args.engine == "synthetic":
            engine: str | None = SYNTHETIC
            engine_args: dict[str, Any] = {"step_delay": args.step_delay, "max_batch": 256}
        else:
            engine, engine_args = None, {"num_threads": 1, "device": "cpu"}
        return DPLBAsyncMPClient(
            data_parallel_size=args.engines,
            engine=engine,
            engine_args=engine_args,
            health_check_interval=args.health_interval,
            health_check_timeout=args.health_timeout,
            ready_timeout=OPERATION_DEADLINE_S,
            engine_loss=self.figures.engine_loss,
            engine_restart_limit=args.restart_limit,
        )

    async def _in_thread(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the run's own thread (starting or stopping a group blocks), within
        :data:`OPERATION_DEADLINE_S`; one that does not return is a hung operation."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self.executor, fn), OPERATION_DEADLINE_S
            )
        except asyncio.TimeoutError:
            self.figures.hung_operations.append(f"{what} did not return")
            raise

    async def start_group(self) -> Serving:
        """A new client and its engines, with its front-end task."""
        serving = Serving(await self._in_thread("starting a group", self._build_client))
        self.figures.groups_started += 1
        serving.front_end = asyncio.get_running_loop().create_task(
            front_end(serving, self.figures), name="corewire-chaos-front-end"
        )
        return serving

    async def stop_group(self, serving: Serving) -> None:
        """Shut the client down; wait for its front-end task and callers to end."""
        client = serving.client
        self.figures.protocol_errors += client.protocol_errors
        self.figures.replacements += client.engines_replaced
        self.figures.ranks_given_up += len(client.ranks_given_up)
        await self._in_thread("shutting a group down", client.shutdown)
        if serving.front_end is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(serving.front_end, SLACK_S)
            if not serving.front_end.done():
                self.figures.hung_operations.append("a front-end task outlived shutdown")
                serving.front_end.cancel()
        serving.client = None

    async def supervise(self) -> None:
        """Keep a group serving until the run's time is over; rebuild it after a death."""
        died_at: float | None = None
        while not self.stop.is_set():
            serving = await self.start_group()
            if died_at is not None:
                self.figures.restart_seconds.append(time.monotonic() - died_at)
            self.serving = serving
            self.live.set()
            dead = asyncio.ensure_future(serving.dead.wait())
            stop = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait((dead, stop), return_when=asyncio.FIRST_COMPLETED)
            dead.cancel()
            stop.cancel()
            if not serving.dead.is_set():
                return  # the run is over; run() ends the last group
            died_at = time.monotonic()
            self.live.clear()
            self.figures.deaths += 1
            if not serving.death_expected:
                self.figures.unexpected_deaths += 1
                logger.warning("the group died without a fault meant to kill it")
            await self._drain(serving)
            await self.stop_group(serving)

    async def _drain(self, serving: Serving) -> None:
        """Wait for the callers of ``serving`` to end (each within its deadline)."""
        if serving.callers:
            await asyncio.wait(list(serving.callers.values()))

    # -- traffic -------------------------------------------------------------------------

    def _spawn(self, serving: Serving, rid: str, request: EngineCoreRequest | None) -> None:
        task = asyncio.get_running_loop().create_task(
            caller(serving, rid, request, self.args.deadline, self.figures)
        )
        serving.callers[rid] = task
        task.add_done_callback(lambda _t: serving.callers.pop(rid, None))

    def _new_id(self) -> str:
        self.next_id += 1
        return f"chaos-{self.next_id}"

    async def produce(self) -> None:
        """Callers at ``--rate`` per second (Poisson arrivals) while a group serves."""
        rate = self.args.rate
        rng = self.request_rng
        while not self.stop.is_set():
            await asyncio.sleep(rng.expovariate(rate))
            if not self.live.is_set():
                await self.live.wait()
            serving = self.serving
            if serving is None or serving.dead.is_set() or self.stop.is_set():
                continue
            rid = self._new_id()
            self.figures.sent += 1
            self._spawn(serving, rid, make_request(rid, rng))

    # -- faults --------------------------------------------------------------------------

    async def inject_faults(self) -> None:
        """Faults on the seeded schedule until the time is over and a round is complete."""
        rng = self.rng
        start = time.monotonic()
        kinds: list[str] = []
        while True:
            if not kinds:
                if time.monotonic() - start >= self.args.seconds:
                    return
                kinds = list(FAULTS)
                rng.shuffle(kinds)
            await asyncio.sleep(rng.expovariate(1 / self.args.fault_interval))
            serving = await self._live_group()
            kind = kinds.pop()
            try:
                await getattr(self, f"_fault_{kind}")(serving)
            except EngineDeadError:
                if not serving.dead.is_set():
                    # Not the fault's own doing: the group died under it, seen late.
                    await self._await_death(serving, SLACK_S, f"{kind} saw the group dead")
            except Exception as exc:
                logger.exception("fault %s failed", kind)
                self.figures.errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:500])
            self.figures.faults[kind] += 1
            if not kinds:
                self.figures.rounds += 1

    async def _live_group(self) -> Serving:
        """The group serving now (waits for one: a restart may be under way)."""
        while True:
            supervisor = self.supervisor
            if supervisor is not None and supervisor.done():
                supervisor.result()  # raises what stopped it
                raise RuntimeError("the supervisor ended before the run")
            serving = self.serving
            if self.live.is_set() and serving is not None and not serving.dead.is_set():
                return serving
            await asyncio.sleep(0.05)

    def _target(self, serving: Serving) -> tuple[int, int] | None:
        """A serving engine's rank and process id, drawn from the schedule's generator;
        None when no serving engine has a process (all being replaced)."""
        client = serving.client
        # A copy: the engine monitor's thread removes a lost engine's entry meanwhile.
        procs = dict(client.resources.processes.engines)
        ranks = sorted(r for r in client.serving_engines if r in procs and procs[r].pid is not None)
        if not ranks:
            return None
        rank = self.rng.choice(ranks)
        return rank, procs[rank].pid

    async def _await_death(self, serving: Serving, within: float, what: str) -> None:
        try:
            await asyncio.wait_for(serving.dead.wait(), within)
        except asyncio.TimeoutError:
            self.figures.hung_operations.append(f"{what}: the group did not die in {within:g} s")

    async def _await_loss(self, serving: Serving, rank: int, within: float, what: str) -> bool:
        """Wait until the client took ``rank`` out of routing or died; False (a hung
        operation) when neither came within ``within`` seconds."""
        client = serving.client
        deadline = time.monotonic() + within
        while not serving.dead.is_set() and rank not in client.lost_engines:
            if time.monotonic() > deadline:
                self.figures.hung_operations.append(
                    f"{what}: neither the rank nor the group was lost in {within:g} s"
                )
                return False
            await asyncio.sleep(0.005)
        return True

    async def _lose_engine(self, serving: Serving, kind: str, signum: int, within: float) -> None:
        """Send ``signum`` to a serving engine and wait (``within`` seconds) for the client
        to see it lost; a task then watches the rank until it serves again."""
        target = self._target(serving)
        if target is None:
            return
        rank, pid = target
        client = serving.client
        timeline = self.figures.timeline
        record = LossRecord(kind, rank, fault_at=timeline.now())
        self.figures.losses.append(record)
        serving.open_losses[rank] = record
        if self.figures.engine_loss == "fail" or len(client.serving_engines) <= 1:
            # The group is to die with it (a replacement may be ready first: then not).
            serving.death_expected = True
            serving.death_record = record
        what = f"{'SIGKILL' if signum == signal.SIGKILL else 'SIGSTOP'} of engine {rank}"
        with contextlib.suppress(ProcessLookupError):  # died already: the same end
            os.kill(pid, signum)
        try:
            if await self._await_loss(serving, rank, within, what):
                record.seen_s = timeline.now() - record.fault_at
        finally:
            if signum == signal.SIGSTOP:
                # The watchdog killed it; if it did not, let it go (shutdown kills it).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        record.whole_group = serving.dead.is_set()
        if not record.whole_group and serving.death_record is record:
            # The group lives on without it: this loss is not the one that may end it.
            serving.death_record = None
            serving.death_expected = False
        watcher = asyncio.get_running_loop().create_task(self._watch_rank(serving, record))
        self.watchers.add(watcher)
        watcher.add_done_callback(self.watchers.discard)

    async def _watch_rank(self, serving: Serving, record: LossRecord) -> None:
        """Until ``record``'s rank serves again: its replacement routed to, or (the group
        died) a new group serving; the run's end or the rank given up stop the watch."""
        timeline = self.figures.timeline
        client = serving.client
        if not record.whole_group and self.figures.engine_loss != "replace":
            return  # isolated: it serves no more
        try:
            while not self.stop.is_set():
                if record.whole_group:
                    if self.live.is_set() and self.serving is not serving:
                        break
                elif serving.dead.is_set() or record.rank in client.ranks_given_up:
                    return
                elif record.rank not in client.lost_engines:
                    break
                await asyncio.sleep(0.005)
            else:
                return
            record.serving_again_s = timeline.now() - record.fault_at
        finally:
            # A rank back in routing: requests it ends from now on are no loss of this one.
            if serving.open_losses.get(record.rank) is record and record.serving_again_s:
                del serving.open_losses[record.rank]

    async def _fault_kill(self, serving: Serving) -> None:
        await self._lose_engine(serving, "kill", signal.SIGKILL, SLACK_S)

    async def _fault_stop_hang(self, serving: Serving) -> None:
        args = self.args
        within = args.health_interval + 2 * args.health_timeout + SLACK_S
        await self._lose_engine(serving, "stop_hang", signal.SIGSTOP, within)

    async def _fault_stop_cont(self, serving: Serving) -> None:
        target = self._target(serving)
        if target is None:
            return
        _rank, pid = target
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.args.health_timeout / 3)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    async def _some_callers(self, serving: Serving, count: int) -> list[str]:
        """Up to ``count`` request ids of callers waiting on ``serving`` (waits a little
        for one to arrive)."""
        deadline = time.monotonic() + SLACK_S
        while not serving.streams and time.monotonic() < deadline and not serving.dead.is_set():
            await asyncio.sleep(0.01)
        ids = sorted(serving.streams)
        return self.rng.sample(ids, min(count, len(ids)))

    async def _fault_cancel(self, serving: Serving) -> None:
        for rid in await self._some_callers(serving, self.rng.randint(1, 5)):
            task = serving.callers.get(rid)
            if task is not None:
                task.cancel()

    async def _fault_rogue_output(self, serving: Serving) -> None:
        # The frame names a request of its own, long enough to be live when the frame
        # comes: a caller picked from the traffic may finish first on a busy machine,
        # and then nobody is left to see the ProtocolError.
        rid = self._new_id()
        self.figures.sent += 1
        self._spawn(serving, rid, None)
        await asyncio.sleep(0)  # the caller's stream exists before its request is sent
        await serving.client.add_request_async(long_request(rid))
        frames = [
            b"\xc1\xc1 not msgpack at all",
            msgspec.msgpack.encode([0, [["chaos-nobody", [1, 2, 3]]]])[:-3],
            # A live request with an array whose aux frame does not exist.
            msgspec.msgpack.encode(
                [0, [[rid, [1], None, None, ["float32", [4], 5]]], None, 0.0, None, None]
            ),
        ]
        rogue = self.zmq_ctx.socket(zmq.PUSH)
        try:
            rogue.connect(serving.client.output_address)
            for frame in frames:
                rogue.send(frame)
        finally:
            rogue.close(linger=2000)
        self.figures.rogue_output_frames += len(frames)

    async def _fault_bad_input(self, serving: Serving) -> None:
        client = serving.client
        engine = self.rng.choice(client._live_engines())
        rid = self._new_id()
        truncated = bytes(client.encoder.encode(make_request(rid, self.request_rng))[0])[:-3]
        # The engine must finish this one with ERROR: a caller waits for it.
        self.figures.sent += 1
        serving.refusals.add(rid)
        self._spawn(serving, rid, None)
        messages = [
            (b"\xee", [b"an unknown request type"]),
            (REQUEST_ADD, [b"\xc1 not msgpack"]),
            (REQUEST_ADD, [truncated]),
        ]
        try:
            for request_type, frames in messages:
                client._send_message(engine, request_type, frames, None)
        except EngineDeadError:
            return  # the group died meanwhile; its callers were failed
        self.figures.bad_input_frames += len(messages)

    async def _fault_rescale(self, serving: Serving) -> None:
        client = serving.client
        size = len(client.core_engines)
        if size < 2:
            return
        for new_size in (size - 1, size):
            try:
                await asyncio.wait_for(client.scale_elastic_ep(new_size), OPERATION_DEADLINE_S)
            except asyncio.TimeoutError:
                self.figures.hung_operations.append(f"scale_elastic_ep({new_size}) hung")
                return

    # -- the run -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve with faults; then end every caller and the last group."""
        self.supervisor = supervisor = asyncio.ensure_future(self.supervise())
        producer = asyncio.ensure_future(self.produce())
        try:
            await self.inject_faults()
            await self._settle_watchers()
        finally:
            self.stop.set()
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            await supervisor
            for watcher in list(self.watchers):
                watcher.cancel()
            if self.watchers:
                await asyncio.wait(list(self.watchers))
            serving = self.serving
            if serving is not None and serving.client is not None:
                await self._drain(serving)
                await self._count_in_flight(serving)
                await self.stop_group(serving)
            self.executor.shutdown(wait=True)
            self.zmq_ctx.term()

    async def _settle_watchers(self) -> None:
        """Let the last losses' ranks serve again before the run ends (traffic goes on),
        so that every loss has its figures; one not back in time is a hung operation."""
        if not self.watchers:
            return
        _done, pending = await asyncio.wait(list(self.watchers), timeout=OPERATION_DEADLINE_S)
        if pending:
            self.figures.hung_operations.append(
                f"{len(pending)} lost rank(s) did not serve again in {OPERATION_DEADLINE_S:g} s"
            )

    async def _count_in_flight(self, serving: Serving) -> None:
        """Requests the client still counts in flight after every caller ended: aborts
        and finishes must clear them (a few ms for the last ones to be reported)."""
        client = serving.client
        if serving.dead.is_set():
            return
        deadline = time.monotonic() + SLACK_S
        while client.reqs_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.figures.in_flight_left = len(client.reqs_in_flight)


async def _warm_up(args: argparse.Namespace, policy: str) -> None:
    """One short group without faults: what a first group loads for good (modules,
    pyzmq's helpers) is loaded before the leak baseline."""
    chaos = Chaos(args, Figures(engine_loss=policy))
    supervisor = asyncio.ensure_future(chaos.supervise())
    await chaos.live.wait()
    serving = chaos.serving
    assert serving is not None
    for i in range(8):
        chaos._spawn(serving, f"warm-{i}", make_request(f"warm-{i}", chaos.request_rng))
    await chaos._drain(serving)
    await chaos._fault_rescale(serving)
    chaos.stop.set()
    await supervisor
    await chaos.stop_group(serving)
    chaos.executor.shutdown(wait=True)
    chaos.zmq_ctx.term()


def _settle_leaks(before: Any, grace: float) -> Leaks:
    """What is still held ``grace`` seconds after the run, at most (things end late)."""
    deadline = time.monotonic() + grace
    while True:
        gc.collect()
        found = leaked(before, snapshot())
        if not found.any_held() or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def report(args: argparse.Namespace, figures: Figures, leaks: Leaks, seconds: float) -> bool:
    """Print the figures; return whether the run passed (nothing hung or leaked)."""
    f = figures
    faults = ", ".join(f"{k} {f.faults[k]}" for k in FAULTS)
    print(f"engine_loss={f.engine_loss}; faults injected: {faults} ({f.rounds} rounds)")
    restarts = f.restart_seconds
    mean = sum(restarts) / len(restarts) if restarts else 0.0
    print(
        f"groups: {f.groups_started} started, {f.deaths} died ({f.unexpected_deaths} "
        f"without a fault meant to kill), {len(restarts)} restarted (mean {mean:.2f} s, "
        f"max {max(restarts, default=0.0):.2f} s)"
    )
    print(
        f"malformed frames: {f.rogue_output_frames} into the clients' outputs "
        f"({f.protocol_errors} counted there as protocol errors), {f.bad_input_frames} into "
        "engines' inputs"
    )
    for line in describe(summarize(f.losses)):
        print(line)
    print(
        f"  engines replaced: {f.replacements}; ranks given up: {f.ranks_given_up}; "
        f"requests ended with an error from a rank no fault struck: {f.lost_unattributed}"
    )
    failed = ", ".join(f"{k} {v}" for k, v in sorted(f.failed.items())) or "none"
    ended = f.completed + f.aborted + f.refused + f.cancelled + f.lost + f.failed_total() + f.hung
    print(
        f"requests: {f.sent} sent in {seconds:.0f} s, {f.completed} completed, "
        f"{f.aborted} aborted by scale-down, {f.refused} refused by an engine (ERROR), "
        f"{f.cancelled} cancelled, {f.lost} ended by their engine's loss (ERROR), "
        f"{f.failed_total()} failed with a typed error ({failed})"
    )
    print(
        f"hung: {f.hung} (deadline {args.deadline:g} s); hung operations: {len(f.hung_operations)}"
    )
    for what in f.hung_operations:
        print(f"  hung: {what}")
    for what in f.errors:
        print(f"  failed: {what}")
    growth_mb = leaks.memory_growth / 2**20
    print(
        f"leaked: {len(leaks.fds)} fds, {len(leaks.threads)} threads, "
        f"{len(leaks.processes)} processes, {len(leaks.zombies)} unreaped, "
        f"{len(leaks.ipc_dirs)} ipc dirs, {f.in_flight_left} requests left in flight, "
        f"memory {growth_mb:+.1f} MB (limit {args.max_growth_mb:g} MB)"
    )
    if leaks.any_held():
        print(
            f"  fds {leaks.fds}, threads {leaks.threads}, processes {leaks.processes}, "
            f"unreaped {leaks.zombies}, ipc dirs {leaks.ipc_dirs}"
        )
    unaccounted = f.sent - ended
    if unaccounted:
        print(f"requests unaccounted for: {unaccounted}")
    ok = (
        not f.hung
        and not f.hung_operations
        and not f.errors
        and not leaks.any_held()
        and not f.in_flight_left
        and not unaccounted
        and not f.lost_unattributed
        # Only a lost engine's requests fail, unless the group died with it.
        and not any(r.failed_elsewhere for r in f.losses if not r.whole_group)
        and growth_mb <= args.max_growth_mb
    )
    print(f"result: {'PASS' if ok else 'FAIL'}")
    return ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the chaos run's flags."""
    parser.add_argument("--seconds", type=float, default=60.0, help="serving time (default 60)")
    parser.add_argument("--engines", type=int, default=3, help="DP engines (default 3)")
    parser.add_argument(
        "--engine",
        choices=("synthetic", "reference"),
        default="synthetic",
        help="engine to run (default synthetic: no model, no torch)",
    )
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument(
        "--fault-interval", type=float, default=2.0, help="mean seconds between faults"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument(
        "--engine-loss",
        default=POLICIES[0],
        help="the client's engine_loss: replace (default), isolate or fail; several, "
        "comma-separated, run one after the other and are compared",
    )
    parser.add_argument(
        "--restart-limit",
        type=int,
        default=1000,
        help="replacements of one rank allowed in 300 s (default 1000: the run's faults "
        "would spend the library's default of 3 in a minute)",
    )
    parser.add_argument(
        "--deadline", type=float, default=30.0, help="seconds a request may take to end"
    )
    parser.add_argument("--health-interval", type=float, default=0.5)
    parser.add_argument("--health-timeout", type=float, default=2.0)
    parser.add_argument(
        "--step-delay", type=float, default=0.005, help="synthetic engine seconds per step"
    )
    parser.add_argument(
        "--max-growth-mb", type=float, default=64.0, help="resident memory growth allowed"
    )
    parser.add_argument("--json", metavar="FILE", default=None, help="write the figures as JSON")


def policies(value: str) -> list[str]:
    """The ``--engine-loss`` policies, in order; ``SystemExit`` naming the choices for
    anything else."""
    chosen = [p.strip().lower() for p in value.split(",") if p.strip()]
    if not chosen or any(p not in POLICIES for p in chosen):
        choices = ", ".join(POLICIES)
        raise SystemExit(f"--engine-loss takes {choices} (comma-separated); got {value!r}")
    return chosen


def run(args: argparse.Namespace) -> int:
    """The chaos run, once per ``--engine-loss`` policy; exit status 1 when anything hung
    or leaked in any of them."""
    if args.engines < 1 or args.rate <= 0 or args.fault_interval <= 0:
        raise SystemExit("--engines >= 1, --rate > 0 and --fault-interval > 0 required")
    chosen = policies(args.engine_loss)
    print(
        f"chaos: {args.engines} {args.engine} engines, {args.seconds:g} s per policy "
        f"({', '.join(chosen)}), {args.rate:g} requests/s, a fault every "
        f"{args.fault_interval:g} s on average, seed {args.seed}, health check every "
        f"{args.health_interval:g} s (timeout {args.health_timeout:g} s)"
    )
    warm_up_pyzmq_zero_copy()
    asyncio.run(_warm_up(args, chosen[0]))
    passed, documents, goals, rows = True, [], [], []
    for policy in chosen:
        gc.collect()
        before = snapshot()
        figures = Figures(engine_loss=policy)
        started = time.monotonic()
        asyncio.run(Chaos(args, figures).run())
        seconds = time.monotonic() - started
        leaks = _settle_leaks(before, SLACK_S)
        figures.leaks = asdict(leaks)
        for record in figures.losses:
            record.measure(figures.timeline)
        ok = report(args, figures, leaks, seconds)
        passed = passed and ok
        document = figures.as_dict()
        document["seconds"] = seconds
        document["passed"] = ok
        documents.append(document)
        goals += [
            common.Goal(f"requests hung ({policy})", figures.hung, 0, lower_is_better=True),
            common.Goal(
                f"memory growth, MB ({policy})",
                leaks.memory_growth / 2**20,
                args.max_growth_mb,
                True,
            ),
        ]
        counts = {"sent": figures.sent, "completed": figures.completed}
        counts["groups"] = figures.groups_started
        rows.append((policy, document["loss_summary"], counts))
    if len(rows) > 1:
        print()
        print_comparison(rows)
    if args.json:
        common.write_json(
            args.json,
            "chaos",
            baseline="none",
            options={k: v for k, v in vars(args).items() if not k.startswith("_")},
            cases=documents,
            goals=goals,
        )
        print(f"results written to {args.json}")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m corewire_devtools.chaos [flags]``: parse the flags and run."""
    parser = argparse.ArgumentParser(
        prog="tools/chaos", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
