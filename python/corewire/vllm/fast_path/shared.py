"""What both endpoints of the fast path (:mod:`corewire.vllm.fast_path`) share: the
server-wide conditions (:func:`server_refusal`), attaching a request's native state to its
connection (:func:`attachable`, :func:`attach`), the log line of a request that stays on
vLLM's path (:func:`keep_vllms`) and the per-request metrics of a usage chunk."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from corewire import metrics
from corewire._native import RequestText
from corewire.vllm import asgi_cycle
from corewire.vllm.fast_path.frames import Template

__all__ = [
    "attach",
    "attachable",
    "first_refusal",
    "keep_vllms",
    "logger",
    "request_metrics",
    "server_refusal",
]

#: Where the fast path speaks: under vLLM's logger, so vLLM's log settings hold for it.
logger = logging.getLogger("vllm.corewire")

# The (endpoint, reason) pairs said in the log already: each is said once per process.
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
