"""The join record of an engine that joined a vLLM front-end (``corewire engine
--join-record PATH``), read back by an engine started again in its place (``--rejoin``).

What a rejoined engine does on the wire is tested where it rejoins: another host's
engine in ``tests/dp/test_engine_loss.py`` and ``scripts/serve``'s stack under vLLM in
``tests/interop/test_vllm_serve.py``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from corewire.engine.handshake import (
    HandshakeError,
    HandshakeMetadata,
    read_join_record,
    write_join_record,
)

META = HandshakeMetadata(
    inputs=["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5002"],
    outputs=["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5003"],
    coordinator_input="tcp://127.0.0.1:5004",
    coordinator_output="tcp://127.0.0.1:5005",
    frontend_stats_publish_address="tcp://127.0.0.1:5006",
)


def test_a_record_reads_back_as_the_handshakes_answer_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "engine-0.join"
    write_join_record(str(path), META)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it names the front-end's endpoints
    assert read_join_record(str(path)) == META
    # Written again (a later handshake), it holds the new answer only.
    single = HandshakeMetadata(inputs=["ipc:///a"], outputs=["ipc:///b"])
    write_join_record(str(path), single)
    assert read_join_record(str(path)) == single


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no join record"),
        (b"not json", "not a join record"),
        (b"[1, 2]", "not a join record"),
        (b'{"inputs": ["tcp://h:1"], "outputs": []}', "as many input as output"),
        (b'{"inputs": ["a"], "outputs": ["b"], "coordinator_input": "c"}', "only one DP"),
    ],
)
def test_a_missing_or_spoilt_record_is_refused(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "engine-0.join"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(HandshakeError, match=message):
        read_join_record(str(path))


def _engine_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corewire.cli", "engine", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_engine_command_checks_its_rejoin_options(tmp_path: Path) -> None:
    done = _engine_cli("--handshake-address", "tcp://127.0.0.1:1", "--rejoin")
    assert done.returncode == 2 and "--rejoin needs --join-record" in done.stderr
    record = str(tmp_path / "engine-0.join")
    done = _engine_cli("--input-address", "ipc:///x", "--output-address", "ipc:///y",
                       "--join-record", record)  # fmt: skip
    assert done.returncode == 2 and "go with --handshake-address" in done.stderr
    # A rejoin whose record is missing fails that engine with a clear log line.
    done = _engine_cli(
        "--handshake-address", "tcp://127.0.0.1:1", "--join-record", record, "--rejoin",
        "--engine", "corewire.engine.synthetic:SyntheticEngine",
    )  # fmt: skip
    assert done.returncode == 1
    assert "could not rejoin" in done.stderr and "no join record" in done.stderr
