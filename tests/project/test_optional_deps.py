"""Optional dependencies missing: one clear line naming what to install, in the process
that asked, at once.

Each case runs in a fresh interpreter where the module is blocked the way Python blocks
an import on purpose (``sys.modules[name] = None``), so nothing is uninstalled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from corewire._optional import MissingDependency, import_optional, is_installed, require
from paths_support import TESTS_DIR

TORCH_LINE = "needs torch, which is not installed: pip install 'corewire[torch]'"


def run_without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which ``modules`` cannot be imported."""
    block = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *sys.path])
    return subprocess.run(
        [sys.executable, "-c", block + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )


def test_helper_names_the_install_command() -> None:
    assert is_installed("msgspec") and not is_installed("corewire_no_such_module")
    require("msgspec", "anything")
    with pytest.raises(MissingDependency, match=r"^--x needs corewire_no_such_module, which is "):
        require("corewire_no_such_module.sub", "--x")
    with pytest.raises(ImportError, match=r"pip install corewire_no_such_module$"):
        import_optional("corewire_no_such_module", "--x")


def test_helper_sees_a_blocked_module_and_keeps_other_import_errors() -> None:
    result = run_without(
        ["matplotlib", "vllm"],
        """
        from corewire._optional import MissingDependency, import_optional, is_installed
        assert not is_installed("matplotlib") and not is_installed("matplotlib.pyplot")
        try:
            import_optional("matplotlib.pyplot", "--plot")
        except MissingDependency as exc:
            print(exc)
        # A package that is there but fails on a missing dependency of its own keeps
        # its own error (here: corewire.vllm, which needs vllm).
        try:
            import_optional("corewire.vllm.adapters.client", "the adapter")
        except MissingDependency as exc:
            print(exc.name, exc)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "--plot needs matplotlib, which is not installed: pip install 'corewire[bench]'",
        "vllm corewire.vllm (corewire inside vLLM) needs vllm, which is not installed: "
        "pip install vllm==0.25.1",
    ]


def test_demo_without_torch_is_one_line_at_once() -> None:
    start = time.monotonic()
    result = run_without(
        ["torch"],
        """
        from corewire.cli import main
        sys.exit(main(["demo", "--requests", "4"]))
        """,
    )
    took = time.monotonic() - start
    assert result.returncode == 1
    assert result.stderr == f"corewire demo: the reference engine {TORCH_LINE}\n"
    assert result.stdout == ""
    # An engine process that found out itself would take seconds (spawn, imports).
    assert took < 15


def test_client_with_the_reference_engine_without_torch_fails_in_the_caller() -> None:
    result = run_without(
        ["torch"],
        """
        import multiprocessing
        from corewire import AsyncMPClient, SyncMPClient
        for cls in (AsyncMPClient, SyncMPClient):
            try:
                cls(ready_timeout=60)
            except ImportError as exc:
                print(type(exc).__name__, exc)
        assert not multiprocessing.active_children()
        # Engines that need no torch still run.
        client = SyncMPClient(engine="corewire.engine.synthetic:SyntheticEngine")
        client.shutdown()
        print("synthetic ok")
        """,
    )
    assert result.returncode == 0, result.stderr
    line = f"MissingDependency the reference engine {TORCH_LINE}"
    assert result.stdout.splitlines() == [line, line, "synthetic ok"]
    assert "Traceback" not in result.stderr


def test_vllm_adapters_without_vllm_name_the_version_to_install() -> None:
    result = run_without(
        ["vllm"],
        """
        import corewire, corewire.client  # the core never needs vLLM
        adapters = "corewire.vllm.adapters"
        for name in (f"{adapters}.client", f"{adapters}.dp_client", "corewire.vllm.plugin"):
            try:
                __import__(name)
            except ImportError as exc:
                print(type(exc).__name__, exc)
        """,
    )
    assert result.returncode == 0, result.stderr
    line = (
        "MissingDependency corewire.vllm (corewire inside vLLM) needs vllm, which is not "
        "installed: pip install vllm==0.25.1"
    )
    assert result.stdout.splitlines() == [line] * 3


def test_the_client_and_engines_import_torch_only_for_a_tensor() -> None:
    """Importing corewire, its clients and the synthetic engine, and encoding, leave
    torch unimported (it took 1.7 s of every process start); the first tensor to decode
    imports it and comes out a real ``torch.Tensor``, which its struct field accepts."""
    result = run_without(
        [],
        """
        import sys
        import corewire, corewire.client, corewire.engine.core, corewire.engine.synthetic
        from corewire.codec import RAW_VIEW_EXT, Encoder, MsgspecDecoder
        import msgspec
        from client_support import request
        from corewire.protocol import EngineCoreRequest, Tensor
        print("torch" in sys.modules)
        import numpy as np
        plain = request("t")
        Encoder().encode(plain)
        assert "torch" not in sys.modules
        # A tensor on the wire, [dtype, shape, raw bytes], written by hand so that the
        # decoder is the first to need torch.
        raw = msgspec.msgpack.Ext(RAW_VIEW_EXT, np.arange(6, dtype=np.float32).tobytes())
        embeds = ["float32", [2, 3], raw]
        frames = Encoder().encode(msgspec.structs.replace(plain, prompt_embeds=embeds))
        assert "torch" not in sys.modules
        got = MsgspecDecoder(EngineCoreRequest).decode(frames)
        print(type(got.prompt_embeds).__module__, got.prompt_embeds.tolist())
        print(isinstance(got.prompt_embeds, Tensor), isinstance(np.zeros(1), Tensor))
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "False",
        "torch [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]",
        "True False",
    ]
