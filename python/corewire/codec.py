"""Encoding and decoding of engine-core frames.

- :class:`Encoder` turns a wire struct into ``[payload, aux_1, ...]``: msgspec msgpack,
  with arrays and tensors of 256 bytes or more sent as zero-copy aux frames (as vLLM
  0.25.1's ``MsgpackEncoder``: 0-d arrays always inline, non-CPU tensors always aux).
- :class:`MsgspecDecoder` is the reference decoder in Python + msgspec, built the way
  vLLM's is: an in-house baseline of the benchmarks (vLLM's own decoder is the main one)
  and the oracle of the tests.
- ``NativeDecoder`` (re-exported from the Rust extension) decodes ``EngineCoreOutputs``
  frames several times faster; arrays in aux frames are zero-copy views, the tiny inline
  logprobs arrays owned copies (recycled in place once nothing holds them).

Nothing is ever pickled: an object that has no wire form raises ``TypeError``.

Wire format: docs/protocol.md §4-§6 (frames, array and tensor layout, inline or aux) and
§9.1 (what a decoder refuses).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from corewire import releases
from corewire._native import NativeDecoder
from corewire.errors import ProtocolError
from corewire.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    Tensor,
    UtilityResult,
    utility_result_wire,
)
from corewire.wire.layouts import types_for, version_of


def _torch_if_imported() -> Any:
    """torch where something imported it already, else None: a tensor can exist only
    then, so encoding never imports it (corewire.protocol.Tensor)."""
    return sys.modules.get("torch")


def _torch_for_a_tensor() -> Any:
    """torch, imported on the first tensor to decode; a clear error where it is not
    installed."""
    try:
        import torch
    except ImportError as exc:
        raise ProtocolError("a tensor arrived, but torch is not installed") from exc
    return torch


__all__ = [
    "INLINE_THRESHOLD",
    "RAW_VIEW_EXT",
    "Encoder",
    "MsgspecDecoder",
    "NativeDecoder",
    "native_decoder",
    "request_decoder",
]

#: Arrays smaller than this many bytes travel inline as extension type 3.
INLINE_THRESHOLD = 256
#: msgpack extension type code holding raw C-contiguous array bytes.
RAW_VIEW_EXT = 3

Buffer = bytes | bytearray | memoryview


class Encoder:
    """Encodes wire structs into a list of frames, arrays as zero-copy aux frames.

    ``release`` is the vLLM version whose wire it writes (any release of
    ``corewire.releases.SUPPORTED``; default ``corewire.releases.DEFAULT``, the installed
    vLLM's release, else the newest): the structs of that version
    (``corewire.wire.layouts.types_for``) encode byte for byte as that vLLM's
    ``MsgpackEncoder`` writes them. ``corewire.protocol``'s ``EngineCoreOutputs`` and
    ``EngineCoreRequest`` (0.25.1's layout, what engines and callers build) are converted
    into the release's layout first, as corewire's engines and clients convert them. Any
    other struct whose layout belongs to another version is refused (``TypeError``) rather
    than sent in a layout the peer would misread; the check is on the object passed in
    (not on structs nested in it).

    The returned aux frames are views of the caller's arrays: they must stay alive and
    unmodified until ZeroMQ has sent them (send with ``copy=False, track=True``).
    """

    def __init__(
        self,
        inline_threshold: int = INLINE_THRESHOLD,
        *,
        release: str | None = None,
        protocol: str | None = None,
    ) -> None:
        # protocol=: the deprecated name of release=.
        self.release = releases.get(releases.named(release, protocol, "Encoder"))
        self._inline_threshold = inline_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        # Set for the duration of one encode() call; the hook appends to it.
        self._aux: list[Buffer] | None = None
        # The converters of 0.25.1 structs into this release's layout, once needed.
        self._convert: tuple[Any, Any] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        """Encode ``obj``; returns ``[payload, aux_1, aux_2, ...]``."""
        obj = self._in_layout(obj)
        frames: list[Buffer] = [b""]
        self._aux = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._aux = None
        return frames

    def encode_into(self, obj: Any, buf: bytearray) -> list[Buffer]:
        """Like :meth:`encode`, but writes the payload into ``buf`` (reused storage).

        The caller must not reuse ``buf`` until ZeroMQ is done with the previous send.
        """
        obj = self._in_layout(obj)
        frames: list[Buffer] = [buf]
        self._aux = frames
        try:
            self._encoder.encode_into(obj, buf)
        finally:
            self._aux = None
        return frames

    def _in_layout(self, obj: Any) -> Any:
        """``obj`` in this encoder's release layout: as it is, converted (a 0.25.1
        message or request), or refused."""
        cls = type(obj)
        version = version_of(cls)
        # A hand-kept class also lays out the releases that left its struct alone.
        if (
            version is not None
            and version != self.release
            and types_for(self.release).get(cls.__name__) is not cls
        ):
            name = cls.__name__
            if cls is EngineCoreOutputs or cls is EngineCoreRequest:
                # corewire.protocol's own, what engines and callers build.
                return self._converted(obj)
            raise TypeError(
                f"a vLLM {version} {name} cannot be sent by a release={self.release!r} "
                f"encoder (corewire.wire.layouts.types_for({self.release!r})[{name!r}] can)"
            )
        return obj

    def _converted(self, obj: Any) -> Any:
        # Made once per encoder, on the first 0.25.1 struct it is handed.
        if self._convert is None:
            from corewire.wire.outputs import output_converter
            from corewire.wire.requests import request_writer

            to_outputs = output_converter(self.release)
            to_request = request_writer(self.release)
            self._convert = (to_outputs, to_request)
        to_outputs, to_request = self._convert
        convert = to_outputs if isinstance(obj, EngineCoreOutputs) else to_request
        return obj if convert is None else convert(obj)

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        torch = _torch_if_imported()
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        if isinstance(obj, UtilityResult):
            # type_info is always nil: typed results would need pickle or peer-named imports.
            return utility_result_wire(obj)
        if isinstance(obj, (set, frozenset)):
            return list(obj)
        raise TypeError(f"corewire cannot encode objects of type {type(obj).__name__}")

    def _encode_ndarray(self, arr: np.ndarray) -> list[Any]:
        if arr.dtype.hasobject or arr.dtype.kind == "V":
            # vLLM would pickle these; nothing on the wire is pickled.
            raise TypeError(f"{arr.dtype} arrays cannot be sent (nothing on the wire is pickled)")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        # A flat byte view: memoryview.cast refuses shapes with zeros, reshape(-1) does not.
        raw = arr.reshape(-1).view(np.uint8)
        # As vLLM: 0-d arrays always travel inline, whatever the threshold.
        inline = arr.ndim == 0 or raw.nbytes < self._inline_threshold
        return [arr.dtype.str, list(arr.shape), self._data_ref(raw.data, inline)]

    def _encode_tensor(self, tensor: Any) -> list[Any]:
        # As vLLM: only CPU tensors may travel inline; others always take an aux frame.
        on_cpu = tensor.device.type == "cpu"
        if not on_cpu:
            tensor = tensor.cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        # View as bytes: numpy has no bfloat16, and this never copies a contiguous tensor.
        raw = tensor.contiguous().reshape(-1).view(_torch_if_imported().uint8).numpy()
        inline = on_cpu and raw.nbytes < self._inline_threshold
        return [dtype, list(tensor.shape), self._data_ref(raw.data, inline)]

    def _data_ref(self, data: memoryview, inline: bool) -> Any:
        if inline:
            return msgspec.msgpack.Ext(RAW_VIEW_EXT, data.tobytes())
        assert self._aux is not None  # only reachable from inside encode()
        self._aux.append(data)
        return len(self._aux) - 1


class MsgspecDecoder:
    """Reference decoder: msgspec plus Python hooks for arrays, tensors and results.

    ``decode(frames)`` takes ``[payload, aux_1, ...]`` (``bytes``, ``memoryview`` or
    ``zmq.Frame``) or a single buffer. Array data in aux frames are views, not copies.
    Malformed input raises :class:`corewire.ProtocolError`.
    """

    def __init__(self, t: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._aux: Sequence[Any] = ()

    def decode(self, frames: Any) -> Any:
        """Decode one message."""
        if isinstance(frames, (list, tuple)):
            if not frames:
                raise ProtocolError("empty message: no payload frame")
            self._aux = frames
            payload = frames[0]
        else:
            self._aux = (frames,)
            payload = frames
        try:
            return self._decoder.decode(_as_buffer(payload))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(str(exc)) from exc
        except RecursionError as exc:
            # Deeply nested input is malformed input, not a crash of the caller.
            raise ProtocolError(f"message nested too deeply: {exc}") from exc
        finally:
            self._aux = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == RAW_VIEW_EXT:
            return data
        raise ProtocolError(f"unknown msgpack extension type {code}")

    def _dec_hook(self, t: type, obj: Any) -> Any:
        if t is np.ndarray:
            return self._decode_ndarray(obj)
        # corewire's structs name Tensor; vLLM's (the plugin's) name torch.Tensor itself.
        if t is Tensor or t is getattr(_torch_if_imported(), "Tensor", None):
            return self._decode_tensor(obj)
        if t is UtilityResult:
            return self._decode_utility_result(obj)
        raise ProtocolError(f"no decoder for type {t!r}")

    def _array_bytes(self, obj: Any) -> tuple[str, list[int], Any]:
        if not isinstance(obj, (list, tuple)) or len(obj) != 3:
            raise ProtocolError(f"an array must be [dtype, shape, data], got {obj!r:.80}")
        dtype, shape, data = obj
        if not isinstance(dtype, str) or not isinstance(shape, (list, tuple)):
            raise ProtocolError("array dtype must be a str and shape an array")
        if isinstance(data, int) and not isinstance(data, bool):
            if not 1 <= data < len(self._aux):
                raise ProtocolError(
                    f"aux index {data} out of range ({len(self._aux) - 1} aux frames)"
                )
            data = memoryview(_as_buffer(self._aux[data]))
        elif not isinstance(data, memoryview):
            raise ProtocolError("array data must be an aux index or extension type 3")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ProtocolError(f"bad array shape {shape!r}")
        return dtype, list(shape), data

    def _decode_ndarray(self, obj: Any) -> np.ndarray:
        dtype_str, shape, data = self._array_bytes(obj)
        try:
            dtype = np.dtype(dtype_str)
        except (TypeError, ValueError, SyntaxError) as exc:  # numpy parses some strings as code
            raise ProtocolError(f"unknown ndarray dtype {dtype_str!r}") from exc
        if dtype.hasobject:
            raise ProtocolError("object dtype is not allowed on the wire")
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize != data.nbytes:
            need = count * dtype.itemsize
            raise ProtocolError(
                f"{dtype_str} array of shape {shape} needs {need} bytes, got {data.nbytes}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def _decode_tensor(self, obj: Any) -> Any:
        dtype_str, shape, data = self._array_bytes(obj)
        torch = _torch_for_a_tensor()
        torch_dtype = getattr(torch, dtype_str, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ProtocolError(f"unknown tensor dtype {dtype_str!r}")
        count = 1
        for d in shape:
            count *= d
        if count * torch_dtype.itemsize != data.nbytes:
            need = count * torch_dtype.itemsize
            raise ProtocolError(
                f"{dtype_str} tensor of shape {shape} needs {need} bytes, got {data.nbytes}"
            )
        if data.nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        with warnings.catch_warnings():
            # Received frames are read-only buffers; torch warns but shares them (zero copy).
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        return raw.view(torch_dtype).view(shape)

    def _decode_utility_result(self, obj: Any) -> UtilityResult:
        if not isinstance(obj, (list, tuple)) or len(obj) != 2:
            raise ProtocolError("a utility result must be [type_info, value]")
        return UtilityResult(obj[1])


def _as_buffer(frame: Any) -> Any:
    """The bytes-like contents of a frame (``zmq.Frame`` exposes ``.buffer``)."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    buffer = getattr(frame, "buffer", None)
    if buffer is not None:
        return buffer
    raise ProtocolError(f"a frame must be bytes-like, got {type(frame).__name__}")


def native_decoder(release: str | None = None, **kwargs: Any) -> NativeDecoder:
    """A ``NativeDecoder`` of ``release``'s outputs (None: the default release), the
    positions of the fields it reads taken from the release's record
    (``Release.native_layout``); ``kwargs``: its other arguments. Raises ``ValueError``
    naming the field when the release has one the native decoder cannot read."""
    release = releases.get(release)
    return NativeDecoder(release=release.name, layout=release.native_layout, **kwargs)


def request_decoder(release: str | None, *, for_engine: bool = False) -> Any:
    """A decoder of ``release``'s ``EngineCoreRequest`` frames (``[payload, aux...]``):
    a :class:`MsgspecDecoder`, whose arrays in aux frames (``prompt_embeds``,
    0.33.0's ``prompt_logprob_token_ids``) are views of those frames. The 0.33.0 decoder
    raises ``ProtocolError`` for a 0.25.1 ``LoRARequest``; the 0.25.1 request keeps its
    ``lora_request`` untyped, so a 0.33.0 LoRA reaches it as a plain list. The field
    count alone is not checked, as vLLM's decoder does not.

    ``for_engine``: a packed prompt (an int32 ndarray, vLLM 0.34.0 on) reaches the caller
    as a list of ints, as engines read prompts; otherwise requests decode as vLLM's
    decoder reads them (the ndarray kept, a view of its aux frame)."""
    decoder = MsgspecDecoder(types_for(release)["EngineCoreRequest"])
    if for_engine and releases.get(release).packs_prompts:
        return _UnpackingDecoder(decoder)
    return decoder


class _UnpackingDecoder:
    """A request decoder that hands engines each packed prompt (an int32 ndarray, vLLM
    0.34.0 on) as a list of ints, as every engine reads prompts: ``list(ndarray)`` would
    give numpy scalars, which msgspec does not write back (an engine echoing a prompt
    token would fail), and a view of an aux frame would keep the frame alive."""

    __slots__ = ("_decoder",)

    def __init__(self, decoder: Any) -> None:
        self._decoder = decoder

    def decode(self, frames: Any) -> Any:
        """Decode one request; an ndarray prompt becomes a list of ints."""
        request = self._decoder.decode(frames)
        prompt = request.prompt_token_ids
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
                raise ProtocolError(
                    f"prompt_token_ids: expected a 1-D integer array, got {prompt.dtype}"
                    f" of shape {prompt.shape}"
                )
            request.prompt_token_ids = prompt.tolist()
        return request
