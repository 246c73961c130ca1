"""An engine core's outputs in its release's layout (any release corewire speaks).

Engines build ``corewire.protocol`` structs (vLLM 0.25.1's layout) whatever the release
their engine core speaks. A core speaking another release converts each message once,
on its output thread, right before encoding it: :func:`output_converter` gives that
conversion. The conversion copies every field by name into
``corewire.wire.layouts.types_for(release)``'s structs, so a field both releases share can
never land at the other release's position. Under 0.25.1 the structs go out as built,
and only their stats are completed, in place (below).

What a later release adds that an engine cannot know is filled in here, from the
release's record (``corewire.releases``), not from a table of this module's:

- ``weight_version`` (0.32.0 on): vLLM's engine stamps its current weight version on
  every message a step produces, and nil on everything else (utility replies, refusals,
  abort notices, counts for a coordinator). A step's message is queued as
  :class:`StepOutputs` (the version it was made under); anything else converts with nil.
- ``scheduler_stats`` is written as the release's own ``SchedulerStats`` is, under
  every release 0.25.1 included: every one of its keys, in its order, those the engine
  did not report at their defaults (vLLM's Python front-end fills them in the same way,
  its Rust front-end, ``vllm-rs``, refuses a map without them: ``missing field
  step_counter``; its engines write them all). Keys vLLM does not know follow, as the engine gave
  them (vLLM's decoder drops them).
- ``prefill_stats`` likewise gains the release's keys the engine did not report
  (``num_cache_creation_tokens``, 0: corewire's engines create no cache entries a
  front-end would bill).
- ``LogprobsTensors`` has the release's elements (0.29.0's fifth: nil here).

Outputs and messages already in the target layout (built by :func:`finish_output`, or by
an engine that fills a release's own fields) pass through unchanged.

Wire format: docs/protocol.md §11 (versions), docs/vllm-0.33.0-notes.md §2.2-§2.3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from corewire import protocol as p
from corewire.releases import get as get_release
from corewire.wire.layouts import RequestError, types_for

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
    release: str,
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
    if not get_release(release).request_errors or error is None:
        return p.EngineCoreOutput(
            request_id, [], finish_reason=finish_reason, stop_reason=stop_reason
        )
    out_type = types_for(release)["EngineCoreOutput"]
    # By name: a release's recorded structs may take their fields by keyword only.
    return out_type(
        request_id=request_id, new_token_ids=[], finish_reason=finish_reason, error=error
    )


def output_converter(release: str | None) -> Callable[[Any], Any] | None:
    """The conversion of a queued message (``EngineCoreOutputs`` or :class:`StepOutputs`)
    into ``release``'s layout: for a release whose layout engines' structs are already
    (0.25.1), only the stats completed in place (:func:`_stats_completer`), for the
    others every struct too; None where there is nothing to do (no record of the
    release's stats)."""
    release = get_release(release)
    if release.speaks_protocol_structs:
        return _stats_completer(release)
    return _converter(release)


def _stats_defaults(release: Any, name: str) -> dict[str, Any] | None:
    """Every key of the release's stats dataclass ``name`` at its default, in its order
    (what its own engines write for an instance made without arguments), from its
    record; None for a release without a record of it (0.25.1's engines send what they
    report, and vLLM 0.25.1's front-end fills in the rest)."""
    from corewire.releases import records

    if release.name not in records.releases():
        return None
    record = records.load(release.name)
    if name not in record["structs"]:
        return None
    return records.defaults(record, name)


def _complete(defaults: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with every key of ``defaults`` (a release's stats dataclass), in its
    order, the engine's values over them; keys the release does not know follow.

    The nested default values (``prefix_cache_stats``'s map, empty lists and maps) are
    ``defaults``' own objects, shared by every message: a queued message is only
    encoded, never changed, so no copy is made per step."""
    if len(stats) >= len(defaults) and all(key in stats for key in defaults):
        return stats
    return {**defaults, **stats}


def _stats_completer(release: Any) -> Callable[[Any], Any] | None:
    """The completion of the stats in a message of a release whose structs engines
    build as they are (in place: ``scheduler_stats``, and each output's
    ``prefill_stats``, with every key of the release's ``SchedulerStats`` /
    ``PrefillStats``); None for a release without a record of either."""
    scheduler_defaults = _stats_defaults(release, "SchedulerStats")
    prefill_defaults = _stats_defaults(release, "PrefillStats")
    if scheduler_defaults is None and prefill_defaults is None:
        return None

    def complete(message: Any) -> Any:
        outputs = message.outputs if type(message) is StepOutputs else message
        stats = outputs.scheduler_stats
        if type(stats) is dict and scheduler_defaults is not None:
            outputs.scheduler_stats = _complete(scheduler_defaults, stats)
        if prefill_defaults is not None:
            for out in outputs.outputs:
                if type(out.prefill_stats) is dict:
                    out.prefill_stats = _complete(prefill_defaults, out.prefill_stats)
        # A step's message goes out as its structs: the release has no weight version.
        return outputs

    return complete


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
    names = p.EngineCoreOutput.__struct_fields__
    tensors_i = names.index("new_prompt_logprobs_tensors")
    prefill_i = names.index("prefill_stats")
    outputs_i = p.EngineCoreOutputs.__struct_fields__.index("outputs")
    stats_i = p.EngineCoreOutputs.__struct_fields__.index("scheduler_stats")
    # Every key of the release's stats, as its engines write them (vLLM's Rust front-end
    # refuses a SchedulerStats without them): the defaults first, the reported values
    # over them; keys vLLM does not know follow, as the engine gave them.
    scheduler_defaults = _stats_defaults(release, "SchedulerStats")
    prefill_defaults = _stats_defaults(release, "PrefillStats")
    build_output = _builder(p.EngineCoreOutput, output_type)
    build_outputs = _builder(p.EngineCoreOutputs, outputs_type)

    def output(out: Any) -> Any:
        if type(out) is output_type:
            return out
        values = astuple(out)
        tensors, stats = values[tensors_i], values[prefill_i]
        if tensors is not None or stats is not None:
            values = list(values)
            if tensors is not None and type(tensors) is not tensors_type:
                values[tensors_i] = tensors_type(*tensors)
            if type(stats) is dict and prefill_defaults is not None:
                values[prefill_i] = _complete(prefill_defaults, stats)
        return build_output(values)

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
        if type(stats) is dict and scheduler_defaults is not None:
            values[stats_i] = _complete(scheduler_defaults, stats)
        message = build_outputs(values)
        if weight_version is not None:
            message.weight_version = weight_version
        return message

    return convert


def _builder(old: type, new: type) -> Callable[[Any], Any]:
    """The function that makes a ``new`` struct from ``old``'s field values (in ``old``'s
    order): positionally where ``new`` takes positions and is ``old`` with fields inserted
    (about twice as fast as by keyword), else by name (every field ``new`` shares with
    ``old``; the rest take their defaults: a release's recorded structs are keyword-only)."""
    if _takes_positions(new):
        try:
            at, fill = _splice(old, new)
        except AssertionError:
            pass
        else:
            return lambda values: new(*values[:at], *fill, *values[at:])
    shared = [(i, n) for i, n in enumerate(old.__struct_fields__) if n in new.__struct_fields__]
    return lambda values: new(**{n: values[i] for i, n in shared})


def _takes_positions(cls: type) -> bool:
    """Whether msgspec struct ``cls`` can be made from positional arguments (msgspec
    does not check values when a struct is made, so Nones are enough to tell)."""
    try:
        cls(*([None] * len(cls.__struct_fields__)))  # type: ignore[attr-defined]
    except TypeError:
        return False
    return True
