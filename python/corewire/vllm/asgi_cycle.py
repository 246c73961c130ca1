"""Which HTTP connection a request of ``vllm serve`` came on: uvicorn's request-response
cycle, for the fast path (:mod:`corewire.vllm.fast_path`) to write a stream's chunks to.

Starlette hands a route a ``send`` wrapped by every middleware, so the cycle behind it is
out of reach there. :class:`CycleCapture` sits outside the whole middleware stack, where
``send`` is still uvicorn's own bound method, and keeps the cycle in a context variable
that the request's tasks (Starlette's streaming task among them) inherit. Only uvicorn's
``httptools`` protocol qualifies: its cycle writes a chunked body as plain transport writes
and keeps no state per chunk, so chunks written beside it leave it consistent.
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["CycleCapture", "current_cycle", "install"]

#: The module whose ``RequestResponseCycle`` the fast path writes beside.
HTTPTOOLS_CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"

_cycle: contextvars.ContextVar[Any] = contextvars.ContextVar("corewire_asgi_cycle", default=None)


class CycleCapture:
    """ASGI wrapper that records each HTTP request's uvicorn cycle (see the module doc)."""

    def __init__(self, app: Any) -> None:
        #: The wrapped ASGI application (the app's middleware stack).
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        owner = getattr(send, "__self__", None)
        token = _cycle.set(owner if type(owner).__module__ == HTTPTOOLS_CYCLE_MODULE else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _cycle.reset(token)


def current_cycle() -> Any:
    """The uvicorn ``httptools`` cycle of the request being served, or None (another
    server or protocol, or no capture installed)."""
    return _cycle.get()


def install(app: Any) -> None:
    """Wraps the middleware stack ``app`` (a Starlette app) will build in
    :class:`CycleCapture`. Call before the app serves its first request."""
    build = app.build_middleware_stack
    if getattr(build, "corewire_capture", False):
        return

    def build_middleware_stack() -> Any:
        return CycleCapture(build())

    build_middleware_stack.corewire_capture = True  # type: ignore[attr-defined]
    app.build_middleware_stack = build_middleware_stack
