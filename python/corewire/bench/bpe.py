"""A byte-level BPE tokenizer trained at run time, for benchmarks and tests that need a
real tokenizer without downloading one.

The training text mixes ASCII, accented Latin, Greek, Cyrillic, CJK and emoji in invented
words, so that many characters span several tokens (the case where incremental
detokenization and logprob token strings differ from a per-token decode). The result is
a ``transformers`` fast tokenizer, the class vLLM's front-end detokenizes with.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["ALPHABET", "SPECIAL_TOKENS", "sample_text", "train", "train_byte_level"]

#: Characters the invented words are made of: 1- to 4-byte UTF-8.
ALPHABET = "abcdefghijklmnopqrstuvwxyzéèàüöñçøåαβγδεζηθλμπσωжзийклмн日本語中文字漢東京😀🎉🚀🌍"  # noqa: RUF001

#: Added special tokens (ids 0.. in this order).
SPECIAL_TOKENS = ("<s>", "</s>", "<|sep|>")


def _words(rng: random.Random, count: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 7))) for _ in range(count)]


def sample_text(rng: random.Random, words: int, vocabulary: list[str]) -> str:
    """``words`` words drawn from ``vocabulary`` with a Zipf-like skew, space separated."""
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]
    return " ".join(rng.choices(vocabulary, weights, k=words))


def train_byte_level(corpus: list[str], vocab_size: int, special_tokens: list[str]) -> Any:
    """A GPT-2 style byte-level BPE (``tokenizers.Tokenizer``) trained on ``corpus``, with
    ``special_tokens`` as its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def train(vocab_size: int = 4000, seed: int = 0, lines: int = 3000) -> tuple[Any, list[str]]:
    """A trained fast tokenizer (``PreTrainedTokenizerFast``) and the invented word list
    its training text was drawn from (to generate more text like it)."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    vocabulary = _words(rng, 800)
    corpus = [sample_text(rng, 24, vocabulary) for _ in range(lines)]
    tok = train_byte_level(corpus, vocab_size, list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        additional_special_tokens=[SPECIAL_TOKENS[2]],
    )
    return fast, vocabulary
