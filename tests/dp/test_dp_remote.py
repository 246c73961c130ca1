"""Engines on other hosts: ``data_parallel_address`` + ``corewire engine --connect``.

Loopback TCP stands in for the network where that is enough (plain, and behind CURVE);
two network namespaces joined by a veth pair make a real second host where the machine
allows creating them (root and ``ip netns``), including cutting the link.

Checks ``docs/protocol.md`` §2 (TCP addresses), §8.2 and §10 (CURVE required off loopback).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from client_support import request
from corewire import DPAsyncMPClient, DPLBAsyncMPClient
from corewire.coordinator import TcpEndpoints
from dp_support import LIGHT, collect_finished, run_keygen, start_remote_engine, stop
from paths_support import TESTS_DIR
from port_support import retry_port_conflicts, unused_port_block


def test_endpoints_of_a_data_parallel_address() -> None:
    ep = TcpEndpoints.from_address("tcp://10.0.0.1:5555")
    assert (ep.input, ep.output, ep.coordinator_stats, ep.coordinator_publish) == (
        "tcp://10.0.0.1:5555",
        "tcp://10.0.0.1:5556",
        "tcp://10.0.0.1:5557",
        "tcp://10.0.0.1:5558",
    )
    for bad in ("ipc:///x", "tcp://host", "tcp://:5", "tcp://h:65534", "tcp://h:x"):
        with pytest.raises(ValueError):
            TcpEndpoints.from_address(bad)


def test_non_loopback_address_without_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="corewire keygen"):
        DPLBAsyncMPClient(data_parallel_size=1, data_parallel_address="tcp://10.1.2.3:5555")
    with pytest.raises(ValueError, match="data_parallel_address"):
        DPLBAsyncMPClient(data_parallel_size=2, data_parallel_size_local=1)
    # client_addresses are bound without CURVE: only loopback ones are accepted.
    exposed = {"input_address": "tcp://10.1.2.3:5555", "output_address": "tcp://10.1.2.3:5556"}
    with pytest.raises(ValueError, match="curve_keys"):
        DPAsyncMPClient(data_parallel_size=1, client_addresses=exposed)
    # The load balancer routes over positions in one run of ranks (all, or a node's own
    # in hybrid balancing): any other set would misroute.
    for indices in ([1, 0], [0, 2], []):
        with pytest.raises(ValueError, match="engine_indices"):
            DPLBAsyncMPClient(data_parallel_size=3, engine_indices=indices)


def test_engine_cli_refuses_a_remote_host_without_keys() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "corewire.cli", "engine", "--connect", "tcp://10.1.2.3:5555"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--curve-keys" in result.stderr


@retry_port_conflicts
async def test_remote_engine_joins_over_loopback_tcp() -> None:
    address = f"tcp://127.0.0.1:{unused_port_block()}"
    remote = start_remote_engine(address, index=1, size=2)
    client = None
    try:
        client = DPLBAsyncMPClient(
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address=address,
            engine_args=LIGHT,
            ready_timeout=60,
        )
        assert len(client.engine_pids) == 1  # only engine 0 is this client's process
        ids = [f"r{i}" for i in range(16)]
        for rid in ids:
            await client.add_request_async(request(rid, max_tokens=3))
        done = await collect_finished(client, ids)
        assert Counter(f.engine_index for f in done.values()) == {0: 8, 1: 8}
        states = await client._call_all_engines("dp_state")
        assert [s["data_parallel_size"] for s in states] == [2, 2]
        # The remote engine reports to the coordinator too: both pause after the wave.
        assert all(not s["num_requests"] for s in states)
    finally:
        # The engine first: while its front-end is up it has nothing left to deliver,
        # while without it, it would linger on its unsent outputs before exiting.
        stop(remote)
        if client is not None:
            client.shutdown()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert run_keygen(tmp_path / "keys", 1) == 0
    return tmp_path / "keys"


@retry_port_conflicts
async def test_wrong_curve_key_is_refused_and_the_right_one_accepted(
    keys: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address = f"tcp://127.0.0.1:{unused_port_block()}"
    # A well-formed key pair that knows the server's public key but was never authorized.
    assert run_keygen(tmp_path / "intruder", 1) == 0
    intruder = tmp_path / "intruder/client-0"
    (intruder / "server.key").unlink()
    shutil.copy(keys / "client-0/server.key", intruder / "server.key")
    remote = start_remote_engine(address, index=1, size=2, keys=intruder)
    try:
        # Engine 1 never gets in (engine 0, local, may also miss the deadline on a
        # loaded machine: it is not what this checks).
        with pytest.raises(TimeoutError, match=r"engine\(s\) \[(0, )?1\]"):
            DPLBAsyncMPClient(
                data_parallel_size=2,
                data_parallel_size_local=1,
                data_parallel_address=address,
                curve_keys=str(keys / "server"),
                engine_args=LIGHT,
                ready_timeout=8,
            )
        # It did knock, and was turned away by the handshake (not merely late).
        refusals = [r for r in caplog.records if "not an authorized client key" in r.message]
        assert refusals, "the intruder never reached the front-end"
    finally:
        stop(remote)
    remote = start_remote_engine(address, index=1, size=2, keys=keys / "client-0")
    client = None
    try:
        client = DPLBAsyncMPClient(
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address=address,
            curve_keys=str(keys / "server"),
            engine_args=LIGHT,
            ready_timeout=60,
        )
        await client.add_request_async(request("via-curve", max_tokens=2, rank=1))
        assert (await collect_finished(client, ["via-curve"]))["via-curve"].engine_index == 1
    finally:
        # The engine first: while its front-end is up it has nothing left to deliver,
        # while without it, it would linger on its unsent outputs before exiting.
        stop(remote)
        if client is not None:
            client.shutdown()


# ------------------------------------------------------------------ network namespaces


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"cwprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoHosts:
    """Two fresh network namespaces joined by a veth pair on a private /30."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"cw{tag}a", f"cw{tag}b"
        self.dev_a, self.dev_b = f"cwv{tag}a", f"cwv{tag}b"
        # Private addresses, only ever assigned inside the two namespaces made here.
        octet = os.getpid() % 250 + 1
        self.ip_a, self.ip_b = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self._run("ip", "netns", "add", self.a)
        self._run("ip", "netns", "add", self.b)
        self._run(
            "ip", "link", "add", self.dev_a, "netns", self.a,
            "type", "veth", "peer", "name", self.dev_b, "netns", self.b,
        )  # fmt: skip
        for ns, dev, ip in ((self.a, self.dev_a, self.ip_a), (self.b, self.dev_b, self.ip_b)):
            self._run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            self._run("ip", "-n", ns, "link", "set", dev, "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def _run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    def cut(self) -> None:
        """Take host B's end of the link down."""
        self._run("ip", "-n", self.b, "link", "set", self.dev_b, "down")

    def close(self) -> None:
        """Delete both namespaces (the veth pair goes with them)."""
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def two_hosts() -> Iterator[TwoHosts]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces on this machine: {reason}")
    hosts = TwoHosts()
    try:
        yield hosts
    finally:
        hosts.close()


class FrontEndInNamespace:
    """``dp_support.netns_front_end`` running inside a namespace; line protocol on its
    stdin (commands) and stdout (JSON events)."""

    def __init__(self, netns: str, address: str, keys: Path) -> None:
        env = {
            **os.environ,
            "COREWIRE_LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *sys.path]),
        }
        self.proc = subprocess.Popen(
            [
                "ip", "netns", "exec", netns, sys.executable, "-c",
                "import dp_support, sys; sys.exit(dp_support.netns_front_end())",
                address, str(keys),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def event(self, timeout: float = 120.0) -> dict:
        assert self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"front-end said nothing for {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"front-end exited with {self.proc.wait()}")
        return json.loads(line)

    def command(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        stop(self.proc)  # type: ignore[arg-type]
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@retry_port_conflicts
def test_engine_on_another_host_and_a_cut_link(two_hosts: TwoHosts, keys: Path) -> None:
    address = f"tcp://{two_hosts.ip_a}:{unused_port_block()}"
    remote = start_remote_engine(
        address, index=1, size=2, keys=keys / "client-0", netns=two_hosts.b
    )
    front = FrontEndInNamespace(two_hosts.a, address, keys / "server")
    try:
        serving = front.event()
        assert serving["event"] == "serving", serving
        # Requests went over the veth link to host B's engine and back.
        assert serving["per_engine"] == {"0": 8, "1": 8}
        front.command("cut")
        two_hosts.cut()
        front.command("cut-done")
        noticed = front.event()
        # The health watchdog (interval 0.5 s, timeout 2 s) noticed within its budget and
        # took host B's engine out of routing; the group serves on on host A's.
        assert noticed["event"] == "lost", noticed
        assert noticed["after_s"] < 0.5 + 2.0 + 1.5, noticed
        assert "health check" in noticed["reason"]
        assert noticed["served_after"] == [0, 0, 0, 0], noticed
    finally:
        front.close()
        # Cut off, it could only linger on outputs it can no longer deliver.
        remote.kill()
        stop(remote)
