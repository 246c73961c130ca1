"""Lifetimes: a collected client, a killed parent, masses of cancelled calls, an engine
stopped with its front-end gone or still reading (docs/protocol.md §7)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from client_support import REPLAY, request
from corewire import AsyncMPClient, DPLBAsyncMPClient, EngineDeadError
from corewire.client._resources import TERMINATE_GRACE_S
from corewire.protocol import FinishReason
from engine_support import LIGHT_REFERENCE, FrontEnd
from leak_support import no_leaks, wait_pid_gone
from paths_support import TESTS_DIR


async def test_client_collected_while_its_task_runs() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY, engine_args={"step_delay": 0.001})
        (pid,) = client.engine_pids
        await client.add_request_async(request("busy", max_tokens=10**6))
        await client.get_output_async()
        task = client.resources.output_task
        assert task is not None and not task.done()
        ref = weakref.ref(client)
        del client
        gc.collect()
        assert ref() is None
        # The finalizer cancelled the task; it ends within a loop iteration or two.
        deadline = time.monotonic() + 5
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert task.done()
        assert wait_pid_gone(pid, 10)


PARENT = textwrap.dedent(
    """
    import sys, time
    from corewire import AsyncMPClient, DPLBAsyncMPClient, EngineDeadError
    kwargs = {"engine_main": sys.argv[1]} if sys.argv[1] else {}
    client = AsyncMPClient(**kwargs)
    print(client.engine_pids[0], flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("engine_main", [REPLAY, ""], ids=["replay", "reference"])
def test_engine_exits_when_its_parent_is_killed(engine_main: str) -> None:
    with no_leaks():
        env = dict(os.environ)
        # The engine child needs client_support (tests/) importable, as here.
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *sys.path])
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, engine_main], stdout=subprocess.PIPE, env=env
        )
        try:
            assert parent.stdout is not None
            line = parent.stdout.readline()
            assert line, "the parent process failed to start its client"
            engine_pid = int(line)
            parent.kill()
            parent.wait(10)
            assert wait_pid_gone(engine_pid, 15), "orphaned engine still running"
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait(10)
            if parent.stdout is not None:
                parent.stdout.close()


async def test_100k_cancelled_utility_calls_leave_no_registry_entries() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            registry = client.resources.registry
            total, batch = 100_000, 2_000
            for start in range(0, total, batch):
                tasks = [
                    asyncio.ensure_future(client.call_utility_async("echo", i))
                    for i in range(start, start + batch)
                ]
                await asyncio.sleep(0)  # every call registers and sends
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                assert len(registry) == 0
            # The engine answers all 100,000 calls late; the replies match nothing. A
            # call made now is answered after all of them, so they were all processed.
            assert await client.call_utility_async("echo", "last") == "last"
            assert len(registry) == 0
            assert not client.engine_dead
        finally:
            client.shutdown()


@pytest.mark.parametrize("engine_main", [REPLAY, ""], ids=["replay", "reference"])
async def test_shutdown_under_load_is_quick_and_engines_exit_on_sigterm(
    engine_main: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Engines stream at full speed into a client that reads nothing; shutdown() still
    returns at once, every engine leaving on SIGTERM (no kill after the grace period)."""
    with no_leaks():
        kwargs = {"engine_main": engine_main} if engine_main else {}
        client = AsyncMPClient(**kwargs)
        (pid,) = client.engine_pids
        for i in range(64):
            await client.add_request_async(request(f"flood-{i}", max_tokens=10**6))
        await client.get_output_async()
        await asyncio.sleep(1.0)  # a backlog builds up in ZeroMQ's queues
        caplog.set_level("WARNING", logger="corewire.client")
        started = time.monotonic()
        client.shutdown()
        took = time.monotonic() - started
        assert wait_pid_gone(pid, 5)
        assert not [r for r in caplog.records if "killing it" in r.getMessage()]
        # Well inside the grace period (on an idle machine: ~0.5 s; before the fix the
        # engine waited out its 5 s linger and was killed at 4 s).
        assert took < TERMINATE_GRACE_S - 1.5, f"shutdown under load took {took:.2f} s"


async def test_dp_group_engines_and_coordinator_leave_on_sigterm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A DP group's engines and coordinator (each with torch loaded, which takes seconds
    to tear down) end on SIGTERM without the interpreter's teardown, inside the grace:
    none is killed, whether the group is whole or one engine was SIGKILLed (a group
    being replaced after a death). Found by the chaos run (``tools/chaos``)."""
    for kill_one in (False, True):
        with no_leaks():
            client = DPLBAsyncMPClient(
                data_parallel_size=2,
                engine="corewire.engine.synthetic:SyntheticEngine",
                engine_loss="fail",  # the whole group dies, and is replaced whole
            )
            pids = [*client.engine_pids, client.coordinator_pid]
            await client.add_request_async(request("one", max_tokens=3))
            while not any(o.finish_reason for o in (await client.get_output_async()).outputs):
                pass
            if kill_one:
                os.kill(pids[0], signal.SIGKILL)
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(client.get_output_async(), 10)
            caplog.clear()
            caplog.set_level("WARNING", logger="corewire.client")
            client.shutdown()
            assert all(wait_pid_gone(pid, 5) for pid in pids)
            assert not [r for r in caplog.records if "killing it" in r.getMessage()]


ORPHAN_PARENT = textwrap.dedent(
    """
    import sys, time
    from corewire import AsyncMPClient, DPLBAsyncMPClient, EngineDeadError
    client = AsyncMPClient(engine_main=sys.argv[1])
    print(client.engine_pids[0], client.resources.ipc_dir, flush=True)
    time.sleep(600)
    """
)


def test_next_client_removes_the_ipc_dir_of_a_killed_front_end() -> None:
    with no_leaks():
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *sys.path])
        parent = subprocess.Popen(
            [sys.executable, "-c", ORPHAN_PARENT, REPLAY], stdout=subprocess.PIPE, env=env
        )
        try:
            assert parent.stdout is not None
            engine_pid, orphan = parent.stdout.readline().split()
            orphan_dir = orphan.decode()
            assert os.path.isdir(orphan_dir) and f"-{parent.pid}-" in orphan_dir
            parent.kill()
            parent.wait(10)
            assert wait_pid_gone(int(engine_pid), 15)
            assert os.path.isdir(orphan_dir)  # SIGKILL: nobody removed it
            client = AsyncMPClient(engine_main=REPLAY)
            try:
                mine = client.resources.ipc_dir
                assert not os.path.exists(orphan_dir)
                assert mine is not None and os.path.isdir(mine)  # a live owner's stays
                # ...even when another front-end sweeps meanwhile.
                from corewire.ipcdir import remove_orphaned_dirs

                assert mine not in remove_orphaned_dirs()
                assert os.path.isdir(mine)
            finally:
                client.shutdown()
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait(10)
            if parent.stdout is not None:
                parent.stdout.close()


def _engine_command(fe: FrontEnd, engine: str, engine_args: dict[str, Any]) -> list[str]:
    return [
        sys.executable, "-m", "corewire.cli", "engine",
        "--input-address", fe.input_address, "--output-address", fe.output_address,
        "--engine", engine, "--engine-args", json.dumps(engine_args),
    ]  # fmt: skip


def test_sigterm_after_the_front_end_left_exits_without_the_linger(tmp_path: Path) -> None:
    """The front-end's output socket closed while the engine generated; SIGTERM then
    ends the engine in well under its 5 s linger (nobody is there to take what is
    queued), status 0, saying why in its log."""
    fe = FrontEnd(tmp_path, "gone")
    log_path = tmp_path / "engine.log"
    args = {**LIGHT_REFERENCE, "step_delay": 0.01}
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            _engine_command(fe, "corewire.engine.reference:ReferenceEngine", args),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        fe.wait_ready()
        for i in range(4):
            fe.add(request(f"r{i}", max_tokens=10**6))
        fe.recv()
        fe.pulls.pop().close(0)  # the front-end goes; the engine generates on into the queue
        time.sleep(0.5)
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == 0
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        fe.close()
    # Generous for a loaded machine; lingering alone would take 5 s.
    assert took < 2.0, f"{took:.2f} s"
    assert "no front-end connected on 1 output link(s)" in log_path.read_text()


def test_sigterm_with_the_front_end_reading_delivers_everything_sent(tmp_path: Path) -> None:
    """Eight 1 MB messages sit in the engine's socket (the front-end takes one message
    at a time: rcvhwm 1) when SIGTERM comes: the engine lingers for the connected
    front-end, which reads every one of them, in order, and the engine exits 0."""
    fe = FrontEnd(tmp_path, "reading", rcvhwm=1)
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    count = 8
    child = subprocess.Popen(
        _engine_command(fe, "engine_support:BigPayloadEngine", {"count": count}),
        stdout=subprocess.DEVNULL,
        env=env,
    )
    try:
        fe.wait_ready()
        fe.add(request("big", max_tokens=count))
        first = fe.recv()
        # The engine steps the rest into its socket meanwhile (ZeroMQ's queue holds 128).
        time.sleep(1.5)
        child.send_signal(signal.SIGTERM)
        got = [first, *(fe.recv(timeout=10) for _ in range(count - 1))]
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        fe.close()
    outputs = [o for msg in got for o in msg.outputs]  # type: ignore[union-attr]
    assert [o.new_token_ids[0] for o in outputs] == [(i + 1) * 1_000_000 for i in range(count)]
    assert [int(o.pooling_output[0]) for o in outputs] == list(range(count))
    assert outputs[-1].finish_reason == FinishReason.LENGTH
