"""TCP ports for tests that must name a port before something else binds it.

A socket the test binds itself binds port 0 and reads the port back
(``bind_to_random_port``); nothing here is needed for it. A port that a child process
or vLLM binds later must be chosen first, and another process on the machine (a second
test run, a server) can take it in between: :func:`retry_port_conflicts` runs such a
test again on a fresh port when it failed with "address already in use" (EADDRINUSE).

- :func:`unused_tcp_port`, :func:`unused_port_block`: ports free a moment ago; use them
  only in a test that :func:`retry_port_conflicts` wraps.
- :func:`address_in_use`: whether an exception (or its cause or context) is EADDRINUSE.
"""

from __future__ import annotations

import errno
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from corewire import ports
from corewire.ports import unused_port

F = TypeVar("F", bound=Callable[..., Any])

ATTEMPTS = 4
"""Runs of a test that keeps losing its port before it fails for good."""

_IN_USE_TEXT = "address already in use"


def unused_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` a moment ago (racy: see the module docstring)."""
    return unused_port(host)


def unused_port_block(count: int = 4, host: str = "127.0.0.1") -> int:
    """A base port such that ``base .. base+count-1`` on ``host`` were all free a moment
    ago (racy: see the module docstring)."""
    return ports.unused_port_block(host, count)


def address_in_use(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is
    EADDRINUSE: an ``OSError`` or ``ZMQError`` with that errno, or an error that quotes a
    child process's "Address already in use"."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, zmq.ZMQError | OSError) and exc.errno == errno.EADDRINUSE:
            return True
        if _IN_USE_TEXT in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_port_conflicts(test: F) -> F:
    """Run ``test`` again (up to :data:`ATTEMPTS` runs in all) when it fails with
    EADDRINUSE (:func:`address_in_use`); each run picks its ports afresh. The test must
    clean up what it started on the way out, as any test does."""
    if inspect.iscoroutinefunction(test):

        @functools.wraps(test)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    return await test(*args, **kwargs)
                except Exception as exc:
                    if attempt == ATTEMPTS or not address_in_use(exc):
                        raise

        return run_async  # type: ignore[return-value]

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return test(*args, **kwargs)
            except Exception as exc:
                if attempt == ATTEMPTS or not address_in_use(exc):
                    raise

    return run  # type: ignore[return-value]
