"""Moved: the per-release wire structs are :mod:`corewire.wire.layouts` (the ``wire``
package owns the layouts and the converters). This name re-exports it and warns."""

from __future__ import annotations

import warnings

from corewire.wire.layouts import *  # noqa: F403
from corewire.wire.layouts import __all__  # noqa: F401

warnings.warn(
    "corewire.layouts moved to corewire.wire.layouts; the old name will be removed",
    DeprecationWarning,
    stacklevel=2,
)
