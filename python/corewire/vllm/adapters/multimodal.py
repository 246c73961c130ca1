"""Requests with multimodal items, written by vLLM's own encoder.

A multimodal request from vLLM's ``AsyncLLM`` carries ``mm_features``: vLLM's
``MultiModalFeatureSpec`` objects holding ``MultiModalKwargsItem`` mappings of field
elements and tensors. Their wire form is defined by the hooks of vLLM's
``MsgpackEncoder`` (and, with ``mm_tensor_ipc="torch_shm"``, by its out-of-band tensor
queue), which differ from release to release and carry vLLM's own types; corewire's encoder
knows none of them. So :class:`MultimodalRequestEncoder` hands exactly those requests to a
vLLM ``MsgpackEncoder`` made as vLLM's client makes its own (the same bytes, the same aux
frames, the same tensor queue), and everything else to corewire's encoder: text requests
keep corewire's path and pay one attribute read more.

Pickle: vLLM's encoder writes multimodal items without it, and refuses anything that
would need it unless the user sets vLLM's ``VLLM_ALLOW_INSECURE_SERIALIZATION``; then it
pickles exactly what it would under vLLM's own client (the engine is vLLM's, which asked
for it). corewire's own encoder never pickles.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["MultimodalRequestEncoder", "multimodal_encoder_for"]

logger = logging.getLogger("vllm.corewire")


class MultimodalRequestEncoder:
    """corewire's ``encoder`` (kept for all else), with requests that carry multimodal
    items encoded by vLLM's ``vllm_encoder``."""

    def __init__(self, encoder: Any, vllm_encoder: Any) -> None:
        self._encoder = encoder
        self._vllm_encoder = vllm_encoder

    def encode(self, obj: Any) -> Any:
        """The frames of ``obj``: vLLM's for a request with multimodal items, else
        corewire's."""
        if getattr(obj, "mm_features", None):
            return self._vllm_encoder.encode(obj)
        return self._encoder.encode(obj)

    def __getattr__(self, name: str) -> Any:
        # Everything else (encode_into, protocol, ...) is corewire's encoder's.
        return getattr(self._encoder, name)


def multimodal_encoder_for(encoder: Any, vllm_config: Any, tensor_queue: Any = None) -> Any:
    """``encoder`` as a client of ``vllm_config``'s model needs it: unchanged for a text
    model, a :class:`MultimodalRequestEncoder` for a multimodal one, with vLLM's tensor
    queue exactly where vLLM's client would use one (``torch_shm`` and a queue made)."""
    model_config = getattr(vllm_config, "model_config", None)
    multimodal = getattr(model_config, "multimodal_config", None)
    if multimodal is None:
        return encoder
    from vllm.v1.serial_utils import MsgpackEncoder

    shm = getattr(multimodal, "mm_tensor_ipc", "direct_rpc") == "torch_shm"
    if shm and tensor_queue is not None:
        from vllm.v1.engine.tensor_ipc import TensorIpcSender

        vllm_encoder = MsgpackEncoder(oob_tensor_consumer=TensorIpcSender(tensor_queue))
    else:
        vllm_encoder = MsgpackEncoder()
    logger.info(
        "corewire: requests with multimodal inputs are written by vLLM's own encoder "
        "(the rest by corewire's)"
    )
    return MultimodalRequestEncoder(encoder, vllm_encoder)
