"""A tiny local model directory that vLLM's API server accepts, written without downloads.

vLLM's front-end needs a model directory for its configuration and tokenizer even when the
engines are not vLLM's and load no weights. :func:`write_model_dir` writes one that matches
corewire's reference engine: a llama-style ``config.json`` (small sizes; no weights, which
a front-end-only server never reads) and a word-level tokenizer built with the
``tokenizers`` library whose vocabulary has exactly the engine's ``vocab_size`` entries,
so that every token id the engine can sample decodes to text.

The vocabulary: ids 0-3 are ``<pad>``, ``<s>``, ``</s>`` and ``<unk>`` (the reference
engine's defaults are pad 0 and eos 2), then a few hundred English words and punctuation
marks (so that prompts written by hand tokenize to something other than ``<unk>``), then
``w<id>`` fillers up to ``vocab_size``. Tokens decode joined by single spaces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "ENGINE_SIZES",
    "EOS_TOKEN",
    "FRONTEND_SIZES",
    "PAD_TOKEN",
    "UNK_TOKEN",
    "build_vocabulary",
    "write_model_dir",
    "write_weights",
]

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
_SPECIALS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3

# Words a hand-written prompt is likely to use; anything else maps to <unk>. The chat
# template's role names and ":" are here so that a rendered chat never hits <unk>.
_WORD_TEXT = """
. , : ; ! ? ' " - ( ) [ ] / * + = # @ & % $ 0 1 2 3 4 5 6 7 8 9 10 100
system user assistant tool
the a an and or but not no yes if then else of to in on at by for with from as into over
under up down out about after before again all any are is was were be been being am do
does did done have has had having i you he she it we they me him her us them my your his
its our their this that these those what which who whom whose when where why how there
here can could will would shall should may might must one two three four five six seven
eight nine ten first last next new old big small long short good bad best more most less
some many much few each every other same such only own very just also too so than now
hello hi hey please thanks thank say tell write read give take make go come see look know
think want need like use find get put keep let begin start stop end run turn show try ask
work call move live believe hold bring happen play feel seem leave mean set help talk
story poem word words sentence number numbers list name time day year people way thing
man woman child world life hand part place case week company system program question
government home water room mother area money fact night point book eye job friend side
house kind head father power hour game line member car city team minute idea body back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education once upon count
quick brown fox jumps lazy dog cat red green blue black white sun moon star sky sea
"""
_WORDS = _WORD_TEXT.split()

# A small chat template: "role : content" lines, then "assistant :" for the reply.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }} : {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def build_vocabulary(vocab_size: int, markers: tuple[str, ...] = ()) -> dict[str, int]:
    """The token -> id map of the tokenizer: specials, ``markers``, words, then ``w<id>``
    fillers.

    Raises ``ValueError`` when ``vocab_size`` cannot hold the four special tokens and the
    markers.
    """
    if vocab_size < len(_SPECIALS) + len(markers):
        raise ValueError(
            f"vocab_size must be at least {len(_SPECIALS) + len(markers)}, got {vocab_size}"
        )
    vocab: dict[str, int] = {}
    for token in (*_SPECIALS, *markers, *_WORDS):
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(token, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    return vocab


def _tokenizer_json(
    vocab: dict[str, int], extra_specials: tuple[str, ...] = (), markers: tuple[str, ...] = ()
) -> str:
    # Imported here: `tokenizers` comes with vLLM / transformers, not with corewire.
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins tokens with a space (no "##" pieces exist here); no cleanup,
    # so that the text of a token stream is exactly the tokens joined by spaces.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    specials = (*_SPECIALS, *extra_specials)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # Markers are whole tokens in a prompt and stay in the text, as a reasoning model's
    # <think> does.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    return tokenizer.to_str(pretty=True)


#: The sizes of a weightless directory: only self-consistent (a front-end reads them,
#: nothing computes with them).
FRONTEND_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
#: The sizes of a directory with weights, which vLLM's own engine loads and runs: small
#: enough for a 2-core CPU, in shapes its CPU attention kernels take.
ENGINE_SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
}


def _config(
    vocab_size: int,
    max_model_len: int,
    eos_token_id: int,
    pad_token_id: int,
    bos_token_id: int,
    sizes: dict[str, int],
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **sizes,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_model_len,
        "vocab_size": vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def write_model_dir(
    path: str | Path,
    *,
    vocab_size: int = 4096,
    max_model_len: int = 2048,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
    weights_seed: int | None = None,
    markers: tuple[str, ...] = (),
) -> Path:
    """Write a tiny model directory for vLLM's front-end into ``path`` (created if missing).

    ``weights_seed``: also write random weights drawn from that seed
    (``model.safetensors``, :func:`write_weights`), in :data:`ENGINE_SIZES`, so that vLLM's
    own engine loads and runs the model; without it the directory has no weights and
    :data:`FRONTEND_SIZES`, for a server whose engines are not vLLM's.

    ``vocab_size``, ``max_model_len``, ``eos_token_id`` and ``pad_token_id`` must match the
    engines behind the server (the defaults are the reference engine's). The eos and pad ids
    must be those of the tokenizer's special tokens, ``</s>`` = 2 and ``<pad>`` = 0, so
    other values raise ``ValueError``. Files written: ``config.json``, ``tokenizer.json``,
    ``tokenizer_config.json`` (``PreTrainedTokenizerFast`` with :data:`CHAT_TEMPLATE`),
    ``special_tokens_map.json`` and ``generation_config.json``. ``markers``: tokens (such
    as a reasoning model's ``<think>`` and ``</think>``) given the ids after the special
    ones, whole in prompts and kept in the text. Returns the directory.
    """
    vocab = build_vocabulary(vocab_size, markers)
    if eos_token_id != vocab[EOS_TOKEN] or pad_token_id != vocab[PAD_TOKEN]:
        raise ValueError(
            f"the tokenizer's eos id is {vocab[EOS_TOKEN]} and pad id {vocab[PAD_TOKEN]}; "
            f"got eos_token_id={eos_token_id}, pad_token_id={pad_token_id}"
        )
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    bos_token_id = vocab[BOS_TOKEN]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {
        "config.json": _config(
            vocab_size,
            max_model_len,
            eos_token_id,
            pad_token_id,
            bos_token_id,
            FRONTEND_SIZES if weights_seed is None else ENGINE_SIZES,
        ),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": UNK_TOKEN,
            "model_max_length": max_model_len,
            # No <s> in front of prompts: the token ids a client sends are the ids it gets.
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": UNK_TOKEN,
        },
        "generation_config.json": {
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    (out / "tokenizer.json").write_text(_tokenizer_json(vocab, markers=markers))
    if weights_seed is not None:
        write_weights(out, files["config.json"], weights_seed)
    return out


def write_weights(path: Path, config: dict[str, Any], seed: int, head_std: float = 0.5) -> Path:
    """Write ``model.safetensors``: random weights of the llama ``config`` describes,
    drawn from ``seed`` (the same seed, the same bytes), under the names vLLM's and
    transformers' llama loaders read; where ``config`` has ``num_local_experts``, each
    layer's feed-forward is that many experts behind a router, as Mixtral's loaders read
    them. Returns the file.

    The output head is drawn wider (``head_std``) than the rest: next-token scores then
    differ by whole units, so greedy answers and logprobs are far from flat and a
    difference between two front-ends shows.
    """
    # Imported here: torch and safetensors come with vLLM, not with corewire.
    import torch
    from safetensors.torch import save_file

    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    vocab = config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> Any:
        return torch.randn(*shape, generator=generator) * std

    experts = config.get("num_local_experts") or 0
    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}"
        tensors |= {
            f"{at}.self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            f"{at}.self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            f"{at}.self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            f"{at}.self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        }
        if experts:  # Mixtral's layout: a router, then each expert's three projections
            moe = f"{at}.block_sparse_moe"
            tensors[f"{moe}.gate.weight"] = normal(experts, hidden, std=0.5)
            for expert in range(experts):
                tensors |= {
                    f"{moe}.experts.{expert}.w1.weight": normal(inner, hidden),
                    f"{moe}.experts.{expert}.w2.weight": normal(hidden, inner),
                    f"{moe}.experts.{expert}.w3.weight": normal(inner, hidden),
                }
        else:
            tensors |= {
                f"{at}.mlp.gate_proj.weight": normal(inner, hidden),
                f"{at}.mlp.up_proj.weight": normal(inner, hidden),
                f"{at}.mlp.down_proj.weight": normal(hidden, inner),
            }
        tensors |= {
            f"{at}.input_layernorm.weight": torch.ones(hidden),
            f"{at}.post_attention_layernorm.weight": torch.ones(hidden),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(vocab, hidden, std=head_std)
    target = path / "model.safetensors"
    save_file(tensors, str(target), metadata={"format": "pt"})
    return target
