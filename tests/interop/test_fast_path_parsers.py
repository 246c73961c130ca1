"""Which servers' parsers a streaming chat completion takes the fast path under, and how
(``corewire.vllm.fast_path.parsers``), held to vLLM's own parsers.

vLLM 0.34.0 runs the server's parser (``--tool-call-parser``, ``--reasoning-parser``) on
every streamed chat output of every request. The fast path takes a request on such a
server where the parser's deltas, between the outputs that change their kind, are each
output's text under one field: after Python renders such a delta, the native frames write
the next outputs' text under that field, handing back to Python any output that carries a
reasoning marker. Here every tool-call parser vLLM registers, and every reasoning parser
(alone and beside a tool-call parser), is built with the serve tests' tokenizer (with
``<think>`` and other markers) and fed seeded random outputs (marker tokens, tool-call
markup of many formats, outputs without text) twice through vLLM's own
``ChatStreamProcessor``: once as vLLM's server does, every output parsed; once as the fast
path does, the native frames' outputs written as frames and never parsed. For every
parser the fast path takes, both send the same deltas, count the same tokens and the same
reasoning tokens; the parsers it keeps on vLLM's path are named by kind.

Runs where the installed vLLM is one the fast path is held to (0.33.0, 0.34.0).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from corewire.bench.serve import fast_path_missing

_MISSING = fast_path_missing()
if _MISSING is not None:
    if _REQUIRED := os.environ.get("COREWIRE_REQUIRE_VLLM"):
        from corewire.vllm.plugin import FAST_PATH_VLLM_VERSIONS

        if _REQUIRED in FAST_PATH_VLLM_VERSIONS:
            raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={_REQUIRED}: {_MISSING}")
    pytest.skip(_MISSING, allow_module_level=True)

from vllm.entrypoints.generate.base.protocol import DeltaMessage  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest,
)
from vllm.entrypoints.openai.chat_completion.stream_processor import (  # noqa: E402
    ChatStreamProcessor,
)
from vllm.parser import ParserManager  # noqa: E402
from vllm.reasoning import ReasoningParserManager  # noqa: E402
from vllm.tokenizers import get_tokenizer  # noqa: E402
from vllm.tool_parsers import ToolParserManager  # noqa: E402

from corewire.vllm.fast_path import parsers  # noqa: E402
from corewire.vllm.serve.model_dir import write_model_dir  # noqa: E402

MODEL = "corewire-tiny"
#: Marker tokens of the tokenizer: reasoning's, and other tokens some reasoning parsers
#: treat apart (ERNIE 4.5's response markers).
MARKERS = ("<think>", "</think>", "<response>", "</response>")
#: Output texts besides the tokens': tool-call and reasoning markup of many formats.
MARKUP = [
    "<tool_call>",
    "</tool_call>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '[{"name": "f", "parameters": {}}]',
    "[get_weather(city='Paris')]",
    "<|python_tag|>",
    "<function=get_weather>",
    "</function>",
    "functools[",
    "```json",
    "<|tool_calls_section_begin|>",
    "{",
    "}",
    "\n",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
#: Streams per parser and request.
STREAMS = 40


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The serve tests' tokenizer with :data:`MARKERS`, as vLLM's server loads it."""
    model_dir: Path = write_model_dir(tmp_path_factory.mktemp("parsers") / "model", markers=MARKERS)
    return get_tokenizer(str(model_dir))


def _startable(tokenizer: Any, **names: Any) -> type | None:
    # The parser class a server started with these parser names has (None: vLLM's start
    # refuses them with this tokenizer, as it checks the parser against it).
    try:
        parser_cls = ParserManager.get_parser(enable_auto_tools=True, **names)
        assert parser_cls is not None
        parser_cls(tokenizer)
    except Exception:
        return None
    return parser_cls


def _tool_parsers(tokenizer: Any) -> dict[str, type]:
    found = {
        n: _startable(tokenizer, tool_parser_name=n) for n in ToolParserManager.list_registered()
    }
    return {n: c for n, c in sorted(found.items()) if c is not None}


def _reasoning_parsers(tokenizer: Any, tool: str | None) -> dict[str, type]:
    found = {
        n: _startable(tokenizer, reasoning_parser_name=n, tool_parser_name=tool)
        for n in ReasoningParserManager.list_registered()
    }
    return {n: c for n, c in sorted(found.items()) if c is not None}


def _request(**fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return ChatCompletionRequest.model_validate(body | fields)


def _outputs(seed: int, tokenizer: Any) -> list[tuple[str, list[int], str | None]]:
    # One stream's outputs: (new text, new token ids, finish reason), the last finished.
    # Tokens: words (" word"), markers (their text), specials (no text), and markup.
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab()
    pool = [(vocab[m], m) for m in MARKERS] * 3 + [(2, ""), (0, "")]
    pool += [(vocab[w], f" {w}") for w in ("the", "old", "house", "sea")]
    pool += [(rng.randrange(100, 4000), piece) for piece in MARKUP]
    count = rng.randint(1, 16)
    outputs = []
    for i in range(count):
        tokens = rng.choices(pool, k=rng.randint(1, 3))
        text = "".join(t for _, t in tokens)
        finish = rng.choice(["stop", "length"]) if i == count - 1 else None
        outputs.append((text, [t for t, _ in tokens], finish))
    return outputs


def _processor(parser_cls: type, tokenizer: Any, request: Any) -> ChatStreamProcessor:
    # A stream's processor as vLLM's server makes it (OpenAIServingChat._make_parser).
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)
    return ChatStreamProcessor(request, parser, enable_auto_tools=True, parser_cls=parser_cls)


def _dump(delta: Any, finish: str | None) -> str:
    return f"{delta.model_dump_json(exclude_unset=True)} {finish}"


#: What a stream sent: the chunks' deltas, its token count and its reasoning tokens.
Sent = tuple[list[str], int, int]
#: The outputs the native frames wrote, per parser name (fast_stream counts them).
FRAMED: dict[str, int] = {}


def vllms_stream(processor: ChatStreamProcessor, outputs: list[Any], prompt: list[int]) -> Sent:
    """The deltas vLLM's stream generator sends for ``outputs``, every one parsed."""
    sent, generated = [], []
    for text, ids, finish in outputs:
        step = processor.step(text, ids, finish, prompt)
        generated += ids
        if step.delta is None and finish is None:
            continue
        sent.append(_dump(step.delta or DeltaMessage(), step.finish_reason))
    return sent, processor.num_output_tokens, _reasoning(processor, generated)


def fast_stream(
    processor: ChatStreamProcessor, outputs: list[Any], prompt: list[int], name: str = ""
) -> Sent:
    """The deltas the fast path's chat stream sends for ``outputs``: Python parses an
    output unless native frames are attached (``parsers.native_frames`` after the chunk
    before), then the frame is the output's text under the field (nothing for an empty
    text where empties are skipped) and the parser never sees it, unless the output
    carries a marker (``parsers.markers``), which goes back to Python."""
    sent, generated = [], []
    marks = parsers.markers(processor.parser)
    frames, native = None, 0
    for text, ids, finish in outputs:
        if frames is not None and finish is None and not set(ids) & set(marks):
            field, skip_empty, nulls = frames
            if text or not skip_empty:
                sent.append(_dump(DeltaMessage(**{field: text, **dict.fromkeys(nulls)}), None))
            native += len(ids)
            generated += [-1] * len(ids)
            FRAMED[name] = FRAMED.get(name, 0) + 1
            continue
        frames = None
        processor.num_output_tokens += native
        native = 0
        step = processor.step(text, ids, finish, prompt)
        generated += ids
        if step.delta is None and finish is None:
            continue
        sent.append(_dump(step.delta or DeltaMessage(), step.finish_reason))
        if finish is None and processor.num_output_tokens:
            frames = parsers.native_frames(processor.parser, step.delta, ids)
    return sent, processor.num_output_tokens, _reasoning(processor, generated)


def _reasoning(processor: ChatStreamProcessor, generated: list[int]) -> int:
    return processor.parser.count_reasoning_tokens(tuple(generated)) if generated else 0


def _check_same_streams(name: str, parser_cls: type, tokenizer: Any, requests: list[Any]) -> float:
    # Both ways, every seeded stream of every request: the same. The native frames' share
    # of the outputs, over them all.
    FRAMED[name] = total = 0
    for request in requests:
        for seed in range(STREAMS):
            outputs = _outputs(seed, tokenizer)
            for prompt in ([1, 7, 8], [1, 7, tokenizer.get_vocab()["<think>"]]):
                theirs = vllms_stream(_processor(parser_cls, tokenizer, request), outputs, prompt)
                processor = _processor(parser_cls, tokenizer, request)
                mine = fast_stream(processor, outputs, prompt, name)
                assert mine == theirs, (name, request.tool_choice, seed, prompt, outputs)
                total += len(outputs)
    return FRAMED[name] / total


def test_tool_parsers_the_fast_path_takes_send_what_vllm_sends(tokenizer: Any) -> None:
    """Every tool-call parser the fast path takes for a request that calls no tool (with
    no tools, and with one under ``tool_choice: "none"``; and with ``include_reasoning:
    false``, where vLLM's parser sets each delta's reasoning to null): the same deltas,
    token counts and finish as vLLM's parsing of every output, over seeded random
    streams."""
    classes = _tool_parsers(tokenizer)
    plain, none = _request(), _request(tools=[WEATHER_TOOL], tool_choice="none")
    hidden = _request(include_reasoning=False)
    taken = [n for n, c in classes.items() if parsers.parser_refusal(c, plain) is None]
    # The common classic parsers are taken (hermes: Qwen's and NousResearch's format).
    assert {"hermes", "pythonic", "llama4_pythonic", "qwen3_json"} <= set(taken), taken
    assert all(parsers.parser_refusal(classes[n], hidden) is None for n in taken)
    for name in taken:
        share = _check_same_streams(name, classes[name], tokenizer, [plain, none, hidden])
        # The frames carry a good part of the outputs (the rest: each stream's first
        # output, those after an empty one, and the finish).
        assert share > 0.3, (name, share)


@pytest.mark.parametrize("tool", [None, "hermes"])
def test_reasoning_parsers_the_fast_path_takes_send_what_vllm_sends(
    tokenizer: Any, tool: str | None
) -> None:
    """Every reasoning parser the fast path takes (start and end markers), alone and
    beside a tool-call parser: the same deltas (reasoning, content, the switch between
    them), token counts, reasoning token counts and finish as vLLM's parsing of every
    output, over seeded random streams full of markers."""
    classes = _reasoning_parsers(tokenizer, tool)
    plain = _request()
    taken = [n for n, c in classes.items() if parsers.parser_refusal(c, plain) is None]
    assert "deepseek_r1" in taken, taken
    for name in taken:
        share = _check_same_streams(name, classes[name], tokenizer, [plain])
        # Markers are a third of the tokens here: the frames still carry some outputs.
        assert share > 0.05, (name, share)


def _engine_based_tool_parser(tools: dict[str, type]) -> str:
    # llama3_json's parser is engine-based from 0.34.0 on (0.33.0's is classic, and does
    # not start with the tests' tokenizer); qwen3_xml's is in both.
    for name in ("llama3_json", "qwen3_xml"):
        tool_cls = getattr(tools.get(name), "tool_parser_cls", None)
        if getattr(tool_cls, "engine_based_streaming", False):
            return name
    raise AssertionError(f"no engine-based tool-call parser among {sorted(tools)}")


@pytest.mark.parametrize("broken", ["nulls left out", "empty outputs written"])
def test_native_frames_are_checked_against_frames_that_break_them(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """The comparison fails for native frames that would send other deltas than vLLM's:
    frames that leave out a delta's null fields (``reasoning``, where the request hides
    it), or that write the empty outputs a tool-call parser sends nothing for."""
    real = parsers.native_frames

    def wrong(parser: Any, delta: Any, token_ids: Any) -> tuple[str, bool, tuple[str, ...]] | None:
        frames = real(parser, delta, token_ids)
        if frames is None:
            return None
        field, skip_empty, nulls = frames
        return (field, skip_empty, ()) if broken == "nulls left out" else (field, False, nulls)

    monkeypatch.setattr(parsers, "native_frames", wrong)
    request = _request(include_reasoning=False) if broken == "nulls left out" else _request()
    hermes = _tool_parsers(tokenizer)["hermes"]
    with pytest.raises(AssertionError):
        _check_same_streams("hermes", hermes, tokenizer, [request])


def test_parsers_kept_on_vllms_path_are_named_by_kind(tokenizer: Any) -> None:
    """Engine-based parsers (they hold marker text back and drop tool markup), parser
    classes of their own, reasoning parsers not of start and end markers, a request that
    may call tools and one that hides its reasoning keep a stream on vLLM's path, each
    with its reason."""
    tools = _tool_parsers(tokenizer)
    plain = _request()
    assert parsers.parser_refusal(None, plain) is None
    refusal = parsers.parser_refusal
    engine_based = tools[_engine_based_tool_parser(tools)]
    assert refusal(engine_based, plain) == "an engine-based tool-call parser"
    assert refusal(tools["kimi_k3"], plain) == (
        f"the parser {tools['kimi_k3'].__name__} streams its own way"
    )
    hermes = tools["hermes"]
    with_tools = _request(tools=[WEATHER_TOOL])
    assert with_tools.tool_choice == "auto"
    assert refusal(hermes, with_tools) == "the request may call tools"
    required = _request(tools=[WEATHER_TOOL], tool_choice="required")
    assert refusal(hermes, required) == "the request may call tools"
    reasoning = _reasoning_parsers(tokenizer, "hermes")
    assert refusal(reasoning["qwen3"], plain) == "an engine-based reasoning parser"
    assert refusal(reasoning["deepseek_r1"], plain) is None
    # ERNIE 4.5's parser sends nothing for its response markers: not a plain split.
    ernie = reasoning["ernie45"].reasoning_parser_cls.__name__
    assert refusal(reasoning["ernie45"], plain) == (
        f"the reasoning parser {ernie} is not of start and end markers"
    )
    assert refusal(reasoning["deepseek_r1"], with_tools) == "the request may call tools"
    hidden = _request(include_reasoning=False)
    assert refusal(reasoning["deepseek_r1"], hidden) == "include_reasoning is false"
    assert refusal(hermes, hidden) is None
    # Every parser is decided one way or the other, by kind.
    kinds = {refusal(c, plain) for c in tools.values()}
    assert None in kinds and "an engine-based tool-call parser" in kinds
