"""Completing a caller's future (asyncio or concurrent) that another path may have
completed first.

A utility call's future can be answered by its reply, failed by a bad frame, failed by
the engine's death (on another thread: a sync client's engine monitor) or cancelled by
its caller, in any order. Every path completes it through :func:`complete_future`, which
sets it unless it is already done: the attempt is made and a refusal ignored, instead of
a ``done()`` test that another thread can overtake (and the try costs nothing on the
path where nothing is raised).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

__all__ = ["complete_future"]

# What a future refuses a completion with: already done or cancelled (InvalidStateError),
# or an asyncio future whose loop is closed (RuntimeError; a client closing after its loop).
_REFUSED = (asyncio.InvalidStateError, concurrent.futures.InvalidStateError, RuntimeError)


def complete_future(future: Any, result: Any = None, exc: BaseException | None = None) -> None:
    """Set ``exc`` (when given) or ``result`` on ``future``; a future that is already
    done, cancelled, or whose event loop is closed is left as it is."""
    try:
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)
    except _REFUSED:
        pass
