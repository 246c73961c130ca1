"""The per-token fast path of ``vllm serve`` (vLLM 0.34.0's OpenAI server): streaming
completions and chat completions whose chunks between the first and the last are written
without Python.

vLLM's server spends Python on every token of every stream: the waiting task's wake-up,
the ``RequestOutput``, the serving generator, the chunk's JSON, Starlette's and uvicorn's
``send``. For a streaming request whose options the fast path covers, the endpoint's
generator (:mod:`corewire.vllm.fast_completions`, :mod:`corewire.vllm.fast_chat`) keeps
Python for what happens once per request (vLLM's admission and rendering ran before it;
there the first chunk, the finish, the usage chunk, errors and ``[DONE]``, rendered as
vLLM renders them), and, once a chunk is on the wire with nothing of the request waiting,
attaches the request's native output state (``corewire._native.RequestText.
attach_stream``) to the connection: from then on each plain output becomes its SSE frame
in Rust, and the frames of every stream in a batch of engine outputs are written to their
connections by the batch's one call into the native output processor, with no Python per
stream or token. An output that needs Python (the engine's finish, an event) takes the
stream back first, so the chunks stay in order.

This module holds what both endpoints share: :func:`install`, the server-wide conditions
(:func:`server_refusal`), the frame templates (:func:`split_template`), attaching
(:func:`attachable`) and the log line of a request that stays on vLLM's path
(:func:`keep_vllms`). ``COREWIRE_VLLM_FAST_PATH=0`` turns it all off
(:mod:`corewire.vllm.plugin`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from corewire import metrics
from corewire._native import RequestText
from corewire.vllm import asgi_cycle

__all__ = [
    "INSTALLED_LOG_LINE",
    "TEXT_PROBE",
    "Template",
    "attach",
    "attachable",
    "first_refusal",
    "install",
    "keep_vllms",
    "request_metrics",
    "server_refusal",
    "split_template",
]

logger = logging.getLogger("vllm.corewire")

#: Said in the API server's log once the fast path is in its app.
INSTALLED_LOG_LINE = (
    "streaming completions and chat completions take the fast path where they qualify"
)

#: A text no model name or id contains, marking where a probe chunk's text goes.
TEXT_PROBE = "\x00corewire-text-probe\x00"
_PROBE_LITERAL = b'"\\u0000corewire-text-probe\\u0000"'

#: A chunk's bytes around its text and around its logprobs (see :func:`split_template`).
Template = tuple[bytes, bytes, bytes]

_told: set[tuple[str, str]] = set()
_ON = frozenset({"1", "true", "yes", "on"})


def keep_vllms(endpoint: str, reason: str) -> None:
    """Counts a streaming request of ``endpoint`` that stays on vLLM's path, and says why
    in the log once per endpoint and reason (a server at high QPS would say it per
    request)."""
    metrics.count_fast_path("vllm")
    if (endpoint, reason) in _told:
        return
    _told.add((endpoint, reason))
    logger.info("corewire: a streaming %s stays on vLLM's path: %s", endpoint, reason)


def split_template(frame: bytes) -> Template | None:
    """A probe frame (its text :data:`TEXT_PROBE`, its logprobs ``null``) cut around its
    two holes: the text's JSON literal, and the logprobs value; None when either is
    ambiguous (a model name that contains the probe's bytes)."""
    if frame.count(_PROBE_LITERAL) != 1:
        return None
    head, after = frame.split(_PROBE_LITERAL)
    hole = b'"logprobs":null'
    if after.count(hole) != 1:
        return None
    mid, tail = after.split(hole)
    return head, mid + hole[: -len(b"null")], tail


def server_refusal(serving: Any, connection: asgi_cycle.Connection | None) -> str | None:
    """Why no streaming request of this server and connection can take the fast path
    (None: they can, as far as the server goes): the connection is not uvicorn's
    ``httptools`` protocol, keep-alive comments are on, middleware of the user's or vLLM's
    response logging could hold the body back (writing beside it would also be safe, see
    ``Connection.caught_up``, but never happen), the engine client has no native output
    processing, or outputs are logged per delta."""
    if connection is None:
        return "the connection is not uvicorn's httptools protocol"
    app = connection.cycle.scope.get("app")
    args = getattr(getattr(app, "state", None), "args", None)
    if getattr(args, "sse_keep_alive_interval", 0):
        return "--sse-keep-alive-interval is set"
    if getattr(args, "middleware", None):
        return "--middleware is set"
    if os.environ.get("VLLM_DEBUG_LOG_API_SERVER_RESPONSE", "").strip().lower() in _ON:
        return "VLLM_DEBUG_LOG_API_SERVER_RESPONSE is set"
    processor = getattr(serving.engine_client, "output_processor", None)
    if getattr(processor, "_core", None) is None:
        return "the engine client has no native output processing"
    if serving.enable_log_outputs and serving.request_logger:
        return "--enable-log-outputs is set"
    return None


def first_refusal(checks: Iterable[tuple[object, str]]) -> str | None:
    """The reason of the first ``(refused, reason)`` check that refuses, or None."""
    return next((why for refused, why in checks if refused), None)


def attachable(
    processor: Any, external_id: str, connection: asgi_cycle.Connection, chunks: int
) -> RequestText | None:
    """The request's native state, if its next plain outputs can go straight to the
    connection: it is native, nothing of it waits in its collector, and the ``chunks``
    chunks the generator produced are all on the wire (``Connection.caught_up``)."""
    if not connection.caught_up(chunks):
        return None
    internal = processor.external_req_ids.get(external_id)
    if not internal or len(internal) != 1:
        return None
    state = processor.request_states.get(internal[0])
    if state is None or state.queue is None or state.queue.output is not None:
        return None
    text = state.detokenizer
    return text if isinstance(text, RequestText) else None


def attach(
    endpoint: str,
    text: RequestText,
    connection: asgi_cycle.Connection,
    template: Template,
    logprobs_limit: int | None = None,
    text_offset: int = 0,
) -> bool:
    """Attaches ``text`` to the connection (``RequestText.attach_stream``); False, said
    once, when that fails (the native state refuses a request the endpoint's checks let
    through, or the cycle is not what it should be): the stream stays Python's,
    unharmed."""
    try:
        text.attach_stream(connection.cycle, *template, logprobs_limit, text_offset)
    except Exception as e:
        # Once per reason (the message names the request first).
        reason = str(e).rsplit(": ", 1)[-1]
        if (endpoint, reason) not in _told:
            _told.add((endpoint, reason))
            logger.warning("corewire: a streaming %s stays Python's: %s", endpoint, e)
        return False
    return True


def request_metrics(serving: Any, last_res: Any, completion_tokens: int) -> Any:
    """The per-request metrics a stream's usage chunk carries, as vLLM 0.34.0's server
    makes them for one prompt and one sample: timings when the server reports them
    (``--enable-per-request-metrics``), speculative decoding's counts when the request
    had any; None when neither."""
    from vllm.entrypoints.generate.base.protocol import PerRequestMetrics
    from vllm.entrypoints.generate.base.serving import (
        build_per_request_timing_metrics,
        build_spec_decoding_metrics,
    )

    metrics: Any = None
    if serving.enable_per_request_metrics:
        metrics = build_per_request_timing_metrics(
            last_res.metrics if last_res is not None else None, completion_tokens
        )
    spec_stats = build_spec_decoding_metrics(last_res)
    if spec_stats is not None:
        if metrics is None:
            metrics = PerRequestMetrics()
        metrics.speculative_decoding = spec_stats
    return metrics


def install(completion_class: Any, chat_class: Any) -> None:
    """Routes the streaming generators of vLLM's ``OpenAIServingCompletion`` and
    ``OpenAIServingChat`` through the fast path's, and makes vLLM's app builder wrap each
    app in :class:`corewire.vllm.asgi_cycle.CycleCapture`."""
    from corewire.vllm import fast_chat, fast_completions

    if getattr(completion_class.completion_stream_generator, "corewire_fast_path", False):
        return  # vLLM loads plugins more than once per process
    import vllm.entrypoints.launchers.app as launcher

    init_middleware = launcher.init_entrypoints_middleware

    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kw: Any) -> Any:
        result = init_middleware(args, app, *rest, **kw)
        asgi_cycle.install(app)
        # Said here, as the app is built, not when the plugin loads: vLLM 0.34.0 sets up
        # its logging after loading plugins and drops what they say at INFO before that.
        logger.info("corewire: %s", INSTALLED_LOG_LINE)
        return result

    launcher.init_entrypoints_middleware = init_entrypoints_middleware
    fast_completions.install(completion_class)
    fast_chat.install(chat_class)
