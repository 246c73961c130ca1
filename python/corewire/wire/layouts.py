"""Per-release wire structs, from one schema source: the releases' records.

``corewire.protocol`` declares vLLM 0.25.1's structs with corewire's attribute names and
behaviour. vLLM 0.33.0's are those classes edited field by field into 0.33.0's layout as
the two releases' records (``corewire.releases.records``) say it (:class:`_Edited`): the
same attribute names, the new fields' wire names, types and defaults from the record,
and, by hand, only what a record cannot say (the ``__post_init__`` normalisations of
:data:`_BEHAVIOUR`). Every later release is built from its own record
(``corewire.releases.structs``), with corewire's classes wherever its layout is theirs.
Nothing else differs between releases: the same encoder writes any of them byte for
byte, as that vLLM's ``MsgpackEncoder`` does.

:func:`types_for` gives one release's structs by name, in both directions: engine ->
front-end (``EngineCoreOutputs``...) and front-end -> engine (``EngineCoreRequest``,
``SamplingParams``, ``PoolingParams``, ``LoRARequest``...) (``corewire.codec.request_decoder``
reads one release's requests with them). The types new in 0.33.0 (:class:`SamplingMaskLists`,
:class:`RequestError`, :class:`KvHintsEnvelope`...) are defined once, here;
``NativeDecoder`` builds the first two for any release.
"""

from __future__ import annotations

import enum
import itertools
import types
import typing
from typing import Any, NamedTuple

import msgspec
import numpy as np

from corewire import protocol as p
from corewire import releases

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

    # vLLM's methods of the same names, which its output processor calls on decoded
    # outputs (0.32.0 on): the positions' masks as lists, and a request's positions.

    def slice_request(self, req_idx: int, num_positions: int) -> SamplingMaskLists:
        """The masks of ``num_positions`` positions from request ``req_idx``'s first one
        (position ``req_idx`` when ``cu_num_generated_tokens`` is None), as views: with
        ``offsets`` rebased to 0, or none for a single position. Needs ``offsets`` (a
        mask of one position has nothing to slice): ``ValueError`` without."""
        if self.offsets is None:
            raise ValueError("a SamplingMaskLists without offsets holds one position")
        starts = self.cu_num_generated_tokens
        first = req_idx if starts is None else starts[req_idx]
        last = first + num_positions
        low, high = self.offsets[first], self.offsets[last]
        if num_positions == 1:
            return type(self)(self.token_ids[low:high])
        return type(self)(self.token_ids[low:high], self.offsets[first : last + 1] - low)

    def to_nested_list(self) -> list[list[int]]:
        """Each position's allowed token ids, as lists (one position without ``offsets``)."""
        ids = self.token_ids.tolist()
        if self.offsets is None:
            return [ids]
        bounds = self.offsets.tolist()
        return [ids[start:end] for start, end in itertools.pairwise(bounds)]


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


#: corewire's docstrings of the classes it edits, by release and struct.
_DOCS: dict[str, dict[str, str]] = {
    "0.33.0": {
        "EngineCoreOutput": "New tokens (and more) for one request; vLLM 0.33.0's layout.",
        "EngineCoreOutputs": "One message on the output link; vLLM 0.33.0's layout.",
        "EngineCoreRequest": "A request to add; vLLM 0.33.0's layout (22 fields, positional).",
        "PoolingParams": "Pooling parameters; vLLM 0.33.0's layout (11 fields, positional).",
        "LoRARequest": "A LoRA adapter to use; vLLM 0.33.0's layout (6 fields, positional).",
        "SamplingParams": "Sampling parameters; vLLM 0.33.0's map (43 keys, defaults omitted).",
        "LogprobsTensors": "Prompt logprobs as torch tensors; vLLM 0.33.0's 5 elements.",
    },
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


#: What a release's record cannot say about corewire's class of one of its structs: the
#: checks and normalisations its ``__post_init__`` repeats from vLLM (by release, struct).
_BEHAVIOUR: dict[str, dict[str, dict[str, Any]]] = {
    "0.33.0": {"SamplingParams": {"__post_init__": _sampling_post_init_0_33_0}},
}


class _Edited:
    """corewire's classes of one release's structs: corewire's classes of an earlier
    release (``base``: their attribute names, wire names, types, properties), edited field
    by field into the later release's layout as the two releases' records say it. A struct
    whose layout (its own and that of every struct it reaches) did not change keeps the
    earlier class; fields new in the release get their types and defaults from its
    record (``new``: corewire's classes of the structs new in it)."""

    def __init__(
        self,
        base: types.MappingProxyType[str, Any],
        base_record: dict[str, Any],
        record: dict[str, Any],
        release: str,
        new: dict[str, Any],
    ) -> None:
        from corewire.releases import records
        from corewire.releases.structs import type_reader

        self.base = base
        self.old = base_record["structs"]
        self.structs = record["structs"]
        self.reader = type_reader(record, as_maps=("dataclass", "typeddict"), given=new)
        self.behaviour = _BEHAVIOUR.get(release, {})
        self.docs = _DOCS.get(release, {})
        self.changed = {
            name
            for name in base
            if name in self.structs
            and records.reachable(record, name) != records.reachable(base_record, name)
        }
        self.done: dict[str, Any] = {}

    def table(self) -> dict[str, Any]:
        return {name: self.cls(name) for name in self.base if name in self.structs}

    def cls(self, name: str) -> Any:
        if name in self.done:
            return self.done[name]
        if name not in self.changed:
            made = self.base[name]
        else:
            for ref in self._refs(self.structs[name]):
                if ref in self.changed:
                    self.cls(ref)  # a struct it holds first: the reader then uses it
            entry = self.structs[name]
            kind = entry["kind"]
            made = self._namedtuple(name) if kind == "namedtuple" else self._struct(name)
        self.done[name] = made
        self.reader.adopt(name, made)
        return made

    @staticmethod
    def _refs(entry: dict[str, Any]) -> set[str]:
        found: set[str] = set()
        stack: list[Any] = [f["type"] for f in entry["fields"]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("kind") == "struct":
                    found.add(node["name"])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        return found

    def _field_type(self, name: str, recorded: dict[str, Any], kept: Any) -> Any:
        """A kept field's type: the earlier class's, unless its recorded type changed or
        it holds a struct whose layout did (then what the record says, with the edited
        classes in it)."""
        old = {f["encode_name"]: f for f in self.old[name]["fields"]}.get(recorded["encode_name"])
        unchanged = old is not None and old["type"] == recorded["type"]
        if unchanged and not self._refs({"fields": [recorded]}) & self.changed:
            return kept
        return self.reader.type_of(recorded["type"])

    def _fields(self, name: str) -> list[tuple[str, Any, Any]]:
        base = self.base[name]
        kept = {f.encode_name: f for f in msgspec.structs.fields(base)}
        fields: list[tuple[str, Any, Any]] = []
        for recorded in self.structs[name]["fields"]:
            wire = recorded["encode_name"]
            f = kept.get(wire)
            if f is not None:
                fields.append((f.name, self._field_type(name, recorded, f.type), _field_default(f)))
                continue
            # New in this release: corewire's attribute drops vLLM's leading underscore
            # (``_watermarking_skipped`` -> ``watermarking_skipped``), as protocol does.
            attribute = recorded["name"].lstrip("_")
            ftype = self.reader.type_of(recorded["type"])
            rename = {} if attribute == wire else {"name": wire}
            if "default" in recorded:
                spec = msgspec.field(default=self.reader.default(recorded["default"]), **rename)
            elif rename:
                spec = msgspec.field(**rename)
            else:
                spec = msgspec.NODEFAULT
            fields.append((attribute, ftype, spec))
        return fields

    def _struct(self, name: str) -> Any:
        base = self.base[name]
        fields = self._fields(name)
        ns: dict[str, Any] = {k: v for k, v in vars(base).items() if isinstance(v, property)}
        ns.update(self.behaviour.get(name, {}))
        ns["__doc__"] = self.docs.get(name, base.__doc__)
        config = base.__struct_config__  # type: ignore[attr-defined]
        # Keyword-only where a required field follows one with a default (msgspec's rule
        # for positional ones).
        seen_default = kw_only = False
        for _, _, default in fields:
            if default is msgspec.NODEFAULT and seen_default:
                kw_only = True
            seen_default = seen_default or default is not msgspec.NODEFAULT
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

    def _namedtuple(self, name: str) -> Any:
        base = self.base[name]
        defaults = dict(getattr(base, "_field_defaults", {}))
        hints = typing.get_type_hints(base)  # resolved where the class was written
        fields: list[tuple[str, Any]] = []
        for recorded in self.structs[name]["fields"]:
            field_name = recorded["name"]
            if field_name in base._fields:
                fields.append((field_name, hints[field_name]))
                continue
            fields.append((field_name, self.reader.type_of(recorded["type"])))
            if "default" in recorded:
                defaults[field_name] = self.reader.default(recorded["default"])
        cls = NamedTuple(base.__name__, fields)  # type: ignore[misc]
        names = [n for n, _ in fields]
        tail = names[len(names) - len(defaults) :] if defaults else []
        cls.__new__.__defaults__ = tuple(defaults[n] for n in tail) or None
        cls.__module__ = __name__
        cls.__doc__ = self.docs.get(name, base.__doc__)
        return cls


def _edited_table(release: str, base: str) -> types.MappingProxyType[str, Any]:
    """corewire's classes of ``release``'s structs, edited from those of ``base`` by what
    the two records say (:class:`_Edited`), with corewire's classes of the structs new in
    ``release`` (those defined above whose wire names its record has)."""
    from corewire.releases import records
    from corewire.releases.structs import wire_names

    record = records.load(release)
    new: dict[str, Any] = {}
    ours = (SamplingMaskLists, RequestError, LateChunkingParams, KvHintsEnvelope, KvHintAction)
    for cls in ours:
        entry = record["structs"].get(cls.__name__)
        recorded = None if entry is None else tuple(f["encode_name"] for f in entry["fields"])
        if recorded is not None and wire_names(cls) == recorded:
            new[cls.__name__] = cls
    edited = _Edited(_TYPES[base], records.load(base), record, release, new).table()
    return types.MappingProxyType({**edited, **new})


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
_TYPES = {"0.25.1": V0_25_1_TYPES}
#: vLLM 0.33.0's wire structs by name: 0.25.1's edited by what the two records say.
V0_33_0_TYPES = _TYPES["0.33.0"] = _edited_table("0.33.0", "0.25.1")

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
    for name, cls in built.items():
        ours = V0_25_1_TYPES.get(name)
        if ours is not None and cls is not ours and isinstance(cls, type):
            _add_properties(cls, ours)
    return types.MappingProxyType(built)


def _add_properties(cls: type, ours: type) -> None:
    """Give ``cls`` (built from a record) the read-only properties of corewire's class of
    the same struct that name no field of it (``EngineCoreOutput.finished``...): what a
    consumer reads of the natively decoded objects, which have them in every release,
    it reads of these too (vLLM's output processor reads ``finished``)."""
    fields = set(getattr(cls, "__struct_fields__", ()))
    for attr, value in vars(ours).items():
        if isinstance(value, property) and attr not in fields and not hasattr(cls, attr):
            setattr(cls, attr, value)


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
