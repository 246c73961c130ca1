"""The serve benchmark's split of front-end CPU into a part per request and a part per token.

A stack's front-end CPU for one request of ``L`` output tokens is modelled as
``per_request + L * per_token``: admission, HTTP, validation, tokenization, the first and
last chunks happen once per request; receiving, detokenizing and writing each token's
chunk happen per token. ``--split-tokens N`` runs every saturation scenario a second time
with N-token requests, and the two lengths give both parts (two points on the line).

Why it is worth printing: tokens per CPU second mixes the two, and how a stack compares
depends on the request length. The split says which part a stack's remaining CPU is in,
and how far it can go: with no per-token CPU at all, a stack's tokens per CPU second
over the baseline's at ``L`` tokens is at most the baseline's CPU per request over the
stack's per-request part (:attr:`CostSplit.ceiling`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["CostSplit", "Measured", "fit", "report"]


class Measured(Protocol):
    """What the fit reads of a benchmark result (``serve.Result``)."""

    client: str
    streams: int
    logprobs: int
    requests: int
    tokens: int
    cpu_seconds: float
    chunks: int


@dataclass(frozen=True)
class CostSplit:
    """One stack's front-end CPU in one scenario, split: seconds per request and per token,
    fitted from its runs at two request lengths (tokens per request, on average)."""

    client: str
    streams: int
    logprobs: int
    per_request_s: float
    per_token_s: float
    short_tokens: float
    long_tokens: float
    #: Tokens per SSE chunk at each length: about 1 where the stack kept up. Above, it
    #: fell behind the engine and merged steps into fewer, cheaper chunks, more so at one
    #: length than the other, and the per-token part reads low.
    short_tokens_per_chunk: float = float("nan")
    long_tokens_per_chunk: float = float("nan")

    def cpu_per_request(self, tokens: float) -> float:
        """The fitted CPU seconds of one request of ``tokens`` output tokens."""
        return self.per_request_s + tokens * self.per_token_s

    def ceiling(self, baseline: CostSplit) -> float:
        """The most this stack's tokens per CPU second could be over ``baseline``'s at the
        long length if its per-token CPU were zero: what its per-request part allows."""
        if self.per_request_s <= 0:
            return float("inf")
        return baseline.cpu_per_request(self.long_tokens) / self.per_request_s


def fit(long: Measured, short: Measured) -> CostSplit:
    """The split of ``long``'s and ``short``'s stack (the same client and scenario at two
    request lengths). Raises ValueError when the two cannot give a line: a run without
    requests, or the same tokens per request in both."""
    if not long.requests or not short.requests:
        raise ValueError(f"{long.client}: a run without finished requests cannot be split")
    long_tokens = long.tokens / long.requests
    short_tokens = short.tokens / short.requests
    if long_tokens == short_tokens:
        raise ValueError(f"{long.client}: both runs have {long_tokens:g} tokens per request")
    long_cpu = long.cpu_seconds / long.requests
    short_cpu = short.cpu_seconds / short.requests
    per_token = (long_cpu - short_cpu) / (long_tokens - short_tokens)
    return CostSplit(
        long.client,
        long.streams,
        long.logprobs,
        per_request_s=short_cpu - per_token * short_tokens,
        per_token_s=per_token,
        short_tokens=short_tokens,
        long_tokens=long_tokens,
        short_tokens_per_chunk=short.tokens / short.chunks if short.chunks else float("nan"),
        long_tokens_per_chunk=long.tokens / long.chunks if long.chunks else float("nan"),
    )


def _over(value: float, base: CostSplit | None, attr: str) -> str:
    if base is None:
        return f"{'-':>7}"
    den = getattr(base, attr)
    return f"{value / den:7.2f}" if den > 0 else f"{'-':>7}"


def report(splits: list[CostSplit], *, baseline: str = "vllm", rust: str = "rust") -> None:
    """Prints the splits, each part against the ``baseline`` stack's and vLLM's Rust
    front-end's in the same scenario, and each stack's ceiling over the baseline."""
    if not splits:
        return
    by_key = {(s.client, s.streams, s.logprobs): s for s in splits}
    tokens = sorted(
        {round(s.short_tokens) for s in splits} | {round(s.long_tokens) for s in splits}
    )
    print()
    print(
        "front-end CPU per request and per token (fitted from the runs at "
        f"{' and '.join(str(t) for t in tokens)} tokens per request: CPU of a request = "
        "per-request part + tokens x per-token part)"
    )
    print(
        "client          streams lp  us/request  x vllm  x rust  us/token  x vllm  x rust"
        "  ceiling x vllm  tok/chunk"
    )
    for s in splits:
        base = by_key.get((baseline, s.streams, s.logprobs))
        ref = by_key.get((rust, s.streams, s.logprobs))
        ceiling = s.ceiling(base) if base is not None else float("nan")
        print(
            f"{s.client:15} {s.streams:7} {s.logprobs:2} {1e6 * s.per_request_s:11.0f}"
            f" {_over(s.per_request_s, base, 'per_request_s')}"
            f" {_over(s.per_request_s, ref, 'per_request_s')}"
            f" {1e6 * s.per_token_s:9.2f} {_over(s.per_token_s, base, 'per_token_s')}"
            f" {_over(s.per_token_s, ref, 'per_token_s')}  {ceiling:14.2f}"
            f"  {s.short_tokens_per_chunk:4.2f}/{s.long_tokens_per_chunk:4.2f}"
        )
    print(
        "(ceiling x vllm: the stack's tokens per CPU second over vllm's at the longer length "
        "if its per-token part were zero, what its per-request part alone allows; "
        "tok/chunk: at the shorter/longer length, about 1 where the stack kept up with the "
        "engine: a stack that merged steps into fewer chunks did less per token at one "
        "length than the other, and its split reads off; a fit of two noisy points: read "
        "the parts to a few percent)"
    )
