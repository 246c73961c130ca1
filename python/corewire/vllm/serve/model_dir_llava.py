"""A tiny LLaVA-style multimodal model directory with real random weights, written locally.

:func:`write_llava_dir` writes what vLLM's own engine loads as
``LlavaForConditionalGeneration``: a CLIP vision tower (2 layers, hidden 32, 28x28 images
in 14x14 patches: 4 image tokens per image), a projector, and the tiny llama of
:mod:`corewire.vllm.serve.model_dir` with an ``<image>`` token as the last id of its vocabulary;
a ``CLIPImageProcessor`` configured by hand and a ``LlavaProcessor``. Nothing is downloaded.

The weights come from transformers' own ``LlavaForConditionalGeneration`` built from a
seed, saved under the llava-hf layout that vLLM's loader reads
(``vision_tower.vision_model.*``, ``language_model.model.*``, ``language_model.lm_head``):
transformers 5 names them otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from corewire.vllm.serve.model_dir import ENGINE_SIZES, write_model_dir

__all__ = ["IMAGE_SIZE", "IMAGE_TOKEN", "write_llava_dir"]

IMAGE_TOKEN = "<image>"
#: The images' side in pixels (the processor resizes and crops anything to it).
IMAGE_SIZE = 28
_PATCH = 14
# CLIP's normalisation, as its published processors carry it.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _vision_config() -> dict[str, Any]:
    return {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": _PATCH,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    }


def _llava_config(text: dict[str, Any], image_token_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "text_config": {**text, "architectures": ["LlamaForCausalLM"]},
        "vision_config": _vision_config(),
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }


def _llava_hf_name(name: str) -> str:
    """A transformers-5 parameter name in the llava-hf layout vLLM's loader reads."""
    for old, new in (
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("vision_tower.vision_model.vision_model.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def write_llava_dir(
    path: str | Path, *, vocab_size: int = 1024, max_model_len: int = 512, seed: int = 0
) -> Path:
    """Write the tiny LLaVA into ``path``; returns the directory. The same ``seed``
    writes the same weights. Needs torch, transformers and safetensors (vLLM has them)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out = write_model_dir(path, vocab_size=vocab_size, max_model_len=max_model_len)
    text = json.loads((out / "config.json").read_text()) | ENGINE_SIZES
    # The last id of the vocabulary becomes the image token.
    image_token_id = vocab_size - 1
    _add_image_token(out, image_token_id)
    config = _llava_config(text, image_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(LlavaConfig(**config)).eval()
    with torch.no_grad():
        # A wide output head, as write_weights draws it: greedy answers far from ties.
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    tensors = {
        _llava_hf_name(name): tensor.detach().contiguous().clone()
        for name, tensor in model.state_dict().items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_processor(out)
    return out


def _add_image_token(out: Path, image_token_id: int) -> None:
    """Make id ``image_token_id`` the special ``<image>`` token of the tokenizer."""
    from corewire.vllm.serve.model_dir import _tokenizer_json, build_vocabulary

    vocab = build_vocabulary(image_token_id + 1)
    vocab.pop(next(t for t, i in vocab.items() if i == image_token_id))
    vocab[IMAGE_TOKEN] = image_token_id
    (out / "tokenizer.json").write_text(_tokenizer_json(vocab, (IMAGE_TOKEN,)))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["extra_special_tokens"] = {"image_token": IMAGE_TOKEN}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _write_processor(out: Path) -> None:
    files = {
        "preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": IMAGE_SIZE},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": _CLIP_MEAN,
            "image_std": _CLIP_STD,
            "do_convert_rgb": True,
        },
        "processor_config.json": {
            "processor_class": "LlavaProcessor",
            "patch_size": _PATCH,
            "vision_feature_select_strategy": "default",
            "image_token": IMAGE_TOKEN,
            "num_additional_image_tokens": 1,
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
