"""A blocking call made on the event loop, answered as a thread pool answers it.

vLLM hands some short blocking work to a pool (``make_async``, ``run_in_executor``) and
awaits the future it gets back; the fast path's inline tokenization and chat rendering
make the same call on the loop instead, where the hand-off costs more than the work, and
must hand back the same kind of answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["answered"]


def answered(call: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
    """``call(*args, **kwargs)``, made now on the running loop, as a done future: its result,
    or its exception delivered at the ``await``, as a pool's future delivers them."""
    future = asyncio.get_running_loop().create_future()
    try:
        future.set_result(call(*args, **kwargs))
    except Exception as exc:
        future.set_exception(exc)
    return future
