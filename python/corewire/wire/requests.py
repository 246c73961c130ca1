"""What a client sends, in its engines' wire version: requests and versioned utility arguments.

A client with ``release="0.25.1"`` sends what it is given, unchanged: this module is not
on its path. A client with ``release="0.33.0"`` takes either a
``corewire.protocol.EngineCoreRequest`` (0.25.1's struct, what existing callers build),
which it converts, or a request already in 0.33.0's layout, which it sends as given:
``corewire.wire.layouts.types_for("0.33.0")["EngineCoreRequest"]``, or vLLM 0.33.0's own
``EngineCoreRequest`` (what vLLM's ``AsyncLLM`` hands the plugin's client). Either way
0.33.0's 22-field layout goes out: :func:`request_writer` returns the converter.

The conversion is by field name, once per request: the top-level struct and its
``PoolingParams`` are rebuilt as 0.33.0's (the fields 0.33.0 adds take their defaults);
other values are shared, not copied (a ``prompt_embeds`` tensor still travels as a
zero-copy aux frame). ``SamplingParams`` is a map whose 0.33.0 keys are 0.25.1's plus new
ones (absent here, so omitted), with one key moved and two lists deduplicated; so it is
rebuilt as 0.33.0's (running 0.33.0's normalisations, as vLLM 0.33.0's ``SamplingParams``
built from the same arguments would) only when its bytes would differ: a non-default
``routed_experts_prompt_start``, or repeated ``stop_token_ids`` or ``bad_words``.
Otherwise the same object is written, which costs nothing (rebuilding it is two thirds
of a conversion). Either way the bytes are those vLLM 0.33.0's front-end writes for the
same request.

A LoRA is the one layout that does not decode across versions (0.33.0 removed
``tensorizer_config_dict``, index 4): 0.25.1's :class:`corewire.wire.layouts.LoRARequest`,
or the 7-element list a 0.25.1 request decoder leaves, is converted; one that carries a
``tensorizer_config_dict`` is refused (0.33.0 has no place for it); any other LoRA
(0.33.0's struct, vLLM's own) is sent as given. The same holds for the ``add_lora``
utility's argument (:func:`utility_args_writer`). Releases before 0.32.0 keep 0.25.1's
LoRA: there it goes as it is.

Wire format: docs/protocol.md §11 and docs/vllm-0.33.0-notes.md §2.1, §2.9-§2.11.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from corewire import protocol as p
from corewire.releases import get as get_release
from corewire.wire import layouts

__all__ = ["WRITERS", "converted_writer", "request_writer", "utility_args_writer"]

_asdict = msgspec.structs.asdict
_T = layouts.types_for("0.33.0")
_REQUEST: Any = _T["EngineCoreRequest"]
_SAMPLING: Any = _T["SamplingParams"]
_POOLING: Any = _T["PoolingParams"]
_LORA: Any = _T["LoRARequest"]
# 0.25.1's LoRA as a 0.25.1 request decoder leaves it: a plain array of 7.
_LORA_0_25_1_LEN = len(layouts.LoRARequest.__struct_fields__)
_TENSORIZER_AT = layouts.LoRARequest.__struct_fields__.index("tensorizer_config_dict")
# The one 0.25.1 key whose place in the map differs in 0.33.0 (written unless default).
_ROUTED_DEFAULT = next(
    f.default
    for f in msgspec.structs.fields(p.SamplingParams)
    if f.name == "routed_experts_prompt_start"
)


def request_writer(release: str | None) -> Callable[[Any], Any] | None:
    """The function that turns a request into what a ``release`` client sends, or None
    when requests are sent as given (0.25.1: its encoder refuses a 0.33.0 request): the
    writer of :data:`WRITERS` that stands for the release."""
    release = get_release(release)
    return release.choose(WRITERS)(release)


def utility_args_writer(
    release: str | None,
) -> Callable[[str, tuple[Any, ...]], tuple[Any, ...]] | None:
    """The function that turns a utility call's arguments into what a ``release`` client
    sends (only ``add_lora``'s LoRA differs between versions), or None when they are sent
    as given (0.25.1)."""
    release = get_release(release)
    if release.speaks_protocol_structs or _keeps_tensorizer(release):
        return None
    return _utility_args_0_33_0


def _keeps_tensorizer(release: Any) -> bool:
    """Whether ``release``'s ``LoRARequest`` is 0.25.1's (with ``tensorizer_config_dict``
    at index 4: every release before 0.32.0), so that a 0.25.1 LoRA goes as it is."""
    lora = layouts.types_for(release).get("LoRARequest")
    return lora is not None and "tensorizer_config_dict" in lora.__struct_fields__


def as_given(release: Any) -> Callable[[Any], Any]:
    """The writer of a release whose requests corewire does not convert (one recorded but
    not verified): requests in the release's own layout (``types_for(release)``, or vLLM's
    own) go as given; corewire's 0.25.1 struct, which that release would misread, is
    refused with a ``TypeError`` naming what to send instead."""

    # A release whose requests are laid out as 0.25.1's takes corewire's struct as it is.
    own = layouts.types_for(release)["EngineCoreRequest"]

    def write(request: Any) -> Any:
        if type(request) is p.EngineCoreRequest and own is not p.EngineCoreRequest:
            raise TypeError(
                f"vLLM {release.name}'s engines read its own EngineCoreRequest: build it with "
                f"corewire.wire.layouts.types_for({release.name!r})['EngineCoreRequest']"
            )
        return request

    return write


def converted_writer(release: Any) -> Callable[[Any], Any]:
    """The writer of a release whose requests are 0.33.0's by field name but whose
    nested structs may lack 0.33.0's later fields (vLLM 0.27.0-0.32.0: ``PoolingParams``
    without ``late_chunking_params``; before 0.32.0, 0.25.1's ``LoRARequest``): corewire's
    0.25.1 struct is converted as for 0.33.0 and rebuilt in the release's own layout
    (fields 0.33.0 added, which a 0.25.1 struct leaves at their defaults, dropped; the
    LoRA left as it is where the release's is 0.25.1's); anything else goes as given."""
    types = layouts.types_for(release)
    target, pooling = types["EngineCoreRequest"], types["PoolingParams"]
    pooling_fields = set(pooling.__struct_fields__)
    # Before 0.32.0 a request lacks 0.33.0's session_id and kv_hints (a 0.25.1 struct
    # leaves them at their defaults).
    request_fields = set(target.__struct_fields__)
    keeps_tensorizer = _keeps_tensorizer(release)
    # Where the release writes routed_experts_prompt_start: 0.25.1's place (before
    # bad_words) until 0.28.0, 0.33.0's (last but one) from 0.29.0 on. Every release
    # that moved it also drops repeated stops, as 0.33.0's rebuild does.
    own_order = types["SamplingParams"].__struct_fields__
    moved = own_order.index("routed_experts_prompt_start") > own_order.index("bad_words")
    drops_repeats = release.drops_repeated_stops

    def own_sampling(sampling: Any) -> Any:
        if type(sampling) is not p.SamplingParams:
            return sampling
        if moved:
            return sampling_0_33_0(sampling)
        if drops_repeats and not _no_repeats(sampling):
            # 0.28.0: 0.25.1's order, each stop once.
            return msgspec.structs.replace(
                sampling,
                stop_token_ids=_once(sampling.stop_token_ids),
                bad_words=_once(sampling.bad_words),
            )
        return sampling

    def write(request: Any) -> Any:
        if type(request) is not p.EngineCoreRequest:
            return request
        fields = _asdict(to_0_33_0(request))
        if keeps_tensorizer:
            # Before 0.32.0 the LoRA is 0.25.1's: it goes as it is.
            fields["lora_request"] = request.lora_request
        fields["sampling_params"] = own_sampling(request.sampling_params)
        params = fields["pooling_params"]
        if params is not None and type(params) is not pooling:
            kept = {k: v for k, v in _asdict(params).items() if k in pooling_fields}
            fields["pooling_params"] = pooling(**kept)
        return target(**{k: v for k, v in fields.items() if k in request_fields})

    return write


def packed_writer(release: Any) -> Callable[[Any], Any]:
    """The writer of a release whose requests are 0.33.0's with fields appended and whose
    prompts travel packed (vLLM 0.34.0): corewire's 0.25.1 struct is converted as for
    0.33.0 and rebuilt in the release's layout, and every list prompt (vLLM's own
    requests' too, as vLLM's client packs them) goes as an int32 ndarray."""
    import numpy as np

    target = layouts.types_for(release)["EngineCoreRequest"]
    replace = msgspec.structs.replace

    def write(request: Any) -> Any:
        if type(request) is p.EngineCoreRequest:
            request = target(**_asdict(to_0_33_0(request)))
        prompt = request.prompt_token_ids
        if type(prompt) is list:
            # array('i') then a view, as vLLM 0.34.0's _with_packed_prompt: no Python int
            # per token on either side; the caller's request keeps its list.
            packed = np.frombuffer(_int32_array(prompt), dtype=np.int32)
            request = replace(request, prompt_token_ids=packed)
        return request

    return write


def _int32_array(values: list[int]) -> Any:
    from array import array

    return array("i", values)


def _utility_args_0_33_0(method: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if method == "add_lora" and args:
        return (lora_0_33_0(args[0]), *args[1:])
    return args


def to_0_33_0(request: Any) -> Any:
    """``request`` as vLLM 0.33.0's ``EngineCoreRequest``: corewire's 0.25.1 struct is
    converted; anything else (0.33.0's struct, vLLM 0.33.0's own) is returned as is,
    for the encoder to write or refuse.

    Raises ``ValueError`` for a LoRA 0.33.0 cannot express.
    """
    if type(request) is not p.EngineCoreRequest:
        return request
    fields = _asdict(request)
    sampling = fields["sampling_params"]
    if sampling is not None:
        fields["sampling_params"] = sampling_0_33_0(sampling)
    pooling = fields["pooling_params"]
    if pooling is not None and type(pooling) is not _POOLING:
        fields["pooling_params"] = _POOLING(**_asdict(pooling))
    if fields["lora_request"] is not None:
        fields["lora_request"] = lora_0_33_0(fields["lora_request"])
    return _REQUEST(**fields)


def sampling_0_33_0(sampling: Any) -> Any:
    """What to write for ``sampling`` in a 0.33.0 request: corewire's 0.25.1 struct as
    is when its map is already 0.33.0's bytes, else rebuilt as 0.33.0's; anything else
    (0.33.0's struct) as is."""
    if type(sampling) is not p.SamplingParams:
        return sampling
    if (
        sampling.routed_experts_prompt_start == _ROUTED_DEFAULT
        and _unique(sampling.stop_token_ids)
        and _unique(sampling.bad_words)
    ):
        return sampling
    return _SAMPLING(**_asdict(sampling))


def _once(values: Any) -> Any:
    return values if values is None else list(dict.fromkeys(values))


def _no_repeats(sampling: Any) -> bool:
    return _unique(sampling.stop_token_ids) and _unique(sampling.bad_words)


def _unique(values: Any) -> bool:
    return values is None or len(values) < 2 or len(set(values)) == len(values)


def lora_0_33_0(lora: Any) -> Any:
    """``lora`` in vLLM 0.33.0's 6-field layout: from 0.25.1's ``LoRARequest`` struct or
    the 7-element array a 0.25.1 decoder leaves (``tensorizer_config_dict`` dropped: it
    must be nil); anything else (0.33.0's struct, vLLM's own) as is."""
    if type(lora) is layouts.LoRARequest:
        values = list(msgspec.structs.astuple(lora))
    elif isinstance(lora, (list, tuple)) and len(lora) == _LORA_0_25_1_LEN:
        values = list(lora)
    else:
        return lora
    if values.pop(_TENSORIZER_AT) is not None:
        raise ValueError(
            "vLLM 0.33.0's LoRARequest has no tensorizer_config_dict: this LoRA cannot "
            "be sent to a 0.33.0 engine"
        )
    return _LORA(*values)


def _writer_0_25_1(release: Any) -> Callable[[Any], Any] | None:
    # corewire's own structs are this wire; a release only recorded, not verified, whose
    # requests are laid out otherwise takes requests in its own layout only.
    return None if release.speaks_protocol_structs else as_given(release)


def _writer_0_33_0(release: Any) -> Callable[[Any], Any]:
    # Held to 0.33.0's own front-end: a later release it stands for gets its own layout.
    return to_0_33_0 if release.written_for else as_given(release)


def _writer_0_34_0(release: Any) -> Callable[[Any], Any]:
    # A later release it stands for packs prompts as its record says (a newer release
    # adopted live: corewire.releases.installed).
    if release.written_for or release.packs_prompts:
        return packed_writer(release)
    return as_given(release)


#: Each release's request writer, made for a release, by the release it was written for
#: (``Release.choose``): from 0.27.0 on, corewire's 0.25.1 struct is converted into the
#: release's own layout by field name.
WRITERS: dict[str, Callable[[Any], Callable[[Any], Any] | None]] = {
    "0.25.1": _writer_0_25_1,
    "0.27.0": converted_writer,
    "0.33.0": _writer_0_33_0,
    "0.34.0": _writer_0_34_0,
}
