"""SyncMPClient against real engine processes."""

from __future__ import annotations

import gc
import os
import queue
import signal
import threading
import time
import weakref
from typing import Any

import pytest

from client_support import REPLAY, SUPPORT, finished, request
from corewire import EngineDeadError, SyncMPClient, UtilityError
from corewire.protocol import EngineCoreOutputs
from leak_support import no_leaks, wait_pid_gone


def test_streaming_and_utility_calls() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=REPLAY)
        try:
            for i in range(4):
                client.add_request(request(f"s{i}", max_tokens=3))
            tokens: dict[str, list[int]] = {}
            done = 0
            while done < 4:
                outputs = client.get_output(timeout=10)
                for out in outputs.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                done += len(finished(outputs))
            assert tokens == {f"s{i}": [1, 2, 3] for i in range(4)}
            assert client.call_utility("echo", [2**64 - 1]) == [2**64 - 1]
            with pytest.raises(UtilityError, match="Call to nope method failed"):
                client.call_utility("nope")
            assert client.is_sleeping() is False
            client.check_health(timeout=5)
            assert len(client.resources.registry) == 0
        finally:
            client.shutdown()


def test_utility_timeout_forgets_the_call() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=SUPPORT)
        try:
            with pytest.raises(TimeoutError):
                client.call_utility("block", 0.5, timeout=0.05)
            assert len(client.resources.registry) == 0
            assert client.call_utility("echo", "late reply ignored") == "late reply ignored"
            with pytest.raises(queue.Empty):
                client.get_output(timeout=0.01)
        finally:
            client.shutdown()


def test_engine_death_reaches_every_waiter() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=SUPPORT)
        try:
            (pid,) = client.engine_pids
            errors: list[BaseException] = []

            def wait_call() -> None:
                try:
                    client.call_utility("block", 30)
                except BaseException as exc:
                    errors.append(exc)

            caller = threading.Thread(target=wait_call, name="test-caller")
            caller.start()
            time.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            caller.join(2.0)
            assert not caller.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
            assert "died unexpectedly" in str(errors[0])
            for _ in range(2):  # sticky: every caller, not only the first
                with pytest.raises(EngineDeadError):
                    client.get_output(timeout=2)
            with pytest.raises(EngineDeadError):
                client.call_utility("echo", 1)
            with pytest.raises(EngineDeadError):
                client.add_request(request("x"))
        finally:
            start = time.monotonic()
            client.shutdown()
            assert time.monotonic() - start < 5


def test_engine_core_dead_frame() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=SUPPORT)
        try:
            client.call_utility("die")
            with pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
                client.get_output(timeout=5)
        finally:
            client.shutdown()


def test_collected_client_stops_its_thread_and_engine() -> None:
    with no_leaks():
        gc.disable()
        try:
            client = SyncMPClient(engine_main=REPLAY)
            (pid,) = client.engine_pids
            assert client.call_utility("echo", 1) == 1
            ref = weakref.ref(client)
            del client
            assert ref() is None  # no reference cycle
            assert wait_pid_gone(pid, 10)
        finally:
            gc.enable()


class _HookedSyncClient(SyncMPClient):
    """Records what a plain ``process_engine_outputs`` sees (run on the output thread)."""

    def __init__(self, **kwargs: Any) -> None:
        self.seen: list[EngineCoreOutputs] = []
        super().__init__(**kwargs)

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
        self.seen.append(outputs)


def test_same_output_rules_as_the_async_client() -> None:
    # One output link for both clients: the hook sees every message and a notification
    # (call id -1) without a handler is dropped. Unlike the async client (and like vLLM's
    # SyncMPClient), a message with neither outputs nor stats is queued too: a blocking
    # caller may be waiting for the finished_requests that confirm an abort.
    with no_leaks():
        client = _HookedSyncClient(engine_main=SUPPORT)
        try:
            client.call_utility("stats", 7)
            stats = client.get_output(timeout=10).scheduler_stats
            assert stats["num_waiting_reqs"] == 7 and stats["num_running_reqs"] == 0
            client.add_request(request("h", max_tokens=1))
            finished_only = client.get_output(timeout=10)
            assert finished_only.finished_requests == {"gone"} and not finished_only.outputs
            outputs = client.get_output(timeout=10)
            assert [o.request_id for o in outputs.outputs] == ["h"]
            assert [m.finished_requests for m in client.seen[:2]] == [None, {"gone"}]
            client.call_utility("notify", "RECONFIGURE", 3)
            assert client.call_utility("echo", "after") == "after"
            with pytest.raises(queue.Empty):
                client.get_output(timeout=0.2)
        finally:
            client.shutdown()


def test_an_async_hook_is_refused_before_engines_start() -> None:
    class AsyncHooked(SyncMPClient):
        async def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
            pass

    with no_leaks(), pytest.raises(TypeError, match="must not be async"):
        AsyncHooked(engine_main=SUPPORT)
