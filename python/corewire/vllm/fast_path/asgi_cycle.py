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
import logging
from typing import Any

from corewire.vllm.fast_path.direct_route import ENDPOINTS, DirectRoutes

__all__ = ["DIRECT_ROUTE_LOG_LINE", "Connection", "CycleCapture", "current_cycle", "install"]

#: The requests a direct route serves, as the log names them.
ROUTED = " and ".join(f"POST {path}" for path in ENDPOINTS)
#: Said in the API server's log at its first request where the direct routes serve.
DIRECT_ROUTE_LOG_LINE = f"{ROUTED} go straight to vLLM's handlers, around the router"

# Under vLLM's logger, as the rest of the fast path.
logger = logging.getLogger("vllm.corewire")

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
    doc), and serves the requests a direct route takes
    (:class:`corewire.vllm.fast_path.direct_route.DirectRoutes`) around the app's
    router."""

    def __init__(self, app: Any) -> None:
        #: The wrapped ASGI application (the app's middleware stack).
        self.app = app
        #: The app's direct routes, ready at its first HTTP request.
        self.direct = DirectRoutes(app)
        self._prepared = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if not self._prepared:
            self._prepare(scope.get("app"))
        direct = self.direct.take(scope)
        owner = getattr(send, "__self__", None)
        if type(owner).__module__ != HTTPTOOLS_CYCLE_MODULE:
            if direct is None:
                await self.app(scope, receive, send)
            else:
                await self.direct.serve(direct, scope, receive, send)
            return
        connection = Connection(owner)

        async def counted_send(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                connection.bodies += 1

        token = _connection.set(connection)
        try:
            if direct is None:
                await self.app(scope, receive, counted_send)
            else:
                await self.direct.serve(direct, scope, receive, counted_send)
        finally:
            _connection.reset(token)

    def _prepare(self, app: Any) -> None:
        # Once, at the app's first HTTP request (its routes and state are complete then):
        # said in the log either way.
        self._prepared = True
        self.direct.prepare(app)
        if self.direct.refusal is None:
            logger.info("corewire: %s", DIRECT_ROUTE_LOG_LINE)
        else:
            logger.info("corewire: %s stay on the app's router: %s", ROUTED, self.direct.refusal)


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
