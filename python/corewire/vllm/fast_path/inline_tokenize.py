"""Short prompts tokenized on the API server's event loop, not through vLLM's tokenizer pool.

vLLM's renderer hands every prompt's tokenization to a thread pool
(``BaseRenderer._tokenize_prompt_async``, ``run_in_executor``), so that a long prompt does
not hold the event loop. For the short prompts of most requests the hand-off costs more
than the work: a queue put and a worker's wake-up, the worker and the loop taking the GIL
from each other, and a cross-thread callback that wakes the loop again, where the
tokenizer itself (Rust) takes a few tens of microseconds. A prompt of at most
:data:`INLINE_CHARS` characters is tokenized by the same function, with the same
arguments, on the loop; a longer one, or anything that is not a text prompt, goes to the
pool as before. The answer is the same either way: the same ``_tokenize_prompt``, through
the same thread-safe tokenizer copies, its result or its exception delivered by a future
as the pool delivers it.

``COREWIRE_VLLM_INLINE_TOKENIZE=0`` keeps the pool for every prompt. Installed with the
fast path (API server processes only), on ``vllm.renderers.base.BaseRenderer`` of vLLM
0.33.0 and 0.34.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from corewire.vllm.fast_path import switches
from corewire.vllm.fast_path.on_loop import answered

__all__ = ["INLINE_CHARS", "SWITCH", "inline_tokenizer", "install"]

#: The environment switch: ``0`` keeps vLLM's pool for every prompt.
SWITCH = "COREWIRE_VLLM_INLINE_TOKENIZE"
#: The longest prompt, in characters, tokenized on the loop: a few hundred tokens, which
#: the tokenizer encodes in well under the hand-off's own cost in loop time.
INLINE_CHARS = 2048


def switched_off() -> bool:
    """Whether :data:`SWITCH` keeps the pool for every prompt."""
    return switches.switched_off(SWITCH)


def inline_tokenizer(
    tokenize: Callable[[Any, Any], Any], pooled: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], Any]:
    """The renderer's ``_tokenize_prompt_async`` made from its ``_tokenize_prompt``
    (``tokenize``) and vLLM's pooled one (``pooled``): a future either way."""

    def tokenize_prompt_async(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or len(text) > INLINE_CHARS:
            return pooled(prompt, params)
        return answered(tokenize, prompt, params)

    tokenize_prompt_async.corewire_inline = True  # type: ignore[attr-defined]
    return tokenize_prompt_async


def install(renderer_class: Any) -> None:
    """Makes every ``renderer_class`` (vLLM's ``BaseRenderer``) built from now on tokenize
    short prompts on the loop (:func:`inline_tokenizer`), unless :data:`SWITCH` is off."""
    if switched_off() or getattr(renderer_class.__init__, "corewire_inline", False):
        return
    init = renderer_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._tokenize_prompt_async = inline_tokenizer(
            self._tokenize_prompt, self._tokenize_prompt_async
        )

    __init__.corewire_inline = True  # type: ignore[attr-defined]
    renderer_class.__init__ = __init__
