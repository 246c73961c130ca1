"""Per-version wire structs, as data: each later vLLM version is a table of edits.

``corewire.protocol`` declares vLLM 0.25.1's structs. A later version differs in a few
of them (docs/protocol.md, "Versions"); its table below lists the differences, field by
field, and :func:`_derive` builds that version's msgspec structs from 0.25.1's with
``msgspec.defstruct``. Nothing else differs between versions: the same encoder writes
either byte for byte, as that vLLM's ``MsgpackEncoder`` does.

:func:`types_for` gives one version's structs by name. The types new in 0.33.0
(:class:`SamplingMaskLists`, :class:`RequestError`) are the ones ``NativeDecoder``
builds for any version; they are defined once, here.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np

from corewire import protocol as p
from corewire.protocol import Tensor
from corewire.versions import V0_25_1, V0_33_0, check_protocol

__all__ = [
    "V0_25_1_TYPES",
    "V0_33_0_TYPES",
    "RequestError",
    "SamplingMaskLists",
    "request_error_from_map",
    "types_for",
    "version_of",
]


class SamplingMaskLists(NamedTuple):
    """The tokens a request's sampler was allowed (vLLM 0.33.0 on; numpy arrays)."""

    token_ids: np.ndarray
    offsets: np.ndarray | None = None
    cu_num_generated_tokens: list[int] | None = None


class RequestError(msgspec.Struct, frozen=True, gc=False):  # type: ignore[call-arg]
    """Why an engine refused or failed a request (vLLM 0.33.0's ``RequestError``).

    Sent with finish reason ERROR in ``EngineCoreOutput.error``, as a map of all three
    fields. ``retryable`` errors (``code == "engine_paused"``) are worth sending again
    later; vLLM's front-end answers them with 503, ``"validation_error"`` with 400, any
    other with 500.
    """

    code: str
    message: str
    retryable: bool = False


def request_error_from_map(fields: dict[str, Any]) -> RequestError:
    """The :class:`RequestError` of a decoded map (the decoder checked its types);
    unknown keys are dropped, as vLLM's decoder drops them."""
    return RequestError(fields["code"], fields["message"], fields.get("retryable", False))


@dataclass(frozen=True)
class Insert:
    """Add ``field`` (name, type, default) right after the field named ``after``."""

    after: str
    field: tuple[str, Any, Any]


@dataclass(frozen=True)
class Append:
    """Add ``field`` (name, type, default) at the end."""

    field: tuple[str, Any, Any]


@dataclass(frozen=True)
class Retype:
    """Give the existing field ``name`` the type ``type`` (a struct of this version)."""

    name: str
    type: Any


_DOCS = {
    "EngineCoreOutput": "New tokens (and more) for one request; vLLM 0.33.0's layout.",
    "EngineCoreOutputs": "One message on the output link; vLLM 0.33.0's layout.",
}


def _derive(base: type, edits: list[Any], namespace: dict[str, Any]) -> type:
    """``base`` (a 0.25.1 array-like struct) with ``edits`` applied, as a new struct."""
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(base):
        default = f.default
        if default is msgspec.NODEFAULT and f.default_factory is not msgspec.NODEFAULT:
            default = msgspec.field(default_factory=f.default_factory)
        fields.append((f.name, f.type, default))
    for edit in edits:
        names = [f[0] for f in fields]
        if isinstance(edit, Insert):
            fields.insert(names.index(edit.after) + 1, edit.field)
        elif isinstance(edit, Append):
            fields.append(edit.field)
        else:
            at = names.index(edit.name)
            fields[at] = (edit.name, edit.type, fields[at][2])
    ns: dict[str, Any] = {k: v for k, v in vars(base).items() if isinstance(v, property)}
    ns.update(namespace)
    ns["__doc__"] = _DOCS.get(base.__name__, base.__doc__)
    return msgspec.defstruct(
        base.__name__,
        [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
        module=__name__,
        namespace=ns,
        array_like=True,
        gc=False,
    )


def _tensors_0_33_0() -> type:
    """vLLM 0.33.0's ``LogprobsTensors``: 0.25.1's plus ``cu_num_generated_tokens_tensor``
    (always written: 5 elements)."""
    fields = [(n, p.LogprobsTensors.__annotations__[n]) for n in p.LogprobsTensors._fields]
    fields.append(("cu_num_generated_tokens_tensor", Tensor | None))
    cls = NamedTuple("LogprobsTensors", fields)  # type: ignore[misc]
    cls.__new__.__defaults__ = (None, None)
    cls.__module__ = __name__
    cls.__doc__ = "Prompt logprobs as torch tensors; vLLM 0.33.0's 5 elements."
    return cls


def _build_0_33_0() -> types.MappingProxyType[str, Any]:
    tensors = _tensors_0_33_0()
    output = _derive(
        p.EngineCoreOutput,
        [
            Retype("new_prompt_logprobs_tensors", tensors | None),
            Insert("kv_transfer_params", ("ec_transfer_params", dict[str, Any] | None, None)),
            Append(("mm_cache_miss_hashes", list[str] | None, None)),
            Append(("new_sampling_mask", SamplingMaskLists | None, None)),
            # vLLM's RequestSpecDecodeMetrics, a dataclass: a map of all its fields.
            Append(("spec_decode_metrics", dict[str, Any] | None, None)),
            Append(("prompt_token_id_logprobs", Tensor | None, None)),
            Append(("error", RequestError | None, None)),
        ],
        {},
    )
    outputs = _derive(
        p.EngineCoreOutputs,
        [
            Retype("outputs", list[output]),  # type: ignore[valid-type]
            Append(("weight_version", str | None, None)),
        ],
        {},
    )
    return types.MappingProxyType(
        {
            "EngineCoreOutputs": outputs,
            "EngineCoreOutput": output,
            "UtilityOutput": p.UtilityOutput,
            "LogprobsLists": p.LogprobsLists,
            "LogprobsTensors": tensors,
            "SamplingMaskLists": SamplingMaskLists,
            "EngineCoreEvent": p.EngineCoreEvent,
            "RequestError": RequestError,
        }
    )


#: vLLM 0.25.1's engine -> front-end structs by name (those of ``corewire.protocol``).
V0_25_1_TYPES = types.MappingProxyType(
    {
        name: getattr(p, name)
        for name in (
            "EngineCoreOutputs",
            "EngineCoreOutput",
            "UtilityOutput",
            "LogprobsLists",
            "LogprobsTensors",
            "EngineCoreEvent",
        )
    }
)
#: vLLM 0.33.0's engine -> front-end structs by name.
V0_33_0_TYPES = _build_0_33_0()

_TYPES = {V0_25_1: V0_25_1_TYPES, V0_33_0: V0_33_0_TYPES}
# The structs whose layout differs between versions -> their version.
_VERSION_OF: dict[type, str] = {}
for _version, _table in _TYPES.items():
    for _cls in _table.values():
        if all(_cls is not t.get(_cls.__name__) for v, t in _TYPES.items() if v != _version):
            _VERSION_OF[_cls] = _version


def types_for(protocol: str | None) -> types.MappingProxyType[str, Any]:
    """The engine -> front-end structs of ``protocol`` by name (``EngineCoreOutputs``,
    ``EngineCoreOutput``, ``LogprobsTensors``...); a version without one lacks its name."""
    return _TYPES[check_protocol(protocol)]


def version_of(cls: type) -> str | None:
    """The one version whose layout struct ``cls`` is, or None for a struct shared by
    every version (or none)."""
    return _VERSION_OF.get(cls)
