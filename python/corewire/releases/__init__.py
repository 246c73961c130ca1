"""Every vLLM release corewire speaks, and everything that differs between them.

This package is the one home of release differences. Each release is a
:class:`~corewire.releases.base.Release`: a ``str`` (its version, as the wire names it)
whose attributes say what its engines and front-end do, and whose methods hold the
release's own front-end helpers. One small class per release that behaves differently from
the one before (:mod:`.v0_25_1`, :mod:`.v0_33_0`), registered below in :data:`_CLASSES`;
callers get the one instance of a release with :func:`get` and read its attributes, never
compare version strings.

Adding a release: register its class (a subclass of the previous release's, overriding
what changed) and the release's struct tables (``corewire.layouts``); see
docs/protocol.md §11.
"""

from __future__ import annotations

from corewire.releases.base import Launch, Release
from corewire.releases.v0_25_1 import Release0251
from corewire.releases.v0_33_0 import Release0330

__all__ = [
    "DEFAULT",
    "SUPPORTED",
    "Launch",
    "Release",
    "UnsupportedProtocolError",
    "for_vllm",
    "get",
    "unsupported_protocol",
]

#: Every release class, oldest first. Each stands for its release (its ``NAME``).
_CLASSES: tuple[type[Release], ...] = (Release0251, Release0330)

#: The one instance of each supported release, by version.
_RELEASES: dict[str, Release] = {cls.NAME: cls() for cls in _CLASSES}

#: Every supported release, oldest first (the Rust decoder's
#: ``_native.wire_versions()``; a test ties the two).
SUPPORTED: tuple[Release, ...] = tuple(_RELEASES.values())
#: The release of anything not told one.
DEFAULT: Release = _RELEASES["0.25.1"]


class UnsupportedProtocolError(ValueError):
    """A protocol (or installed vLLM) version corewire does not speak."""

    def __init__(self, message: str, version: str) -> None:
        super().__init__(message)
        self.version = version


def unsupported_protocol(version: object, what: str = "protocol") -> UnsupportedProtocolError:
    """The error for an unsupported ``version``, naming the supported ones."""
    supported = ", ".join(repr(r.name) for r in SUPPORTED)
    return UnsupportedProtocolError(
        f"unsupported {what} {version!r}: corewire speaks vLLM {supported}", str(version)
    )


def get(protocol: str | None) -> Release:
    """The release ``protocol`` names (``None``: :data:`DEFAULT`; a :class:`Release` is
    returned as it is), or raise :class:`UnsupportedProtocolError`."""
    if protocol is None:
        return DEFAULT
    if isinstance(protocol, Release):
        return protocol
    release = _RELEASES.get(protocol) if isinstance(protocol, str) else None
    if release is None:
        raise unsupported_protocol(protocol)
    return release


def for_vllm(version: str) -> Release:
    """The release of an installed vLLM whose ``vllm.__version__`` is ``version``.

    Exact releases only: a patch or development release may change the wire (0.33.0 moved
    fields that 0.25.1 had), and nothing here has checked any other release, so it is
    refused with :class:`UnsupportedProtocolError` rather than decoded wrongly. A local
    version label (``0.33.0+cpu``) names the same release and is accepted.
    """
    release = _RELEASES.get(version.strip().split("+", 1)[0])
    if release is None:
        raise unsupported_protocol(version, "vLLM version")
    return release
