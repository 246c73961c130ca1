"""Short chats rendered through their chat template on the API server's event loop, not
through vLLM's renderer pool.

vLLM's ``HfRenderer`` hands every chat's template rendering (``safe_apply_chat_template``:
the Jinja template, then the tokenization of what it wrote) to its thread pool, under a
timeout (``VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT``), so that a stuck render cannot hold the
server. For a short chat the hand-off costs more than the work, as it does for a prompt's
tokenization (:mod:`corewire.vllm.fast_path.inline_tokenize`): a queue put, a worker's
wake-up, the worker and the loop taking the GIL from each other (the template is Python:
the worker holds the GIL while it renders, so the pool does not free the loop), and a
cross-thread callback. Profiled behind ``--reasoning-parser deepseek_r1 --tool-call-parser
hermes``, the pool's worker took about a tenth of the server's CPU per two-token chat.

A chat is rendered on the loop, by the same function with the same arguments, when
everything the template sees (the parsed messages, the tools and the keyword arguments,
nested at most eight deep: a deeply nested tool schema keeps the pool) holds at most
:data:`INLINE_CHARS` characters in plain data (strings, numbers, lists, dicts), and its
template is the model's own or one the server was started with (a template a request
brought, which ``--trust-request-chat-template`` allows, keeps the pool and its timeout).
The answer, or the exception, reaches the caller through a future as the pool's would, and
``corewire_inline_chat_renders_total`` counts the render. Anything else goes to the pool as
before.

What changes: vLLM's render timeout no longer guards the model's or the server's template
for such a chat (the render is done before vLLM's ``wait_for`` starts), so a template of
the server's own that loops long on a short input holds the event loop for that long
(under vLLM's pool it took turns with the loop for the GIL, until the timeout freed the
request). The bound weighs the template's input, not what the template adds to it (a long built-in
system prompt is tokenized on the loop too); numbers weigh one character.

``COREWIRE_VLLM_INLINE_RENDER=0`` keeps the pool for every chat. Installed with the fast
path (API server processes only), on ``vllm.renderers.hf.HfRenderer`` of vLLM 0.34.0 (a
renderer whose ``__init__`` does not set ``_apply_chat_template_async`` is left as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from corewire import metrics
from corewire.vllm.fast_path import switches
from corewire.vllm.fast_path.on_loop import answered

__all__ = [
    "INLINE_CHARS",
    "SWITCH",
    "inline_renderer",
    "install",
    "server_templates",
    "template_input_chars",
    "trust_server_templates",
]

#: The environment switch: ``0`` keeps vLLM's pool for every chat.
SWITCH = "COREWIRE_VLLM_INLINE_RENDER"
#: The most characters a chat's template input may hold to be rendered on the loop: the
#: template's output is tokenized in the same call, so the bound is the inline
#: tokenizer's.
INLINE_CHARS = 2048
#: How deep the template's input may nest (a parsed chat is three or four levels deep).
_MAX_DEPTH = 8

# The templates the server was started with, kept alive so that identity can tell them
# from a request's own (which vLLM passes on as a fresh string).
_server_templates: list[str] = []


def switched_off() -> bool:
    """Whether :data:`SWITCH` keeps the pool for every chat."""
    return switches.switched_off(SWITCH)


def server_templates() -> tuple[str, ...]:
    """The chat templates the server was started with, as registered so far."""
    return tuple(_server_templates)


def _trusted(template: Any) -> bool:
    # None: the model's own template (or vLLM's fallback for it).
    return template is None or any(template is t for t in _server_templates)


def template_input_chars(value: Any, budget: int = INLINE_CHARS) -> int | None:
    """The characters in ``value`` (strings, and one for each number, boolean or None,
    through lists, tuples and dicts, keys included), or None once they pass ``budget`` or
    ``value`` holds anything else or nests too deep."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif item is None or isinstance(item, int | float):
            total += 1
        elif isinstance(item, list | tuple) and depth < _MAX_DEPTH:
            stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, dict) and depth < _MAX_DEPTH:
            for key, x in item.items():
                stack.append((key, depth + 1))
                stack.append((x, depth + 1))
        else:
            return None
        if total > budget:
            return None
    return total


def inline_renderer(render: Callable[..., Any], pooled: Callable[..., Any]) -> Callable[..., Any]:
    """The renderer's ``_apply_chat_template_async`` made from the function it runs
    (``render``, vLLM's ``safe_apply_chat_template``) and vLLM's pooled one (``pooled``):
    a future either way."""

    def apply_chat_template_async(*args: Any, **kwargs: Any) -> Any:
        # vLLM's call: (model_config, tokenizer, conversation, **template_kwargs).
        template = kwargs.get("chat_template")
        rest = {k: v for k, v in kwargs.items() if k != "chat_template"}
        if (
            len(args) != 3
            or not _trusted(template)
            or template_input_chars((args[2], rest)) is None
        ):
            return pooled(*args, **kwargs)
        metrics.count_inline_render()
        return answered(render, *args, **kwargs)

    apply_chat_template_async.corewire_inline_render = True  # type: ignore[attr-defined]
    return apply_chat_template_async


def trust_server_templates(online_renderer_class: Any) -> None:
    """Makes every ``online_renderer_class`` (vLLM's ``OnlineRenderer``, which holds the
    server's ``--chat-template``) built from now on register its template as the
    server's."""
    if getattr(online_renderer_class.__init__, "corewire_inline_render", False):
        return
    init = online_renderer_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        template = getattr(self, "chat_template", None)
        if isinstance(template, str) and not _trusted(template):
            _server_templates.append(template)

    __init__.corewire_inline_render = True  # type: ignore[attr-defined]
    online_renderer_class.__init__ = __init__


def install(renderer_class: Any, render: Callable[..., Any], online_renderer_class: Any) -> None:
    """Makes every ``renderer_class`` (vLLM's ``HfRenderer``) built from now on render
    short chats on the loop with ``render`` (:func:`inline_renderer`), and the server's
    templates known (:func:`trust_server_templates`), unless :data:`SWITCH` is off."""
    if switched_off() or getattr(renderer_class.__init__, "corewire_inline_render", False):
        return
    trust_server_templates(online_renderer_class)
    init = renderer_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        pooled = getattr(self, "_apply_chat_template_async", None)
        if pooled is not None:
            self._apply_chat_template_async = inline_renderer(render, pooled)

    __init__.corewire_inline_render = True  # type: ignore[attr-defined]
    renderer_class.__init__ = __init__
