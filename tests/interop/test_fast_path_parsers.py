"""Which servers' parsers let a streaming chat completion take the fast path
(``corewire.vllm.fast_path.chat.parser_refusal``), held to vLLM's own parsers.

vLLM 0.34.0 runs the server's parser (``--tool-call-parser``, ``--reasoning-parser``) on
every streamed output of every request. The fast path takes a request on such a server
only where the parser passes the request's text through: then the native frames write
each output's text as content and skip outputs without text, as vLLM's parser does. Here
every tool-call parser vLLM registers is built with the serve tests' tokenizer and fed
seeded random outputs (tool-call markup of many formats among them) through vLLM's own
``ChatStreamProcessor``: for each parser the fast path lets through, every delta before
the finish is what the frames write, and the finish is the same whether or not the parser
saw the outputs the frames wrote. The parsers it keeps on vLLM's path are named by kind.

Runs where the installed vLLM is one the fast path is held to (0.34.0).
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
from vllm.tokenizers import get_tokenizer  # noqa: E402
from vllm.tool_parsers import ToolParserManager  # noqa: E402

from corewire.vllm.fast_path import chat  # noqa: E402
from corewire.vllm.serve.model_dir import write_model_dir  # noqa: E402

MODEL = "corewire-tiny"
#: Output texts: words, nothing, and the start, end and body of tool calls and reasoning
#: in the formats vLLM's parsers look for.
PIECES = [
    "the",
    " old",
    " house",
    "",
    "",
    "\n",
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
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "{",
    "}",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The serve tests' tokenizer, as vLLM's server loads it."""
    model_dir: Path = write_model_dir(tmp_path_factory.mktemp("parsers") / "model")
    return get_tokenizer(str(model_dir))


def _parser_classes(tokenizer: Any) -> dict[str, type]:
    # Every registered tool-call parser a server could start with on this tokenizer
    # (vLLM's start checks the parser against the tokenizer, as done here).
    classes = {}
    for name in sorted(ToolParserManager.list_registered()):
        try:
            parser_cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True)
            assert parser_cls is not None
            parser_cls(tokenizer)
        except Exception:
            continue
        classes[name] = parser_cls
    return classes


def _request(**fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return ChatCompletionRequest.model_validate(body | fields)


def _outputs(seed: int) -> list[tuple[str, list[int], str | None]]:
    # One stream's outputs: (new text, new token ids, finish reason), the last finished.
    rng = random.Random(seed)
    count = rng.randint(1, 14)
    outputs = []
    for i in range(count):
        text = "".join(rng.choices(PIECES, k=rng.randint(1, 2)))
        ids = [rng.randrange(4, 4000) for _ in range(rng.randint(1, 3))]
        finish = rng.choice(["stop", "length"]) if i == count - 1 else None
        outputs.append((text, ids, finish))
    return outputs


def _processor(parser_cls: type, tokenizer: Any, request: Any) -> ChatStreamProcessor:
    # A stream's processor as vLLM's server makes it (OpenAIServingChat._make_parser).
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)
    return ChatStreamProcessor(request, parser, enable_auto_tools=True, parser_cls=parser_cls)


def _dump(delta: Any) -> str | None:
    return None if delta is None else delta.model_dump_json(exclude_unset=True)


def test_tool_parsers_the_fast_path_takes_pass_text_through(tokenizer: Any) -> None:
    """For every tool-call parser the fast path lets a request without tools through,
    vLLM's processor with that parser makes each unfinished output's delta its text as
    content and nothing of an output without text (what the native frames write), from
    the first output on, over 40 seeded random streams; and its finish is the same when
    the parser saw only the outputs Python renders (the first and the finish)."""
    classes = _parser_classes(tokenizer)
    taken = [n for n, c in classes.items() if chat.parser_refusal(c, _request()) is None]
    # The common classic parsers are taken (hermes: Qwen's and NousResearch's format).
    assert {"hermes", "pythonic", "llama4_pythonic"} <= set(taken), taken
    prompt = [1, 5, 6, 7]
    for name in taken:
        for request in (_request(), _request(tools=[WEATHER_TOOL], tool_choice="none")):
            for seed in range(40):
                outputs = _outputs(seed)
                every = _processor(classes[name], tokenizer, request)
                ends = _processor(classes[name], tokenizer, request)
                for i, (text, ids, finish) in enumerate(outputs):
                    step = every.step(text, ids, finish, prompt)
                    if finish is None:
                        expected = DeltaMessage(content=text) if text else None
                        assert _dump(step.delta) == _dump(expected), (name, seed, i, text)
                        assert chat._passes_through(every.parser), (name, seed, i)
                    if i == 0 or finish is not None:
                        # The native frames' outputs, counted but not parsed.
                        ends.num_output_tokens = sum(len(o[1]) for o in outputs[:i])
                        end = ends.step(text, ids, finish, prompt)
                assert (_dump(end.delta), end.finish_reason) == (
                    _dump(step.delta),
                    step.finish_reason,
                ), (name, seed)


def test_parsers_kept_on_vllms_path_are_named_by_kind(tokenizer: Any) -> None:
    """Engine-based tool-call parsers (they hold marker text back and drop tool markup),
    parser classes of their own, any reasoning parser, and a request that may call tools
    keep a stream on vLLM's path, each with its reason."""
    classes = _parser_classes(tokenizer)
    plain = _request()
    assert chat.parser_refusal(None, plain) is None
    assert chat.parser_refusal(classes["llama3_json"], plain) == "an engine-based tool-call parser"
    assert chat.parser_refusal(classes["kimi_k3"], plain) == (
        f"the parser {classes['kimi_k3'].__name__} streams its own way"
    )
    hermes = classes["hermes"]
    with_tools = _request(tools=[WEATHER_TOOL])
    assert with_tools.tool_choice == "auto"
    assert chat.parser_refusal(hermes, with_tools) == "the request may call tools"
    required = _request(tools=[WEATHER_TOOL], tool_choice="required")
    assert chat.parser_refusal(hermes, required) == "the request may call tools"
    reasoning = ParserManager.get_parser(
        tool_parser_name="hermes", reasoning_parser_name="qwen3", enable_auto_tools=True
    )
    assert chat.parser_refusal(reasoning, plain) == "a reasoning parser"
    alone = ParserManager.get_parser(reasoning_parser_name="deepseek_r1")
    assert chat.parser_refusal(alone, plain) == "a reasoning parser"
    # Every parser is decided one way or the other, by kind.
    kinds = {chat.parser_refusal(c, plain) for c in classes.values()}
    assert None in kinds and "an engine-based tool-call parser" in kinds
