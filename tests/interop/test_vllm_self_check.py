"""The plugin's self-check against the installed vLLM (``corewire.vllm.self_check``).

Runs with whichever vLLM is installed (0.25.1 here; ``scripts/test`` runs it again under
0.33.0 and 0.34.0): the installed release's own wire passes, each check finds a real
mismatch (another release's layouts, a decoder or writer that gets a field wrong) and
names it, and the plugin keeps vLLM's own client, with one warning line, when the check
fails. Spec: docs/protocol.md §11.1.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from vllm.v1.engine.core_client import EngineCoreClient  # noqa: E402

from corewire import codec, releases  # noqa: E402
from corewire.vllm import plugin, self_check  # noqa: E402
from corewire.wire import requests as wire_requests  # noqa: E402

INSTALLED = releases.for_vllm(vllm.__version__)


def test_the_installed_release_passes() -> None:
    assert self_check.first_difference(INSTALLED) is None


@pytest.mark.parametrize(
    "other", [r for r in ("0.25.1", "0.26.0", "0.33.0", "0.34.0") if r != INSTALLED.name]
)
def test_another_releases_layouts_are_named(other: str) -> None:
    found = self_check.first_difference(releases.get(other))
    # Named as struct.field (the first that differs: an output field, or a ready key).
    assert found is not None and re.search(r"\b[A-Z]\w+\.[a-z_]\w*", found), found


def _with(monkeypatch: pytest.MonkeyPatch, name: str, value: object) -> None:
    # The self check calls the decoder and writer factories by module attribute.
    module = codec if name == "native_decoder" else wire_requests
    monkeypatch.setattr(module, name, value)


class _Outputs:
    """A decoded message with its outputs replaced."""

    def __init__(self, message: object, outputs: list[object]) -> None:
        self.message, self.outputs = message, outputs

    def __getattr__(self, name: str) -> object:
        return getattr(self.message, name)


def test_a_decoder_that_misreads_a_field_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = codec.native_decoder

    class WrongStop:
        """A decoded output whose stop reason reads wrong."""

        def __init__(self, output: object) -> None:
            self.output = output

        def __getattr__(self, name: str) -> object:
            return "wrong" if name == "stop_reason" else getattr(self.output, name)

    class Misreading:
        def __init__(self, decoder: object) -> None:
            self.decoder = decoder

        def decode(self, frames: list[bytes]) -> object:
            decoded = self.decoder.decode(frames)  # type: ignore[attr-defined]
            outputs = [WrongStop(o) for o in decoded.outputs]
            return _Outputs(decoded, outputs)

    _with(monkeypatch, "native_decoder", lambda release: Misreading(real(release)))
    found = self_check.first_difference(INSTALLED)
    assert found is not None and "stop_reason" in found, found


def test_a_writer_that_loses_a_field_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    real = wire_requests.request_writer

    def losing(release: Any) -> object:
        inner = real(release)

        def write(request: object) -> object:
            request = inner(request) if inner is not None else request
            return msgspec.structs.replace(request, arrival_time=2.0)  # type: ignore[type-var]

        return write

    _with(monkeypatch, "request_writer", losing)
    found = self_check.first_difference(INSTALLED)
    assert found is not None and "arrival_time" in found, found


def test_a_check_that_fails_is_a_difference_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(release: object) -> object:
        raise RuntimeError("no decoder today")

    _with(monkeypatch, "native_decoder", broken)
    found = self_check.first_difference(INSTALLED)
    assert found is not None and "no decoder today" in found


def test_the_plugin_keeps_vllms_client_when_the_check_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if INSTALLED not in plugin.PLUGIN_VLLM_VERSIONS:
        pytest.skip(f"the plugin refuses vLLM {INSTALLED} by name")
    vllms = EngineCoreClient.__dict__["make_async_mp_client"]
    # Restored after the test whatever the plugin did.
    monkeypatch.setattr(EngineCoreClient, "make_async_mp_client", vllms)
    monkeypatch.setattr(self_check, "first_difference", lambda release: "EngineCoreOutput.x")
    with caplog.at_level(logging.WARNING, logger="vllm.corewire"):
        plugin._install_client()
    assert EngineCoreClient.__dict__["make_async_mp_client"] is vllms
    warnings = [r for r in caplog.records if r.name == "vllm.corewire"]
    assert len(warnings) == 1
    assert "EngineCoreOutput.x" in warnings[0].getMessage()
    assert "keeps its own engine-core client" in warnings[0].getMessage()
    # Passing, it installs corewire's factory.
    monkeypatch.setattr(self_check, "first_difference", lambda release: None)
    plugin._install_client()
    assert EngineCoreClient.__dict__["make_async_mp_client"] is not vllms


# -------------------------------------------------- a release newer than every tested one


@pytest.fixture
def newer_vllm(monkeypatch: pytest.MonkeyPatch) -> str:
    """The installed vLLM reporting itself as a release newer than every recorded one
    (what a user upgrading before corewire does sees); what the adoption registers is
    forgotten after the test."""
    from corewire.releases import records

    name = "9.0.0"
    monkeypatch.setattr(vllm, "__version__", name)
    monkeypatch.setattr(records, "_LIVE", {})
    monkeypatch.setattr(releases, "_RELEASES", dict(releases._RELEASES))
    return name


def test_a_newer_release_is_adopted_from_its_own_classes(
    newer_vllm: str, caplog: pytest.LogCaptureFixture
) -> None:
    from corewire.releases import derive, records
    from corewire.wire import layouts

    assert releases.is_newer_than_tested(newer_vllm)
    assert not releases.is_newer_than_tested("0.25.2")
    assert not releases.is_newer_than_tested("9.0.0rc1")
    with caplog.at_level(logging.WARNING, logger="corewire.releases"):
        adopted = releases.installed(vllm)
        assert releases.installed(vllm) is adopted  # adopted once
    assert adopted.name == newer_vllm and adopted.verified is False
    assert releases.get(newer_vllm) is adopted and adopted not in releases.SUPPORTED
    # Its wire is the installed classes' own, read live, and its structs are built from it.
    live = {**derive.derive(vllm), "vllm": newer_vllm}
    assert records.load(newer_vllm) == json.loads(json.dumps(live))
    assert layouts.types_for(adopted)["EngineCoreOutput"] is not None
    untested = [r.getMessage() for r in caplog.records if "untested" in r.getMessage()]
    assert len(untested) == 1 and newer_vllm in untested[0]
    # Its wire is what the installed vLLM writes and reads.
    assert self_check.first_difference(adopted) is None
    # Other unknown versions stay refused.
    with pytest.raises(releases.UnsupportedProtocolError):
        releases.installed(type("Older", (), {"__version__": "0.25.2"}))


def test_the_plugin_accepts_a_newer_release_and_checks_it(newer_vllm: str) -> None:
    plugin.check_vllm_version(newer_vllm)
    with pytest.raises(RuntimeError, match=r"not the installed 0\.25\.2"):
        plugin.check_vllm_version("0.25.2")
    assert plugin.self_check_passes() is True
