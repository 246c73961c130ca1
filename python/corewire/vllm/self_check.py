"""The plugin's self-check: corewire's wire against the installed vLLM's own encoder and
decoder, before corewire's client goes into vLLM.

First the layouts: every struct the installed vLLM puts on the wire, read off its own
classes (``corewire.releases.derive``), must be what the release's record says, field by
field. Then representative messages go both ways through both implementations:

- **outputs** (engine -> front-end): vLLM's own ``EngineCoreOutputs`` (token ids, a
  finished output with a stop reason, small logprobs inline and large ones as aux frames)
  encoded by vLLM's ``MsgpackEncoder`` and decoded by vLLM's ``MsgpackDecoder`` and by the
  release's ``NativeDecoder``: every field vLLM's structs declare must read the same.
- **requests** (front-end -> engine): vLLM's own ``EngineCoreRequest`` (a short prompt and
  one long enough for an aux frame once packed) as vLLM's client writes it and as
  corewire's client writes it (the release's request writer and ``Encoder``): the frames
  must be the same bytes.

:func:`first_difference` names the first field that differs (or the error that stopped a
side), None when everything agrees; it never raises. The plugin keeps vLLM's own client
when it finds one (``corewire.vllm.plugin``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

__all__ = ["first_difference"]


def first_difference(release: Any) -> str | None:
    """Where corewire's wire for ``release`` differs from the installed vLLM's, in a few
    words naming the message and field; None when it does not."""
    try:
        for check in (_layout_difference, _outputs_difference, _requests_difference):
            found = check(release)
            if found is not None:
                return found
    except Exception as exc:  # a failed check is a difference, never a crash
        return f"the self-check itself failed: {type(exc).__name__}: {exc}"
    return None


# -- the layouts --------------------------------------------------------------------------


def _layout_difference(release: Any) -> str | None:
    import json

    from corewire.releases import derive, records

    if release.name not in records.shipped():
        return None  # read live (a newer release): its messages below are the check
    # Through JSON, as records are stored (tuples become lists).
    live = json.loads(json.dumps(derive.derive()))
    recorded = records.load(release.name)
    for table in ("structs", "enums"):
        theirs, ours = live[table], recorded[table]
        for name in sorted(set(theirs) | set(ours)):
            if name not in ours:
                return f"vLLM's {name} is not in corewire's record of {release.name}"
            if name not in theirs:
                return f"corewire's record of {release.name} has a {name} vLLM lacks"
            if theirs[name] != ours[name]:
                return f"the layout of {_first_field(name, theirs[name], ours[name])} differs"
    return None


def _first_field(name: str, theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """``Struct.field`` where two layouts of one struct first differ (``Struct`` when it
    is not a field)."""
    fields = zip(theirs.get("fields", ()), ours.get("fields", ()), strict=False)
    for mine, recorded in fields:
        if mine != recorded:
            return f"{name}.{mine.get('name')}"
    if len(theirs.get("fields", ())) != len(ours.get("fields", ())):
        longer = max(theirs.get("fields", ()), ours.get("fields", ()), key=len)
        return f"{name}.{longer[min(len(theirs['fields']), len(ours['fields']))]['name']}"
    return name


# -- engine -> front-end ------------------------------------------------------------------


def _output_messages() -> Iterator[tuple[str, Any]]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.outputs import LogprobsLists

    def logprobs(rows: int, width: int) -> Any:
        ids = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
        values = -np.linspace(0.0, 5.0, rows * width, dtype=np.float32).reshape(rows, width)
        return LogprobsLists(ids, values, np.arange(rows, dtype=np.int64))

    yield (
        "outputs",
        EngineCoreOutputs(
            engine_index=0,
            outputs=[
                EngineCoreOutput("self-check-a", [1, 2, 3]),
                EngineCoreOutput(
                    "self-check-b",
                    [4],
                    new_logprobs=logprobs(1, 3),
                    finish_reason=FinishReason.STOP,
                    stop_reason=7,
                ),
            ],
            finished_requests={"self-check-b"},
        ),
    )
    # Arrays of 256 bytes or more travel as aux frames.
    yield (
        "outputs with aux-frame logprobs",
        EngineCoreOutputs(
            outputs=[EngineCoreOutput("self-check-c", [5, 6], new_logprobs=logprobs(16, 6))]
        ),
    )


def _outputs_difference(release: Any) -> str | None:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from corewire.codec import native_decoder

    encoder, theirs = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    ours = native_decoder(release)
    for name, message in _output_messages():
        frames = [bytes(f) for f in encoder.encode(message)]
        want = theirs.decode(frames)
        try:
            got = ours.decode(frames)
        except Exception as exc:
            return f"{name}: corewire's decoder refused vLLM's frames ({exc})"
        where = _differs(want, got, "EngineCoreOutputs")
        if where is not None:
            return f"{name}: {where} decodes differently"
    return None


# -- front-end -> engine ------------------------------------------------------------------


def _requests() -> Iterator[tuple[str, Any]]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    for name, prompt in (("short prompt", [5, 6, 7]), ("long prompt", list(range(300)))):
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, stop=["x"])
        yield (
            f"request with a {name}",
            EngineCoreRequest(
                request_id=f"self-check-{len(prompt)}",
                prompt_token_ids=prompt,
                mm_features=None,
                sampling_params=params,
                pooling_params=None,
                arrival_time=1.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            ),
        )


def _as_vllms_client_sends(request: Any) -> Any:
    # vLLM 0.34.0's client packs the prompt (its _with_packed_prompt); earlier ones do not.
    from vllm.v1.engine import core_client

    pack = getattr(core_client, "_with_packed_prompt", None)
    return request if pack is None else pack(request)


def _requests_difference(release: Any) -> str | None:
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from corewire.codec import Encoder
    from corewire.wire.requests import request_writer

    theirs, ours = MsgpackEncoder(), Encoder(release=release)
    writer = request_writer(release)
    decoder = MsgpackDecoder(EngineCoreRequest)
    for name, request in _requests():
        want = [bytes(f) for f in theirs.encode(_as_vllms_client_sends(request))]
        try:
            sent = request if writer is None else writer(request)
            got = [bytes(f) for f in ours.encode(sent)]
        except Exception as exc:
            return f"{name}: corewire's client could not write it ({exc})"
        if got == want:
            continue
        try:
            read = decoder.decode(got)
        except Exception as exc:
            return f"{name}: vLLM's engine could not read corewire's frames ({exc})"
        where = _differs(decoder.decode(want), read, "EngineCoreRequest")
        return f"{name}: {where or 'the encoding (same values)'} differs"
    return None


# -- comparing ----------------------------------------------------------------------------


def _differs(want: Any, got: Any, path: str) -> str | None:
    """The path of the first value in ``got`` that is not ``want``'s (vLLM's decoded
    object: its fields are the ones compared), or None."""
    if isinstance(want, enum.Enum):
        same = getattr(got, "value", got) == want.value
        return None if same else path
    if isinstance(want, np.ndarray):
        ok = isinstance(got, np.ndarray) and got.dtype == want.dtype
        return None if ok and np.array_equal(want, got) else path
    if isinstance(want, tuple) and hasattr(want, "_fields"):
        return _fields_differ(want, got, want._fields, path)
    if isinstance(want, msgspec.Struct):
        return _fields_differ(want, got, type(want).__struct_fields__, path)
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return path
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            found = _differs(w, g, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(want, (set, frozenset)):
        return None if isinstance(got, (set, frozenset)) and set(got) == set(want) else path
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return path
        for key, value in want.items():
            found = _differs(value, got[key], f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    return None if type(got) is type(want) and got == want else path


def _fields_differ(want: Any, got: Any, fields: tuple[str, ...], path: str) -> str | None:
    for field in fields:
        if not hasattr(got, field):
            return f"{path}.{field}"
        found = _differs(getattr(want, field), getattr(got, field), f"{path}.{field}")
        if found is not None:
            return found
    return None
