"""The fast path's endpoints served without the app's router: ``POST /v1/completions`` and
``POST /v1/chat/completions`` of ``vllm serve`` (vLLM 0.33.0, 0.34.0), handed to vLLM's serving
code straight from the outside of the middleware stack.

A request that reaches one of these endpoints through the app pays, once per request, for
Starlette's and FastAPI's machinery around vLLM's handler: the router's walk over every
route, FastAPI's dependency solving, vLLM's ``with_cancellation`` (two tasks and a wait)
and ``StreamingResponse``'s task group, and a send wrapper per layer. None of it changes the
answer for these endpoints: the router picks vLLM's route, its one dependency checks the
content type, and the body is the JSON FastAPI validates against the route's model.

:class:`DirectRoutes` keeps what shapes the answer and skips the rest. The middleware that
the app would run (the server-error catcher, CORS, vLLM's scaling gate, the Prometheus
instrumentator, the exception handlers) runs as it is, each a copy of the app's own
instance whose inner app is the endpoint here, so status codes, headers, exception
handling and ``/metrics`` come out as the app's. Inside, the body is read and validated as
FastAPI would (JSON, then the route's body field); vLLM's serving method gets the request,
and its answer becomes the response vLLM's route would return. One task listens for the
client's disconnect, for the handler and the stream alike, and cancels the request as
vLLM's route and Starlette's stream would.

Anything else stays on the app: another method or path, a server whose middleware this
module does not know (``--api-key``, ``--middleware``, request-id headers, response
logging), load tracking, a root path, a content type vLLM refuses, and a body that does not
parse or validate (it is replayed to the app, which renders the error as it always does).

Imports nothing of vLLM at module level (the fast path's package imports it only where it
installs the endpoints).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from corewire import metrics
from corewire.vllm.fast_path.frames import StreamEnd
from corewire.vllm.fast_path.switches import switched_off

__all__ = ["ENDPOINTS", "SWITCH", "DirectRoutes", "Endpoint", "middleware_refusal"]

#: ASGI callables, loosely typed (Starlette's own types need Starlette).
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Endpoint:
    """One endpoint the direct route serves: vLLM's route function for ``path``, the
    ``app.state`` attribute of its serving object, the serving method, and the class of a
    whole (not streamed) answer, as ``module:name``."""

    path: str
    route_module: str
    route_function: str
    state_attribute: str
    serving_method: str
    full_response: str
    #: What vLLM's route raises when the server has no such serving object.
    missing: str


ENDPOINTS: dict[str, Endpoint] = {
    e.path: e
    for e in (
        Endpoint(
            "/v1/completions",
            "vllm.entrypoints.openai.completion.api_router",
            "create_completion",
            "openai_serving_completion",
            "create_completion",
            "vllm.entrypoints.openai.completion.protocol:CompletionResponse",
            "The model does not support Completions API",
        ),
        Endpoint(
            "/v1/chat/completions",
            "vllm.entrypoints.openai.chat_completion.api_router",
            "create_chat_completion",
            "openai_serving_chat",
            "create_chat_completion",
            "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionResponse",
            "The model does not support Chat Completions API",
        ),
    )
}

#: The middleware a direct route runs as the app would, by ``(module, class)``: what
#: ``vllm serve`` installs without options that add their own.
KNOWN_MIDDLEWARE = frozenset(
    {
        ("starlette.middleware.errors", "ServerErrorMiddleware"),
        ("starlette.middleware.cors", "CORSMiddleware"),
        ("vllm.entrypoints.serve.elastic_ep.middleware", "ScalingMiddleware"),
        ("vllm.entrypoints.speech_to_text.realtime.metrics", "WebSocketMetricsMiddleware"),
        ("prometheus_fastapi_instrumentator.middleware", "PrometheusInstrumentatorMiddleware"),
        ("starlette.middleware.exceptions", "ExceptionMiddleware"),
    }
)
#: Where the app's middleware ends and FastAPI's routing begins.
ROUTING = ("fastapi.middleware.asyncexitstack", "AsyncExitStackMiddleware")
_INSTRUMENTATOR = (
    "prometheus_fastapi_instrumentator.middleware",
    "PrometheusInstrumentatorMiddleware",
)

#: The environment switch that turns the direct routes off (``0``) alone, leaving the rest
#: of the fast path on.
SWITCH = "COREWIRE_VLLM_DIRECT_ROUTE"

# The scope key that carries a validated request from the dispatcher to the endpoint.
_REQUEST_KEY = "corewire.direct_request"


def _kind(layer: Any) -> tuple[str, str]:
    return type(layer).__module__, type(layer).__qualname__


def middleware_refusal(stack: Any) -> tuple[list[Any], str | None]:
    """The middleware of the app's built ``stack`` (outermost first, down to FastAPI's
    routing), and why a direct route cannot run it as the app would (None: it can): a
    layer this module does not know (its class is named)."""
    layers: list[Any] = []
    layer = stack
    while _kind(layer) != ROUTING:
        if _kind(layer) not in KNOWN_MIDDLEWARE:
            module, name = _kind(layer)
            return layers, f"the app runs middleware {module}.{name}"
        layers.append(layer)
        layer = getattr(layer, "app", None)
        if layer is None:
            return layers, "the app's middleware does not end in FastAPI's routing"
    return layers, None


async def _nothing() -> AsyncIterator[bytes]:
    # The content of the response whose headers a stream's start carries (never iterated).
    yield b""


class _Route:
    """One endpoint, ready: vLLM's route (its body field validates the JSON), the copy of
    the app's middleware around :meth:`DirectRoutes.endpoint`, and the whole answer's
    class."""

    __slots__ = ("chain", "endpoint", "full_response", "route")

    def __init__(self, endpoint: Endpoint, route: Any, chain: Any, full_response: type) -> None:
        self.endpoint = endpoint
        self.route = route
        self.chain = chain
        self.full_response = full_response


class DirectRoutes:
    """The direct routes of one app (see the module doc). Ready at the first request
    (:meth:`prepare`): then :meth:`take` says which requests it serves, and :meth:`serve`
    serves them."""

    def __init__(self, stack: Any) -> None:
        #: The app's built middleware stack, where every other request goes.
        self.stack = stack
        #: Why no request takes a direct route (None: they can, once prepared).
        self.refusal: str | None = None
        self._routes: dict[str, _Route] | None = None

    def prepare(self, app: Any) -> None:
        """Finds vLLM's routes in ``app`` and copies its middleware around the endpoint;
        sets :attr:`refusal` where that cannot be done as the app would."""
        if self._routes is not None or self.refusal is not None:
            return
        layers, why = middleware_refusal(self.stack)
        if getattr(app, "router", None) is None:
            why = "the server's application is not a Starlette app"
        if switched_off(SWITCH):
            why = f"{SWITCH} is off"
        if why is None and getattr(app, "root_path", ""):
            why = "the app has a root path"
        if why is None and getattr(getattr(app.state, "args", None), "sse_keep_alive_interval", 0):
            # vLLM's routes wrap each stream in keep-alive comments then.
            why = "--sse-keep-alive-interval is set"
        routes: dict[str, _Route] = {}
        for endpoint in ENDPOINTS.values() if why is None else ():
            route = _first_route(app, endpoint.path)
            if route is None or not _is_vllms(route, endpoint):
                why = f"POST {endpoint.path} is not vLLM's route"
                break
            module, name = endpoint.full_response.split(":")
            full = getattr(importlib.import_module(module), name)
            chain = _copied(layers, self._endpoint_app(endpoint))
            routes[endpoint.path] = _Route(endpoint, route, chain, full)
        if why is not None:
            self.refusal = why
            return
        from starlette.responses import StreamingResponse

        self._stream_headers = StreamingResponse(
            _nothing(), media_type="text/event-stream"
        ).raw_headers
        self._routes = routes

    def take(self, scope: Any) -> _Route | None:
        """The direct route of an HTTP request's ``scope`` (None: the app serves it)."""
        routes = self._routes
        if routes is None or scope["method"] != "POST" or scope.get("root_path"):
            return None
        route = routes.get(scope["path"])
        if route is None or getattr(scope["app"].state, "enable_server_load_tracking", False):
            return None
        return route

    async def serve(self, route: _Route, scope: Any, receive: Receive, send: Send) -> None:
        """Reads the request's body; serves a body FastAPI would accept by the route,
        and replays any other to the app (which answers it as ever)."""
        messages = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        replay = _replaying(messages, receive)
        request = None
        if messages[-1]["type"] == "http.request":
            request = _validated(route.route, scope, body)
        if request is None:
            await self.stack(scope, replay, send)
            return
        scope[_REQUEST_KEY] = request
        # What the router adds to the scope of the request it routes.
        scope["router"] = scope["app"].router
        scope["endpoint"] = route.route.endpoint
        scope["path_params"] = {}
        scope["route"] = route.route
        metrics.count_direct_route()
        await route.chain(scope, replay, send)

    def _endpoint_app(self, endpoint: Endpoint) -> Callable[..., Awaitable[None]]:
        async def endpoint_app(scope: Any, receive: Receive, send: Send) -> None:
            await self.endpoint(self._routes[endpoint.path], scope, receive, send)  # type: ignore[index]

        return endpoint_app

    async def endpoint(self, route: _Route, scope: Any, receive: Receive, send: Send) -> None:
        """vLLM's route, for a validated request: its serving method's answer as a
        response, the client's disconnect cancelling it (handler and stream alike)."""
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.utils.orca_metrics import metrics_header

        request = scope.pop(_REQUEST_KEY)
        raw_request = Request(scope, receive, send)
        endpoint = route.endpoint
        serving = getattr(scope["app"].state, endpoint.state_attribute, None)
        if serving is None:
            raise NotImplementedError(endpoint.missing)
        task = asyncio.current_task()
        gone: list[bool] = []
        listener = asyncio.ensure_future(_disconnect(receive, task, gone))
        started = False
        answer = None
        try:
            answer = await getattr(serving, endpoint.serving_method)(request, raw_request)
            if gone:
                # The client left while the handler ran, and the handler took the cancel
                # for its own (vLLM's serving code answers it with an error): vLLM's route
                # drops that answer for an empty response, as below.
                raise asyncio.CancelledError
            if isinstance(answer, ErrorResponse):
                response = JSONResponse(content=answer.model_dump(), status_code=answer.error.code)
            elif isinstance(answer, route.full_response):
                header_format = raw_request.headers.get("endpoint-load-metrics-format", "")
                response = JSONResponse(
                    content=answer.model_dump(), headers=metrics_header(header_format)
                )
            else:
                started = True
                await self._stream(answer, send)
                return
            started = True
            await response(scope, receive, send)
        except asyncio.CancelledError:
            if not gone:
                raise
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()
            if not started:
                # vLLM's route answers a request whose client left before its handler
                # returned with an empty response (what the instrumentator counts).
                if answer is not None and hasattr(answer, "aclose"):
                    await answer.aclose()
                await Response()(scope, receive, send)
        finally:
            listener.cancel()

    async def _stream(self, chunks: Any, send: Send) -> None:
        # StreamingResponse's messages: the start, each chunk as UTF-8, the end; a fast
        # path stream's StreamEnd is the last chunk and the end in one message.
        await send({"type": "http.response.start", "status": 200, "headers": self._stream_headers})
        try:
            async for chunk in chunks:
                last = isinstance(chunk, StreamEnd)
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode("utf-8")
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return
        finally:
            # A stream cut short by the client (or ended by its StreamEnd): its
            # generator's cleanup runs now.
            await chunks.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnect(receive: Receive, task: Any, gone: list[bool]) -> None:
    # Waits for the client's disconnect, then cancels the request's task.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
            task.cancel()
            return


def _replaying(messages: list[Any], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` (read already) first, then the
    connection's."""
    pending = list(messages)

    async def replay() -> Any:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def _validated(route: Any, scope: Any, body: bytes) -> Any:
    """The request model FastAPI would pass vLLM's route for ``body``, or None where
    FastAPI or the route's dependency would refuse it (the app then says why): the content
    type is not ``application/json``, the body is empty or not JSON, or it fails the
    route's body field."""
    content_type = ""
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value.decode("latin-1")
            break
    # vLLM's validate_json_request: the media type, lowercased, exactly.
    if content_type.lower().split(";", maxsplit=1)[0] != "application/json" or not body:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if value is None:
        return None
    try:
        request, errors = route.body_field.validate(value, {}, loc=("body",))
    except Exception:
        # vLLM's own validators raise errors of their own (VLLMValidationError, TypeError)
        # that the app's exception handlers answer.
        return None
    return None if errors else request


def _first_route(app: Any, path: str) -> Any:
    """The route the app's router picks for ``POST path`` (the first full match)."""
    from starlette.routing import Match

    scope = {"type": "http", "path": path, "method": "POST", "root_path": ""}
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route
    return None


def _is_vllms(route: Any, endpoint: Endpoint) -> bool:
    """Whether ``route`` is vLLM's own for ``endpoint``: its function, a JSON body field,
    and its one dependency (the content type check) and no other."""
    function = getattr(route, "endpoint", None)
    dependencies = getattr(route, "dependencies", None) or []
    return (
        getattr(function, "__module__", None) == endpoint.route_module
        and getattr(function, "__name__", None) == endpoint.route_function
        and getattr(route, "body_field", None) is not None
        and len(dependencies) == 1
        and getattr(dependencies[0].dependency, "__name__", None) == "validate_json_request"
    )


def _copied(layers: list[Any], inner: Any) -> Any:
    """Copies of the app's middleware ``layers`` (outermost first), chained around
    ``inner`` in the same order; the instrumentator's copy names the handler as the
    original would, once per path and method."""
    app = inner
    for layer in reversed(layers):
        twin = copy.copy(layer)
        twin.app = app
        if _kind(layer) == _INSTRUMENTATOR:
            twin._get_handler = _remembered(layer._get_handler)
        app = twin
    return app


def _remembered(get_handler: Callable[[Any], tuple[str, bool]]) -> Callable[[Any], Any]:
    # The instrumentator walks every route to name a request's handler; for the direct
    # routes' fixed paths the name is the same each time.
    names: dict[tuple[str, str], tuple[str, bool]] = {}

    def named(request: Any) -> tuple[str, bool]:
        key = (request.scope["path"], request.scope["method"])
        name = names.get(key)
        if name is None:
            name = names[key] = get_handler(request)
        return name

    return named
