"""An engine core's outputs in its protocol's layout (vLLM 0.25.1 or 0.33.0).

Engines build ``corewire.protocol`` structs (vLLM 0.25.1's layout) whatever the protocol
their engine core speaks. A core speaking another version converts each message once,
on its output thread, right before encoding it: :func:`output_converter` gives that
conversion (None for 0.25.1, whose messages go out as built, at no cost). The conversion
copies every field by name into ``corewire.layouts.types_for(protocol)``'s structs, so a
field both versions share can never land at the other version's position.

What 0.33.0 adds that an engine cannot know is filled in here:

- ``weight_version``: vLLM 0.33.0's engine stamps its current weight version on every
  message a step produces, and nil on everything else (utility replies, refusals, abort
  notices, counts for a coordinator). A step's message is queued as :class:`StepOutputs`
  (the version it was made under); anything else converts with nil.
- ``scheduler_stats`` is written as vLLM 0.33.0's ``SchedulerStats`` is: every one of
  its 18 keys, in its order, those the engine did not report at their defaults (vLLM's
  front-end fills them in the same way; its engine writes them all). Keys vLLM does not
  know follow, as the engine gave them (vLLM's decoder drops them).
- ``prefill_stats`` gains ``num_cache_creation_tokens`` (0: corewire's engines create no
  cache entries a front-end would bill).
- ``LogprobsTensors`` has a fifth element (nil here).

Outputs and messages already in the target layout (built by :func:`finish_output`, or by
an engine that fills 0.33.0's own fields) pass through unchanged.

Wire format: docs/protocol.md §11 (versions), docs/vllm-0.33.0-notes.md §2.2-§2.3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from corewire import protocol as p
from corewire.layouts import RequestError, types_for
from corewire.releases import get as get_release

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "StepOutputs",
    "finish_output",
    "output_converter",
]

#: The weight version a vLLM 0.33.0 engine reports until ``set_weight_version``.
DEFAULT_WEIGHT_VERSION = "default"


class StepOutputs:
    """A message one engine step produced, with the weight version it was made under
    (queued only by a core whose protocol has ``weight_version``)."""

    __slots__ = ("outputs", "weight_version")

    def __init__(self, outputs: p.EngineCoreOutputs, weight_version: str | None) -> None:
        self.outputs = outputs
        self.weight_version = weight_version


def finish_output(
    protocol: str,
    request_id: str,
    finish_reason: p.FinishReason,
    stop_reason: str | None = None,
    error: RequestError | None = None,
) -> Any:
    """The output that finishes a request the engine never ran (refused or aborted):
    no tokens, ``finish_reason``, and either corewire's ``stop_reason`` text or (0.33.0
    on) the ``RequestError`` vLLM's front-end turns into 503/400/500, whose message then
    carries the text (``stop_reason`` nil, as vLLM's engine writes it). Under 0.25.1,
    which has no error field, ``error`` is dropped."""
    if not get_release(protocol).request_errors or error is None:
        return p.EngineCoreOutput(
            request_id, [], finish_reason=finish_reason, stop_reason=stop_reason
        )
    out_type = types_for(protocol)["EngineCoreOutput"]
    return out_type(request_id, [], finish_reason=finish_reason, error=error)


def output_converter(protocol: str | None) -> Callable[[Any], Any] | None:
    """The conversion of a queued message (``EngineCoreOutputs`` or :class:`StepOutputs`)
    into ``protocol``'s layout; None when engines' structs are that layout already."""
    release = get_release(protocol)
    if release.speaks_protocol_structs:
        return None
    return _converter(release)


def _scheduler_stats_0_33_0() -> dict[str, Any]:
    """vLLM 0.33.0's ``SchedulerStats()``, every key in its order (a fresh map)."""
    return {
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {},
        "step_counter": 0,
        "current_wave": 0,
        "kv_cache_usage": 0.0,
        "iteration_details": None,
        "prefix_cache_stats": {
            "reset": False,
            "requests": 0,
            "queries": 0,
            "hits": 0,
            "preempted_requests": 0,
            "preempted_queries": 0,
            "preempted_hits": 0,
            "hits_by_source": {},
        },
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def _splice(old: type, new: type) -> tuple[int, tuple[Any, ...]]:
    """How ``new``'s positional fields are made from ``old``'s, worked out by name:
    ``(at, fill)`` where ``new`` is ``old``'s fields up to ``at``, then the fields of
    ``fill`` (their defaults), then the rest of ``old``'s in order, then only fields
    left at their defaults. A layout of another shape is refused here, at import, so
    that no field is ever written at the other version's position."""
    old_names = old.__struct_fields__  # type: ignore[attr-defined]
    new_fields = msgspec.structs.fields(new)
    new_names = tuple(f.name for f in new_fields)
    at = 0
    while at < len(old_names) and old_names[at] == new_names[at]:
        at += 1
    end = new_names.index(old_names[at]) if at < len(old_names) else at
    if new_names[end : end + len(old_names) - at] != old_names[at:]:
        raise AssertionError(f"{new.__name__}: not {old.__name__} with fields inserted")
    fill = tuple(f.default for f in new_fields[at:end])
    if any(f.default is msgspec.NODEFAULT for f in new_fields[at:end]):
        raise AssertionError(f"{new.__name__}: an inserted field has no default")
    return at, fill


def _converter(release: Any) -> Callable[[Any], Any]:
    table = types_for(release)
    outputs_type = table["EngineCoreOutputs"]
    output_type = table["EngineCoreOutput"]
    tensors_type = table["LogprobsTensors"]
    astuple = msgspec.structs.astuple
    # Positional construction (about twice as fast as by keyword), planned by name.
    out_at, out_fill = _splice(p.EngineCoreOutput, output_type)
    outs_at, outs_fill = _splice(p.EngineCoreOutputs, outputs_type)
    names = p.EngineCoreOutput.__struct_fields__
    tensors_i = names.index("new_prompt_logprobs_tensors")
    prefill_i = names.index("prefill_stats")
    outputs_i = p.EngineCoreOutputs.__struct_fields__.index("outputs")
    stats_i = p.EngineCoreOutputs.__struct_fields__.index("scheduler_stats")

    def output(out: Any) -> Any:
        if type(out) is output_type:
            return out
        values = astuple(out)
        tensors, stats = values[tensors_i], values[prefill_i]
        if tensors is not None or stats is not None:
            values = list(values)
            if tensors is not None and type(tensors) is not tensors_type:
                values[tensors_i] = tensors_type(*tensors)
            if type(stats) is dict and "num_cache_creation_tokens" not in stats:
                values[prefill_i] = {**stats, "num_cache_creation_tokens": 0}
        return output_type(*values[:out_at], *out_fill, *values[out_at:])

    def convert(message: Any) -> Any:
        weight_version = None
        if type(message) is StepOutputs:
            weight_version = message.weight_version
            message = message.outputs
        if type(message) is outputs_type:
            return message
        values = list(astuple(message))
        values[outputs_i] = [output(out) for out in values[outputs_i]]
        stats = values[stats_i]
        if type(stats) is dict:
            full = _scheduler_stats_0_33_0()
            full.update(stats)
            values[stats_i] = full
        message = outputs_type(*values[:outs_at], *outs_fill, *values[outs_at:])
        message.weight_version = weight_version
        return message

    return convert
