"""The per-token fast path of ``vllm serve`` (vLLM 0.33.0's and 0.34.0's OpenAI server): streaming
completions and chat completions whose chunks between the first and the last are written
without Python.

vLLM's server spends Python on every token of every stream: the waiting task's wake-up,
the ``RequestOutput``, the serving generator, the chunk's JSON, Starlette's and uvicorn's
``send``. For a streaming request whose options the fast path covers, the endpoint's
generator (:mod:`corewire.vllm.fast_path.completions`, :mod:`corewire.vllm.fast_path.chat`)
keeps Python for what happens once per request (vLLM's admission and rendering ran before
it; there the first chunk, the finish, the usage chunk, errors and ``[DONE]``, rendered as
vLLM renders them), and, once a chunk is on the wire with nothing of the request waiting,
attaches the request's native output state (``corewire._native.RequestText.
attach_stream``) to the connection: from then on each plain output becomes its SSE frame
in Rust, and the frames of every stream in a batch of engine outputs are written to their
connections by the batch's one call into the native output processor, with no Python per
stream or token. An output that needs Python (the engine's finish, an event) takes the
stream back first, so the chunks stay in order.

The modules import one way: this package's :func:`install` imports the two endpoints, and
they import what they share (:mod:`corewire.vllm.fast_path.shared`: routing a generator,
the checks a request passes, one stream's plumbing) and the SSE frames and their templates
(:mod:`corewire.vllm.fast_path.frames`); the chat endpoint also imports which server
parsers the frames can follow (:mod:`corewire.vllm.fast_path.parsers`). Only the frames,
which need no vLLM, are imported with the package, so that it imports under every vLLM
release; the rest needs 0.33.0's or 0.34.0's.
Once per request, short prompts are tokenized, and short chats rendered through their chat
template, on the event loop instead of through vLLM's pool
(:mod:`corewire.vllm.fast_path.inline_tokenize`, :mod:`corewire.vllm.fast_path.inline_render`),
``POST`` requests to the two endpoints skip the app's router
(:mod:`corewire.vllm.fast_path.direct_route`), and vLLM's environment variables are read
once the app is built, not on each request's access (:mod:`corewire.vllm.fast_path.envs_cache`).
``COREWIRE_VLLM_FAST_PATH=0`` turns it all off (:mod:`corewire.vllm.plugin`).
"""

from __future__ import annotations

from typing import Any

from corewire.vllm.fast_path import asgi_cycle
from corewire.vllm.fast_path.frames import TEXT_PROBE, Template, split_template

__all__ = ["INSTALLED_LOG_LINE", "TEXT_PROBE", "Template", "install", "split_template"]

#: Said in the API server's log once the fast path is in its app.
INSTALLED_LOG_LINE = (
    "streaming completions and chat completions take the fast path where they qualify"
)


def install(completion_class: Any, chat_class: Any) -> None:
    """Routes the streaming generators of vLLM's ``OpenAIServingCompletion`` and
    ``OpenAIServingChat`` through the fast path's, and makes vLLM's app builder wrap each
    app in :class:`corewire.vllm.fast_path.asgi_cycle.CycleCapture`."""
    if getattr(completion_class.completion_stream_generator, "corewire_fast_path", False):
        return  # vLLM loads plugins more than once per process
    # Imported here, not with the package: the endpoints need vLLM 0.33.0's or 0.34.0's
    # serving code.
    import vllm.entrypoints.launchers.app as launcher

    from corewire.vllm.fast_path import chat, completions, envs_cache
    from corewire.vllm.fast_path.shared import logger

    init_middleware = launcher.init_entrypoints_middleware

    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kw: Any) -> Any:
        result = init_middleware(args, app, *rest, **kw)
        asgi_cycle.install(app)
        envs_cache.install()
        # Said here, as the app is built, not when the plugin loads: vLLM 0.34.0 sets up
        # its logging after loading plugins and drops what they say at INFO before that.
        logger.info("corewire: %s", INSTALLED_LOG_LINE)
        return result

    launcher.init_entrypoints_middleware = init_entrypoints_middleware
    completions.install(completion_class)
    chat.install(chat_class)
    from vllm.renderers.base import BaseRenderer

    from corewire.vllm.fast_path import inline_tokenize

    inline_tokenize.install(BaseRenderer)
    _install_inline_render()


def _install_inline_render() -> None:
    # vLLM 0.34.0's renderers; a release that lays them out otherwise keeps its pool.
    from corewire.vllm.fast_path import inline_render

    try:
        from vllm.renderers import hf
        from vllm.renderers.online_renderer import OnlineRenderer
    except ImportError:
        return
    render = getattr(hf, "safe_apply_chat_template", None)
    if render is not None:
        inline_render.install(hf.HfRenderer, render, OnlineRenderer)
