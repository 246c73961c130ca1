"""Per-version wire structs, as data: each later vLLM version is a table of edits.

``corewire.protocol`` declares vLLM 0.25.1's structs. A later version differs in a few
of them (docs/protocol.md, "Versions"); its table below lists the differences, field by
field, and :func:`_derive` builds that version's msgspec structs from 0.25.1's with
``msgspec.defstruct``. Nothing else differs between versions: the same encoder writes
either byte for byte, as that vLLM's ``MsgpackEncoder`` does.

:func:`types_for` gives one version's structs by name, in both directions: engine ->
front-end (``EngineCoreOutputs``...) and front-end -> engine (``EngineCoreRequest``,
``SamplingParams``, ``PoolingParams``, ``LoRARequest``...) (``corewire.codec.request_decoder``
reads one version's requests with them). The types new in 0.33.0 (:class:`SamplingMaskLists`,
:class:`RequestError`, :class:`KvHintsEnvelope`...) are defined once, here;
``NativeDecoder`` builds the first two for any version.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np

from corewire import protocol as p
from corewire import releases
from corewire.protocol import Tensor

__all__ = [
    "FT_STATUS_CALL_ID",
    "V0_25_1_TYPES",
    "V0_33_0_TYPES",
    "EngineStatusType",
    "KvHintAction",
    "KvHintsEnvelope",
    "LateChunkingParams",
    "LoRARequest",
    "RequestError",
    "SamplingMaskLists",
    "request_error_from_map",
    "types_for",
    "version_of",
]


#: The utility call id of an engine's fault-tolerance status message (vLLM 0.33.0 on): an
#: ``EngineCoreOutputs`` to client 0 whose ``utility_output`` is ``[-2, nil, [nil,
#: {"id": engine_index, "status": ..., "fault_info"?: ...}]]``. No call waits on it;
#: 0.33.0's async client stores the map as that engine's status.
FT_STATUS_CALL_ID = -2


class EngineStatusType(enum.IntEnum):
    """An engine's health in a :data:`FT_STATUS_CALL_ID` message (vLLM 0.33.0 on).

    The int never travels: the status map carries :attr:`wire_name`
    (``"healthy"``, ``"dead"``, ``"unhealthy"``).
    """

    HEALTHY = 0
    DEAD = 1
    UNHEALTHY = 2

    @property
    def wire_name(self) -> str:
        """The status string on the wire (vLLM writes ``name.lower()``)."""
        return self.name.lower()

    @classmethod
    def from_wire(cls, name: str) -> EngineStatusType:
        """The member whose :attr:`wire_name` is ``name`` (``ValueError`` if none)."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown engine status {name!r}") from None


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

    def to_exception(self) -> Exception:
        """The exception vLLM's front-end raises for this error (vLLM 0.33.0's
        ``RequestError.to_exception``: ``VLLMValidationError``, ``RetryableRequestError``
        or ``GenerationError``), so vLLM's output processor takes corewire's decoded
        errors as they are. Needs vLLM 0.33.0 or later installed (``ImportError``
        otherwise); imported only here, on the rare error output."""
        from vllm.outputs import RequestError as VllmRequestError

        return VllmRequestError(self.code, self.message, self.retryable).to_exception()


def request_error_from_map(fields: dict[str, Any]) -> RequestError:
    """The :class:`RequestError` of a decoded map (the decoder checked its types);
    unknown keys are dropped, as vLLM's decoder drops them."""
    return RequestError(fields["code"], fields["message"], fields.get("retryable", False))


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """A LoRA adapter to use, vLLM 0.25.1's layout (positional, 7 fields, all written).

    ``corewire.protocol.EngineCoreRequest`` (0.25.1) carries its LoRA untyped, as
    decoded; this struct is the layout 0.33.0's (``types_for("0.33.0")["LoRARequest"]``,
    which drops ``tensorizer_config_dict``) is derived from. vLLM's checks
    (``lora_int_id >= 1``, a non-empty path) are not repeated.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict[str, Any] | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class LateChunkingParams(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """Fixed-size chunk mean pooling for token embeddings (vLLM 0.33.0 on; ``[chunk_size]``)."""

    chunk_size: int


class KvHintAction(msgspec.Struct, frozen=True):  # type: ignore[call-arg]
    """One KV hint action of an orchestrator (vLLM 0.33.0 on; a map of all four keys)."""

    action_id: str
    action_type: str
    action_version: str
    #: JSON-compatible; its schema belongs to the component that implements the action.
    payload: dict[str, Any]


class KvHintsEnvelope(msgspec.Struct, frozen=True):  # type: ignore[call-arg]
    """KV hints attached to one request (vLLM 0.33.0's ``EngineCoreRequest.kv_hints``)."""

    protocol_version: str
    message_id: str
    actions: list[KvHintAction]


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
class Remove:
    """Drop the field ``name`` (the fields after it move up one place)."""

    name: str


@dataclass(frozen=True)
class Move:
    """Move the field ``name`` to right after the field named ``after`` (map order)."""

    name: str
    after: str


@dataclass(frozen=True)
class Retype:
    """Give the existing field ``name`` the type ``type`` (a struct of this version)."""

    name: str
    type: Any


_DOCS = {
    "EngineCoreOutput": "New tokens (and more) for one request; vLLM 0.33.0's layout.",
    "EngineCoreOutputs": "One message on the output link; vLLM 0.33.0's layout.",
    "EngineCoreRequest": "A request to add; vLLM 0.33.0's layout (22 fields, positional).",
    "PoolingParams": "Pooling parameters; vLLM 0.33.0's layout (11 fields, positional).",
    "LoRARequest": "A LoRA adapter to use; vLLM 0.33.0's layout (6 fields, positional).",
    "SamplingParams": "Sampling parameters; vLLM 0.33.0's map (43 keys, defaults omitted).",
}


def _field_default(f: msgspec.structs.FieldInfo) -> Any:
    """``f``'s default as ``defstruct`` takes it, keeping a wire name that differs."""
    if f.default is not msgspec.NODEFAULT:
        if f.encode_name == f.name:
            return f.default
        return msgspec.field(default=f.default, name=f.encode_name)
    if f.default_factory is not msgspec.NODEFAULT:
        rename = {} if f.encode_name == f.name else {"name": f.encode_name}
        return msgspec.field(default_factory=f.default_factory, **rename)
    if f.encode_name != f.name:
        return msgspec.field(name=f.encode_name)
    return msgspec.NODEFAULT


def _derive(
    base: type, edits: list[Any], namespace: dict[str, Any], *, kw_only: bool = False
) -> type:
    """``base`` (a 0.25.1 struct) with ``edits`` applied, as a new struct of the same kind
    (array-like or map, ``omit_defaults``, ``gc``... as ``base``)."""
    fields: list[tuple[str, Any, Any]] = [
        (f.name, f.type, _field_default(f)) for f in msgspec.structs.fields(base)
    ]
    for edit in edits:
        names = [f[0] for f in fields]
        if isinstance(edit, Insert):
            fields.insert(names.index(edit.after) + 1, edit.field)
        elif isinstance(edit, Append):
            fields.append(edit.field)
        elif isinstance(edit, Remove):
            del fields[names.index(edit.name)]
        elif isinstance(edit, Move):
            moved = fields.pop(names.index(edit.name))
            fields.insert([f[0] for f in fields].index(edit.after) + 1, moved)
        else:
            at = names.index(edit.name)
            fields[at] = (edit.name, edit.type, fields[at][2])
    ns: dict[str, Any] = {k: v for k, v in vars(base).items() if isinstance(v, property)}
    ns.update(namespace)
    ns["__doc__"] = _DOCS.get(base.__name__, base.__doc__)
    config = base.__struct_config__  # type: ignore[attr-defined]
    return msgspec.defstruct(
        base.__name__,
        [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
        module=__name__,
        namespace=ns,
        array_like=config.array_like,
        omit_defaults=config.omit_defaults,
        frozen=config.frozen,
        dict=config.dict,
        gc=config.gc,
        kw_only=kw_only,
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


def _sampling_post_init_0_33_0(self: Any) -> None:
    """vLLM 0.33.0's normalisations (0.25.1's, plus two): duplicate stop token ids and
    bad words are dropped, and ``prompt_logprob_token_ids`` also skips the prefix cache.
    Runs on decode too, as vLLM's does; vLLM's value checks are not repeated."""
    unset = self.skip_reading_prefix_cache is None
    p.SamplingParams.__post_init__(self)
    self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
    self.bad_words = list(dict.fromkeys(self.bad_words))
    if unset and self.prompt_logprob_token_ids is not None:
        self.skip_reading_prefix_cache = True


def _requests_0_33_0() -> dict[str, Any]:
    """vLLM 0.33.0's front-end -> engine structs by name."""
    sampling = _derive(
        p.SamplingParams,
        [
            Insert("temperature", ("watermarking", bool | None, None)),
            # 2-D int32; at 256 bytes or more it travels as an aux frame of the request
            Insert("prompt_logprobs", ("prompt_logprob_token_ids", np.ndarray | None, None)),
            Insert("prompt_logprob_token_ids", ("prompt_logprob_start", int | None, None)),
            Insert("output_kind", ("stream_interval", int | None, None)),
            Insert(
                "all_stop_token_ids",
                (
                    "watermarking_skipped",
                    bool,
                    msgspec.field(default=False, name="_watermarking_skipped"),
                ),
            ),
            Move("routed_experts_prompt_start", after="repetition_detection"),
            Append(("trace_decode_token_ids", list[int] | None, None)),
        ],
        {"__post_init__": _sampling_post_init_0_33_0},
        kw_only=True,
    )
    pooling = _derive(
        p.PoolingParams,
        [Append(("late_chunking_params", LateChunkingParams | None, None))],
        {},
        kw_only=True,
    )
    lora = _derive(LoRARequest, [Remove("tensorizer_config_dict")], {})
    request = _derive(
        p.EngineCoreRequest,
        [
            Retype("sampling_params", sampling | None),
            Retype("pooling_params", pooling | None),
            Retype("lora_request", lora | None),
            Append(("session_id", str | None, None)),
            Append(("kv_hints", KvHintsEnvelope | None, None)),
        ],
        {},
        kw_only=True,
    )
    return {
        "EngineCoreRequest": request,
        "SamplingParams": sampling,
        "PoolingParams": pooling,
        "LoRARequest": lora,
        "LateChunkingParams": LateChunkingParams,
        "KvHintsEnvelope": KvHintsEnvelope,
        "KvHintAction": KvHintAction,
    }


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
            **_requests_0_33_0(),
        }
    )


#: vLLM 0.25.1's wire structs by name (those of ``corewire.protocol``, and its
#: :class:`LoRARequest`).
V0_25_1_TYPES = types.MappingProxyType(
    {
        **{
            name: getattr(p, name)
            for name in (
                "EngineCoreOutputs",
                "EngineCoreOutput",
                "UtilityOutput",
                "LogprobsLists",
                "LogprobsTensors",
                "EngineCoreEvent",
                "EngineCoreRequest",
                "SamplingParams",
                "PoolingParams",
            )
        },
        "LoRARequest": LoRARequest,
    }
)
#: vLLM 0.33.0's wire structs by name.
V0_33_0_TYPES = _build_0_33_0()

_TYPES = {"0.25.1": V0_25_1_TYPES, "0.33.0": V0_33_0_TYPES}

#: corewire's own classes of the structs that hold no other changing struct: a release's
#: recorded layout uses them where its fields are theirs, so that every release decodes
#: into the same classes (those the native decoder makes) wherever the layout did not
#: change. (A struct that nests others, ``EngineCoreOutput`` say, is always built from
#: its record: a class matching its field names could still nest another release's.)
_SHARED_LEAVES = (
    "UtilityOutput",
    "LogprobsLists",
    "LogprobsTensors",
    "SamplingMaskLists",
    "EngineCoreEvent",
    "RequestError",
    "KvHintAction",
    "LateChunkingParams",
)


def _recorded_types(release: str) -> types.MappingProxyType[str, Any]:
    """``release``'s wire structs built from its recorded layout
    (``corewire.releases.records``): vLLM's statistics (dataclasses, TypedDicts) kept as
    maps, as ``corewire.protocol`` keeps them, corewire's own class of a leaf struct where
    the layout is its."""
    from corewire.releases import records
    from corewire.releases.structs import build_structs, wire_names

    record = records.load(release)
    given = _same_layout_classes(record)
    for name in _SHARED_LEAVES:
        if name in given:
            continue
        entry = record["structs"].get(name)
        if entry is None:
            continue
        names = tuple(f["encode_name"] for f in entry["fields"])
        for table in _TYPES.values():
            cls = table.get(name)
            if cls is not None and wire_names(cls) == names:
                given[name] = cls
                break
    built = build_structs(record, as_maps=("dataclass", "typeddict"), given=given)
    return types.MappingProxyType(built)


def _same_layout_classes(record: dict[str, Any]) -> dict[str, Any]:
    """corewire's hand-kept class of each struct whose whole layout (its own and that of
    every struct and enum it reaches) is, in ``record``, what it is in the record of the
    release the class was written for: engines and callers then read the same class,
    with corewire's attribute names (``SamplingParams.eos_token_id``,
    ``PoolingParams.normalize``), in every release that left it alone."""
    from corewire.releases import records

    given: dict[str, Any] = {}
    for version, table in _TYPES.items():
        if version not in records.releases():
            continue
        theirs = records.load(version)
        for name, cls in table.items():
            if name in given or name not in record["structs"] or name not in theirs["structs"]:
                continue
            if records.reachable(record, name) == records.reachable(theirs, name):
                given[name] = cls
    return given


_RECORDED: dict[str, types.MappingProxyType[str, Any]] = {}
# The structs whose layout differs between versions -> their version.
_VERSION_OF: dict[type, str] = {}
for _version, _table in _TYPES.items():
    for _cls in _table.values():
        if all(_cls is not t.get(_cls.__name__) for v, t in _TYPES.items() if v != _version):
            _VERSION_OF[_cls] = _version


def types_for(release: str | None) -> types.MappingProxyType[str, Any]:
    """The wire structs of ``release`` by name, both directions (``EngineCoreOutputs``,
    ``EngineCoreOutput``, ``LogprobsTensors``, ``EngineCoreRequest``, ``SamplingParams``...);
    a version without one lacks its name."""
    release = releases.get(release)
    table = _TYPES.get(release)
    if table is None:
        table = _RECORDED.get(release)
        if table is None:
            table = _RECORDED[release] = _recorded_types(release)
    return table


def version_of(cls: type) -> str | None:
    """The one version whose layout struct ``cls`` is, or None for a struct shared by
    every version (or none)."""
    return _VERSION_OF.get(cls)
