"""Lifetimes: a collected client, a killed parent, masses of cancelled calls."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref

import pytest

from client_support import REPLAY, request
from corewire import AsyncMPClient
from corewire.client._resources import TERMINATE_GRACE_S
from leak_support import no_leaks, wait_pid_gone


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
    from corewire import AsyncMPClient
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
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *sys.path])
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


ORPHAN_PARENT = textwrap.dedent(
    """
    import sys, time
    from corewire import AsyncMPClient
    client = AsyncMPClient(engine_main=sys.argv[1])
    print(client.engine_pids[0], client.resources.ipc_dir, flush=True)
    time.sleep(600)
    """
)


def test_next_client_removes_the_ipc_dir_of_a_killed_front_end() -> None:
    with no_leaks():
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *sys.path])
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
