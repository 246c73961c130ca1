"""The feature table of docs/vllm.md's "per-token fast path" section, as data the tests check.

Each :class:`Feature` is one request option or endpoint of vLLM 0.34.0's Python server,
sent as one request: whether the fast path writes its chunks (``fast``: checked by
``test_vllm_fast_path.py`` on the fast path's counters, the answer equal to vLLM's own
server's either way), and what vLLM's Rust front-end (``vllm-rs``) answers (``rust``:
checked by ``test_vllm_rust_frontend.py`` against the installed ``vllm-rs``, compared
with vLLM's Python server: :func:`rust_verdict`). That table is checked against this
list, row by row (``test_readme_feature_table_is_the_checked_one``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "corewire-tiny"

#: What the Rust front-end does with a feature, compared with vLLM's Python server.
SAME = "same answer"
DIFFERS = "different answer"
ERROR = "error"

_COMPLETION = {"prompt": "the old house on the hill", "max_tokens": 8, "temperature": 0.0}
_COMPLETION |= {"ignore_eos": True}
_CHAT = {"messages": [{"role": "user", "content": "tell me about the old house"}]}
_CHAT |= {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
_USAGE = {"stream_options": {"include_usage": True}}
_CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@dataclass(frozen=True)
class Feature:
    """One row of the table: ``name`` (as docs/vllm.md writes it), the request (``path``,
    ``body``, streamed unless ``stream`` is False), and the two columns."""

    name: str
    path: str
    body: dict[str, Any] = field(default_factory=dict)
    fast: bool = False
    rust: str = SAME
    stream: bool = True

    def request(self) -> dict[str, Any]:
        """The request's JSON body."""
        base = _COMPLETION if self.path == "/v1/completions" else _CHAT
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            base = {}
        body = {"model": MODEL, **base, **self.body}
        if self.path in ("/v1/completions", "/v1/chat/completions"):
            body["stream"] = self.stream
        return body


C, CHAT = "/v1/completions", "/v1/chat/completions"

FEATURES: tuple[Feature, ...] = (
    Feature("completions, streamed", C, fast=True),
    Feature("completions, not streamed", C, stream=False),
    Feature("`logprobs` (top 3)", C, {"logprobs": 3}, fast=True),
    Feature("`stop` strings", C, {"stop": ["w2", "house"]}, fast=True),
    Feature("`stop_token_ids`", C, {"stop_token_ids": [2920]}, fast=True),
    Feature(
        "`include_stop_str_in_output`",
        C,
        {"stop": ["w2"], "include_stop_str_in_output": True},
        fast=True,
    ),
    Feature("`min_tokens`", C, {"min_tokens": 4, "ignore_eos": False}, fast=True),
    Feature("`seed` (sampled)", C, {"temperature": 0.9, "seed": 3}, fast=True),
    Feature("`stream_interval` (per request)", C, {"stream_interval": 3}, fast=True),
    Feature("`include_usage`", C, _USAGE, fast=True),
    Feature("`continuous_usage_stats`", C, _CONTINUOUS, fast=True),
    Feature("`echo`", C, {"echo": True}, fast=True, rust=DIFFERS),
    Feature(
        "`echo` with `logprobs` (top 2)", C, {"echo": True, "logprobs": 2}, fast=True, rust=DIFFERS
    ),
    Feature("`n` = 2", C, {"n": 2, "temperature": 0.8, "seed": 5}, fast=True),
    Feature("`return_token_ids`", C, {"return_token_ids": True}, fast=True),
    Feature("`logprob_token_ids`", C, {"logprobs": 1, "logprob_token_ids": [5, 6]}, rust=ERROR),
    Feature(
        "`return_tokens_as_token_ids`",
        C,
        {"logprobs": 1, "return_tokens_as_token_ids": True},
    ),
    Feature(
        "`prompt_logprobs` (not streamed)", C, {"prompt_logprobs": 1}, stream=False, rust=DIFFERS
    ),
    Feature("`prompt_logprobs` 0 (streamed)", C, {"prompt_logprobs": 0}, fast=True),
    Feature("chat completions, streamed", CHAT, fast=True),
    Feature("chat completions, not streamed", CHAT, stream=False),
    Feature("chat `include_usage`", CHAT, _USAGE, fast=True),
    Feature("chat `logprobs` (top 2)", CHAT, {"logprobs": True, "top_logprobs": 2}, fast=True),
    Feature("chat `n` = 2", CHAT, {"n": 2, "temperature": 0.8, "seed": 5}, fast=True),
    Feature("chat `echo`", CHAT, {"echo": True}, fast=True),
    Feature("chat `continuous_usage_stats`", CHAT, _CONTINUOUS, fast=True),
    Feature("chat `return_token_ids`", CHAT, {"return_token_ids": True}, fast=True),
    Feature("`/tokenize`", "/tokenize", {"prompt": "the old house"}),
    Feature("`/detokenize`", "/detokenize", {"tokens": [42, 148, 273]}),
    Feature(
        "`/v1/responses`",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 4, "temperature": 0.0},
    ),
)


def answer(http: httpx.Client, feature: Feature) -> tuple[int, Any]:
    """The server's answer to ``feature``'s request: its status, and its JSON (for a
    stream, every event's, ``[DONE]`` left out)."""
    body = feature.request()
    if not body.get("stream"):
        resp = http.post(feature.path, json=body)
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text
    with http.stream("POST", feature.path, json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, resp.read().decode()
        events = [
            json.loads(line[len("data: ") :])
            for line in resp.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    return 200, events


def semantic(value: Any) -> Any:
    """A JSON value without what differs between identical answers (ids, times, the
    fingerprint) or between renderings of one answer (null fields)."""
    if isinstance(value, dict):
        return {
            k: semantic(v)
            for k, v in value.items()
            if v is not None
            and k not in ("id", "created", "created_at", "system_fingerprint")
            and not re.fullmatch(r"(msg|resp|rs)_.*", str(v))
        }
    if isinstance(value, list):
        return [semantic(v) for v in value]
    return value


def joined(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reads from a stream, per choice: the text (or content), the finish
    and stop reasons, logprobs, token ids; and the stream's prompt token ids and last
    usage. Chunk shapes (how the answer is split into chunks, null fields, where a finish
    reason rides) are left out."""
    out: dict[str, Any] = {"choices": {}, "usage": None, "prompt_token_ids": None}
    for event in events:
        out["usage"] = event.get("usage") or out["usage"]
        out["prompt_token_ids"] = event.get("prompt_token_ids") or out["prompt_token_ids"]
        for choice in event.get("choices", []):
            c = out["choices"].setdefault(
                choice["index"], {"pieces": [], "logprobs": [], "token_ids": []}
            )
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                c["pieces"].append(piece)
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    c[key] = choice[key]
            if choice.get("prompt_token_ids"):
                out["prompt_token_ids"] = choice["prompt_token_ids"]
            c["token_ids"] += choice.get("token_ids") or []
            if choice.get("logprobs"):
                c["logprobs"] = _joined_logprobs(c["logprobs"], semantic(choice["logprobs"]))
    for c in out["choices"].values():
        # One text: a server that merged steps into fewer chunks (a loaded one) wrote the
        # same answer in fewer pieces.
        c["text"] = "".join(c.pop("pieces"))
    return semantic(out)


def _joined_logprobs(so_far: Any, piece: dict[str, Any]) -> dict[str, Any]:
    """The logprobs of a stream's chunks as one: each list field (tokens, their
    logprobs, top logprobs, text offsets; chat's content) concatenated, so that a server
    that merged steps into fewer chunks (a loaded one) reads the same."""
    joined_so_far = dict(so_far) if isinstance(so_far, dict) else {}
    for key, value in piece.items():
        before = joined_so_far.get(key)
        if isinstance(value, list) and isinstance(before, list):
            joined_so_far[key] = before + value
        else:
            joined_so_far[key] = value
    return joined_so_far


def close(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-5 (vllm-rs writes 32-bit logprobs, vLLM's Python server
    64-bit ones), dicts whatever their key order."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-5
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def rust_verdict(rust: tuple[int, Any], python: tuple[int, Any]) -> str:
    """What the Rust front-end's answer is next to vLLM's Python server's: an error (a
    status other than 200, or an error event in its stream), the same answer (what a
    client reads: :func:`joined` for streams, the JSON but for ids, times and null fields
    otherwise; floats within 1e-5), or a different one."""
    status, body = rust
    if status != 200 or (isinstance(body, list) and any("error" in e for e in body)):
        return ERROR
    if isinstance(body, list):
        return SAME if close(joined(body), joined(python[1])) else DIFFERS
    return SAME if close(semantic(body), semantic(python[1])) else DIFFERS


def readme_rows(readme: str) -> list[tuple[str, str, str]]:
    """The rows of docs/vllm.md's feature table: (feature, fast path, Rust front-end)."""
    section = readme.split("<!-- fast-path-features -->")[1].split("<!-- /fast-path-features -->")[
        0
    ]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and not set(cells[0]) <= {"-", " "} and cells[0] != "feature":
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def table_row(feature: Feature) -> tuple[str, str, str]:
    """``feature`` as docs/vllm.md's table writes it."""
    return (feature.name, "fast" if feature.fast else "vLLM's", feature.rust)
