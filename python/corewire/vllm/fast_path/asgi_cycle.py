"""Which HTTP connection a request of ``vllm serve`` came on: uvicorn's request-response
cycle, for the fast path (:mod:`corewire.vllm.fast_path`) to write a stream's chunks to.

Starlette hands a route a ``send`` wrapped by every middleware, so the cycle behind it is
out of reach there. :class:`CycleCapture` sits outside the whole middleware stack, where
``send`` is still uvicorn's own bound method, and keeps the request's :class:`Connection`
(the cycle, and how many body messages reached it) in a context variable that the
request's tasks (Starlette's streaming task among them) inherit. Only uvicorn's
``httptools`` protocol qualifies: its cycle writes a chunked body as plain transport writes
and keeps no state per chunk, so chunks written beside it leave it consistent.

The count is what makes writing beside the app safe: a middleware may hold a response's
body back (collect it, or pass it on from another task), and then a chunk the app has
produced is not on the wire yet; the fast path writes only when every chunk the app
produced has reached the cycle (:meth:`Connection.caught_up`).
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["Connection", "CycleCapture", "current_cycle", "install"]

#: The module whose ``RequestResponseCycle`` the fast path writes beside.
HTTPTOOLS_CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"

_connection: contextvars.ContextVar[Connection | None] = contextvars.ContextVar(
    "corewire_asgi_connection", default=None
)


class Connection:
    """One HTTP request's uvicorn cycle, and the body messages that reached it."""

    __slots__ = ("bodies", "cycle")

    def __init__(self, cycle: Any) -> None:
        #: uvicorn's ``RequestResponseCycle`` (its ``transport``, ``flow``, state flags).
        self.cycle = cycle
        #: Body messages the cycle has taken (written, or dropped if the client left).
        self.bodies = 0

    def caught_up(self, chunks: int) -> bool:
        """Whether the response is streaming with chunked encoding, its client there and
        reading, and all ``chunks`` body chunks the app produced are on the wire: what
        makes a write beside the app land in order."""
        cycle = self.cycle
        return (
            self.bodies == chunks
            and cycle.response_started
            and not cycle.response_complete
            and cycle.chunked_encoding is True
            and not cycle.disconnected
            and not cycle.flow.write_paused
        )


class CycleCapture:
    """ASGI wrapper that records each HTTP request's :class:`Connection` (see the module
    doc)."""

    def __init__(self, app: Any) -> None:
        #: The wrapped ASGI application (the app's middleware stack).
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        owner = getattr(send, "__self__", None)
        if scope.get("type") != "http" or type(owner).__module__ != HTTPTOOLS_CYCLE_MODULE:
            await self.app(scope, receive, send)
            return
        connection = Connection(owner)

        async def counted_send(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                connection.bodies += 1

        token = _connection.set(connection)
        try:
            await self.app(scope, receive, counted_send)
        finally:
            _connection.reset(token)


def current_cycle() -> Connection | None:
    """The :class:`Connection` of the request being served over uvicorn's ``httptools``
    protocol, or None (another server or protocol, or no capture installed)."""
    return _connection.get()


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
