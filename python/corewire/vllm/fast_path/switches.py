"""The fast path's own switches: environment variables that turn one of its parts off
(``0``, ``false``, ``no`` or ``off``, any case; unset or anything else leaves it on)."""

from __future__ import annotations

import os

__all__ = ["OFF_VALUES", "switched_off"]

#: What turns a part off.
OFF_VALUES = frozenset({"0", "false", "no", "off"})


def switched_off(switch: str) -> bool:
    """Whether the environment variable ``switch`` turns its part off."""
    return os.environ.get(switch, "").strip().lower() in OFF_VALUES
