"""The ``vllm.general_plugins`` entry point: installed with corewire, off unless switched on.

vLLM's own plugin loader runs in a fresh interpreter for each case (the plugin patches a
vLLM class for the whole process).

No wire rule of ``docs/protocol.md`` is checked here (the plugin's wire is that of
corewire's clients: ``test_vllm_wire.py``, ``test_vllm_outputs.py``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm

from corewire import releases
from corewire.vllm import plugin
from release_support import FOLLOWED
from vllm_support import factory_after_plugins, factory_kept_by_plugin


def _factory_with(switch: str | None) -> str:
    # vLLM calls its plugin loader more than once per process.
    return factory_after_plugins(switch, loads=2)


def test_entry_point_is_registered_with_vllm() -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "corewire.vllm.plugin:register" in names


def test_off_by_default_and_on_with_the_switch() -> None:
    assert _factory_with(None) == "vllm.v1.engine.core_client.EngineCoreClient.make_async_mp_client"
    assert _factory_with("1") == "corewire.vllm.adapters.classes.make_async_mp_client"


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_switch_on_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    assert plugin.enabled()


@pytest.mark.parametrize("value", ["", "0", "false", "off"])
def test_switch_off_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    assert not plugin.enabled()


def test_unclear_switch_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENV_SWITCH, "corewire")
    with pytest.raises(ValueError, match=plugin.ENV_SWITCH):
        plugin.enabled()


def test_the_plugin_keeps_vllms_own_factory_for_the_servers_it_declines() -> None:
    # Loaded twice, as vLLM does: still vLLM's own, not corewire's.
    assert factory_kept_by_plugin() == (
        "vllm.v1.engine.core_client.EngineCoreClient.make_async_mp_client"
    )


def test_elastic_ep_is_declined_at_start_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's client serves a server with elastic EP (corewire's would fail mid-flight):
    the factory vLLM had is called with exactly vLLM's arguments, and the log says why."""
    from types import SimpleNamespace

    from corewire.vllm.adapters import classes as client_module

    calls: list[tuple[Any, ...]] = []

    def vllm_own(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "vLLM's client"

    monkeypatch.setattr(client_module, "vllm_factory", vllm_own)
    config = SimpleNamespace(parallel_config=SimpleNamespace(enable_elastic_ep=True))
    with caplog.at_level("INFO", logger="vllm.corewire"):
        made = client_module.make_async_mp_client(config, "executor", True, None, 2, 1)
    assert made == "vLLM's client"
    assert calls == [((config, "executor", True, None, 2, 1), {})]
    lines = [r.getMessage() for r in caplog.records if "elastic" in r.getMessage()]
    assert len(lines) == 1 and "vLLM's own engine-core client serves" in lines[0], lines
    assert (
        client_module.declined_reason(
            SimpleNamespace(parallel_config=SimpleNamespace(enable_elastic_ep=False))
        )
        is None
    )
    monkeypatch.setattr(client_module, "vllm_factory", None)
    with pytest.raises(ValueError, match="elastic expert parallelism"):
        client_module.make_async_mp_client(config, "executor", True)


@pytest.mark.parametrize("version", [*FOLLOWED, "0.25.1+cpu", "0.33.0+cpu"])
def test_plugin_accepts_every_release_from_0_25_1_to_0_34_0(version: str) -> None:
    plugin.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.26.1", "0.25.1rc1", "0.33.1", "0.34.0rc1"])
def test_plugin_refuses_another_vllm_by_name(version: str) -> None:
    # A patch or pre-release corewire has no record of may move fields. (A final release
    # newer than every tested one is adopted instead: test_vllm_self_check.)
    supported = ", ".join(re.escape(name) for name in FOLLOWED)
    expected = rf"supports vLLM {supported}, not the installed {re.escape(version)}"
    with pytest.raises(RuntimeError, match=expected):
        plugin.check_vllm_version(version)


def test_each_supported_vllm_has_its_client_classes() -> None:
    """Every release the plugin accepts has its three client classes (chosen as vLLM
    chooses), and the installed vLLM's are the factory's."""
    from corewire import AsyncMPClient, DPAsyncMPClient, DPLBAsyncMPClient
    from corewire.vllm.adapters import classes as classes_module
    from corewire.vllm.adapters.classes import client_classes
    from corewire.vllm.adapters.client import VllmClientMixin

    kinds = {"plain": AsyncMPClient, "dp": DPAsyncMPClient, "dplb": DPLBAsyncMPClient}
    for version in plugin.PLUGIN_VLLM_VERSIONS:
        classes = client_classes(version)
        assert set(classes) == set(kinds)
        for kind, cls in classes.items():
            assert issubclass(cls, kinds[kind]) and issubclass(cls, VllmClientMixin)
            # A class defined by name, where a search finds it.
            assert getattr(classes_module, cls.__name__) is cls, cls


_OUTPUT_PROBE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
import vllm.v1.engine.async_llm as async_llm
import vllm.v1.engine.llm_engine as llm_engine
for cls in (async_llm.OutputProcessor, llm_engine.OutputProcessor):
    print(cls.__module__ + "." + cls.__qualname__)
"""


def _output_processors_with(output: str | None, client: str | None = None) -> list[str]:
    """The output processor classes ``AsyncLLM`` and ``LLMEngine`` would build, in a fresh
    interpreter after vLLM's plugin loader ran twice with the switches as given."""
    import os
    import subprocess
    import sys

    env = {
        k: v for k, v in os.environ.items() if k not in (plugin.ENV_SWITCH, plugin.OUTPUT_SWITCH)
    }
    for name, value in ((plugin.OUTPUT_SWITCH, output), (plugin.ENV_SWITCH, client)):
        if value is not None:
            env[name] = value
    done = subprocess.run(
        [sys.executable, "-c", _OUTPUT_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    if done.returncode != 0:
        return [f"failed: {done.stderr.strip().splitlines()[-1]}"]
    return done.stdout.strip().splitlines()[-2:]


VLLM_PROCESSOR = "vllm.v1.engine.output_processor.OutputProcessor"


# Six interpreters that each import vLLM (about 8 s apiece here, minutes on a loaded
# machine): past the suite's 120 s default.
@pytest.mark.timeout(900)
def test_output_switch_installs_the_native_processor_for_async_llm_only() -> None:
    native = "corewire.vllm.output.processor.NativeOutputProcessor"
    # Nothing switched on: vLLM's everywhere.
    assert _output_processors_with(None) == [VLLM_PROCESSOR, VLLM_PROCESSOR]
    # Unset, it follows the client switch where the installed release's output
    # processing was checked (0.25.1 in the main venv; not 0.26.0-0.32.0); 0 keeps vLLM's.
    checked = releases.for_vllm(vllm.__version__).native_output
    followed = native if checked else VLLM_PROCESSOR
    assert _output_processors_with(None, client="1") == [followed, VLLM_PROCESSOR]
    assert _output_processors_with("0", client="1") == [VLLM_PROCESSOR, VLLM_PROCESSOR]
    if not checked:
        # Asked for where it was not checked against the release: refused by name.
        refused = f"failed: RuntimeError: {plugin.OUTPUT_SWITCH}=1: corewire's output processing"
        assert _output_processors_with("1")[0].startswith(refused)
        return
    # AsyncLLM gets corewire's; vLLM's synchronous LLMEngine keeps its own.
    assert _output_processors_with("1") == [native, VLLM_PROCESSOR]
    assert _output_processors_with("1", client="1") == [native, VLLM_PROCESSOR]


def test_unset_output_switch_follows_the_client_only_where_reproduced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(plugin.OUTPUT_SWITCH, raising=False)
    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    assert plugin.output_wanted("0.25.1+cpu")
    assert plugin.output_wanted("0.33.0")
    assert plugin.output_wanted("0.34.0")
    # Under a release only recorded (not verified) the client alone does not bring it
    # (and nothing is refused).
    assert not plugin.output_wanted("0.32.0")
    monkeypatch.setenv(plugin.ENV_SWITCH, "0")
    assert not plugin.output_wanted("0.25.1")
    monkeypatch.setenv(plugin.OUTPUT_SWITCH, "1")
    assert plugin.output_wanted("0.25.1")


def test_unclear_output_switch_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.OUTPUT_SWITCH, "native")
    with pytest.raises(ValueError, match=plugin.OUTPUT_SWITCH):
        plugin.output_enabled()
    monkeypatch.setenv(plugin.OUTPUT_SWITCH, "0")
    assert not plugin.output_enabled()


@pytest.mark.parametrize("version", ["0.32.0", "0.25.2", "0.26.0"])
def test_output_switch_refuses_a_vllm_it_does_not_reproduce(version: str) -> None:
    plugin.check_output_version("0.25.1+cpu")
    plugin.check_output_version("0.33.0")
    plugin.check_output_version("0.34.0")
    with pytest.raises(
        RuntimeError,
        match=rf"reproduces vLLM 0\.25\.1, 0\.33\.0, 0\.34\.0, not the installed {version}",
    ):
        plugin.check_output_version(version)


def test_output_kept_under_an_unverified_release_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the client switch alone, a release the native path was not verified against
    keeps vLLM's output processing, and one log line (not one per plugin load) says so."""
    monkeypatch.setattr(plugin, "_told_output_kept", False)
    with caplog.at_level("INFO", logger="vllm.corewire"):
        plugin._tell_output_kept("0.32.0")
        plugin._tell_output_kept("0.32.0")
    lines = [r.getMessage() for r in caplog.records if "output processing" in r.getMessage()]
    assert len(lines) == 1
    assert "0.25.1, 0.33.0, 0.34.0, not the installed 0.32.0" in lines[0]
    assert "vLLM's output processing is kept" in lines[0]


def test_serve_stack_sets_exactly_the_switches_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """``scripts/serve``'s stack never passes its own environment's switches on: the API
    server gets the client and output switches as asked (an output of None leaves the
    plugin's default)."""
    from corewire.vllm.serve.stack import ServeStack

    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    monkeypatch.setenv(plugin.OUTPUT_SWITCH, "1")
    cases = {
        ("vllm", None): {},
        ("vllm", "vllm"): {plugin.OUTPUT_SWITCH: "0"},
        ("corewire", None): {plugin.ENV_SWITCH: "1"},
        ("corewire", "vllm"): {plugin.ENV_SWITCH: "1", plugin.OUTPUT_SWITCH: "0"},
        ("corewire", "corewire"): {plugin.ENV_SWITCH: "1", plugin.OUTPUT_SWITCH: "1"},
    }
    for (client, output), expected in cases.items():
        stack = ServeStack(tmp_path, port=0, client=client, output=output)
        env = stack.server_environment()
        got = {k: env[k] for k in (plugin.ENV_SWITCH, plugin.OUTPUT_SWITCH) if k in env}
        assert got == expected, (client, output)
    with pytest.raises(ValueError, match="output must be one of"):
        ServeStack(tmp_path, port=0, output="native")  # type: ignore[arg-type]
