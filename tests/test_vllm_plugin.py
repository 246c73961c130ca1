"""The ``vllm.general_plugins`` entry point: installed with corewire, off unless switched on.

vLLM's own plugin loader runs in a fresh interpreter for each case (the plugin patches a
vLLM class for the whole process).

No wire rule of ``docs/protocol.md`` is checked here (the plugin's wire is that of
corewire's clients: ``test_vllm_wire.py``, ``test_vllm_outputs.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from corewire.vllm import plugin

# Loads the plugins the way vLLM's processes do, then reports which factory AsyncLLM
# would call and how many times the plugin ran.
_PROBE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()  # vLLM calls it more than once per process
from vllm.v1.engine.core_client import EngineCoreClient
factory = EngineCoreClient.make_async_mp_client
print(factory.__module__ + "." + factory.__qualname__)
"""


def _factory_with(switch: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_SWITCH}
    if switch is not None:
        env[plugin.ENV_SWITCH] = switch
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_entry_point_is_registered_with_vllm() -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "corewire.vllm.plugin:register" in names


def test_off_by_default_and_on_with_the_switch() -> None:
    assert _factory_with(None) == "vllm.v1.engine.core_client.EngineCoreClient.make_async_mp_client"
    assert _factory_with("1") == "corewire.vllm.client.make_async_mp_client"


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


@pytest.mark.parametrize("version", ["0.25.1", "0.25.1+cpu", "0.33.0", "0.33.0+cpu"])
def test_plugin_accepts_the_vllm_its_client_is_built_for(version: str) -> None:
    plugin.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.26.0", "0.25.1rc1", "0.33.1", "0.34.0"])
def test_plugin_refuses_another_vllm_by_name(version: str) -> None:
    supported = r"0\.25\.1, 0\.33\.0"
    expected = rf"supports vLLM {supported}, not the installed {version}"
    with pytest.raises(RuntimeError, match=expected):
        plugin.check_vllm_version(version)


def test_each_supported_vllm_has_its_client_classes() -> None:
    """Every release the plugin accepts has its three client classes (chosen as vLLM
    chooses), and the installed vLLM's are the factory's."""
    from corewire.vllm import client

    for version in plugin.PLUGIN_VLLM_VERSIONS:
        classes = client.client_classes(version)
        assert set(classes) == {"plain", "dp", "dplb"}
        assert {cls.release.protocol for cls in classes.values()} == {version}
