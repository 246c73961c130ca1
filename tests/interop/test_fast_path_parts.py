"""The parts of ``vllm serve``'s fast path that run without a vLLM server: the plugin's
switch (``COREWIRE_VLLM_FAST_PATH``) by release, the frame templates' split, the capture
of uvicorn's request-response cycle, under a real uvicorn server on loopback, and which
apps the direct routes serve around the router.

The fast path itself, against vLLM's own server, is ``test_vllm_fast_path.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from corewire import releases
from corewire.vllm.fast_path import TEXT_PROBE, Template, asgi_cycle, direct_route, split_template
from corewire.vllm.plugin import (
    FAST_PATH_SWITCH,
    FAST_PATH_VLLM_VERSIONS,
    fast_path_release,
    fast_path_wanted,
)
from fast_path_features import FEATURES, readme_rows, table_row
from paths_support import REPO_ROOT


def test_only_releases_checked_against_their_server_have_the_fast_path() -> None:
    assert FAST_PATH_VLLM_VERSIONS == ("0.33.0", "0.34.0")
    assert [r for r in releases.SUPPORTED if r.fast_path] == ["0.33.0", "0.34.0"]
    # An installed version is read through the releases package (a local label names
    # the same release; anything else has none).
    for version, name in (("0.34.0+cpu", "0.34.0"), ("0.33.0", "0.33.0")):
        found = fast_path_release(version)
        assert found is not None and found.name == name
    for other in ("0.32.0", "0.25.1", "0.34.1rc1", "not a version"):
        assert fast_path_release(other) is None


@pytest.mark.parametrize(
    ("switch", "version", "output", "wanted"),
    [
        ("", "0.34.0", True, True),
        ("", "0.34.0+cpu", True, True),
        ("", "0.34.0", False, False),
        ("", "0.25.1", True, False),
        ("", "0.33.0", True, True),
        ("", "0.32.0", True, False),
        ("0", "0.34.0", True, False),
        ("1", "0.34.0", True, True),
    ],
)
def test_switch(
    monkeypatch: pytest.MonkeyPatch, switch: str, version: str, output: bool, wanted: bool
) -> None:
    """Unset, the fast path follows native output processing under a release it is held
    to; ``0`` keeps vLLM's serving code everywhere."""
    monkeypatch.setenv(FAST_PATH_SWITCH, switch)
    assert fast_path_wanted(version, output) is wanted


def test_switch_on_where_it_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAST_PATH_SWITCH, "1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0, 0\.34\.0, not the installed 0\.25\.1"):
        fast_path_wanted("0.25.1", True)
    with pytest.raises(RuntimeError, match="native output processing, which is off"):
        fast_path_wanted("0.34.0", False)
    monkeypatch.setenv(FAST_PATH_SWITCH, "maybe")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        fast_path_wanted("0.34.0", True)


def test_readme_feature_table_is_the_checked_one() -> None:
    """docs/vllm.md's feature table is the list the live tests check (its fast-path column in
    test_vllm_fast_path.py, its Rust front-end column in test_vllm_rust_frontend.py), row
    for row."""
    readme = (REPO_ROOT / "docs" / "vllm.md").read_text()
    assert readme_rows(readme) == [table_row(f) for f in FEATURES]


def test_template_splits_around_the_text_and_the_logprobs() -> None:
    literal = '"\\u0000corewire-text-probe\\u0000"'
    assert TEXT_PROBE == "\x00corewire-text-probe\x00"
    frame = f'data: {{"a":1,"text":{literal},"logprobs":null,"z":2}}\n\n'.encode()
    assert split_template(frame) == Template(
        b'data: {"a":1,"text":',
        b',"logprobs":',
        b',"z":2}\n\n',
    )


def test_template_splits_around_the_token_ids_and_the_usage_after_the_logprobs() -> None:
    literal = '"\\u0000corewire-text-probe\\u0000"'
    frame = (
        f'data: {{"choices":[{{"text":{literal},"logprobs":null,"prompt_token_ids":null,'
        '"token_ids":null}],"usage":{"prompt_tokens":5,"total_tokens":987654322,'
        '"completion_tokens":987654321},"z":2}\n\n'
    ).encode()
    assert split_template(frame, token_ids=True) == Template(
        b'data: {"choices":[{"text":',
        b',"logprobs":',
        b'}],"usage":{"prompt_tokens":5,"total_tokens":987654322,'
        b'"completion_tokens":987654321},"z":2}\n\n',
        b',"prompt_token_ids":null,"token_ids":',
    )
    assert split_template(frame, token_ids=True, prompt_tokens=5) == Template(
        b'data: {"choices":[{"text":',
        b',"logprobs":',
        b'},"z":2}\n\n',
        b',"prompt_token_ids":null,"token_ids":',
        (b'}],"usage":{"prompt_tokens":5,"total_tokens":', b',"completion_tokens":', 5),
    )
    # Asked for without: the ids and the usage stay fixed in the tail.
    assert split_template(frame) == Template(
        b'data: {"choices":[{"text":',
        b',"logprobs":',
        b',"prompt_token_ids":null,"token_ids":null}],"usage":{"prompt_tokens":5,'
        b'"total_tokens":987654322,"completion_tokens":987654321},"z":2}\n\n',
    )
    # A frame without a hole asked for has no template with it.
    plain = f'data: {{"text":{literal},"logprobs":null}}\n\n'.encode()
    assert split_template(plain) is not None
    assert split_template(plain, token_ids=True) is None
    assert split_template(plain, prompt_tokens=5) is None
    # The completion tokens before the total: not the order the frames write.
    swapped = frame.replace(
        b'"total_tokens":987654322,"completion_tokens":987654321',
        b'"completion_tokens":987654321,"total_tokens":987654322',
    )
    assert swapped != frame
    assert split_template(swapped, prompt_tokens=5) is None


@pytest.mark.parametrize(
    "frame",
    [
        b'data: {"text":"x","logprobs":null}',  # no text probe
        b'data: {"m":"\\u0000corewire-text-probe\\u0000","text":"\\u0000corewire-text-probe'
        b'\\u0000","logprobs":null}',  # the probe twice (a model name holding it)
        b'data: {"text":"\\u0000corewire-text-probe\\u0000","logprobs":[]}',  # no null hole
    ],
)
def test_ambiguous_templates_are_refused(frame: bytes) -> None:
    assert split_template(frame) is None


async def _report_cycle(scope: Any, receive: Any, send: Any) -> None:
    # The app behind the capture: streams two chunks, then answers with the type of the
    # cycle it saw and whether the connection was caught up with each chunk it produced.
    connection = asgi_cycle.current_cycle()
    seen = []
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if connection is not None:
        seen.append(connection.caught_up(0))
    await send({"type": "http.response.body", "body": b"a", "more_body": True})
    if connection is not None:
        seen += [connection.caught_up(1), connection.caught_up(2)]
    cycle = connection.cycle if connection is not None else None
    report = f"|{type(cycle).__module__}.{type(cycle).__name__} {seen}"
    await send({"type": "http.response.body", "body": report.encode()})


def _holding(app: Any) -> Any:
    # A middleware that holds the body back until the response ends (as vLLM's response
    # logging does): the app's chunks are not on the wire when it produces them.
    async def held(scope: Any, receive: Any, send: Any) -> None:
        messages: list[Any] = []

        async def keep(message: Any) -> None:
            messages.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                for m in messages:
                    await send(m)

        await app(scope, receive, keep)

    return held


@contextlib.contextmanager
def _uvicorn(http: str, hold: bool = False) -> Iterator[int]:
    """A uvicorn server on loopback (protocol ``http``) serving the capture around
    :func:`_report_cycle` (``hold``: behind :func:`_holding`); its port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        asgi_cycle.CycleCapture(_holding(_report_cycle) if hold else _report_cycle),
        http=http,
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize(
    ("http", "hold", "seen"),
    [
        # Each chunk on the wire as the app produced it; not caught up with one to come.
        ("httptools", False, "httptools_impl.RequestResponseCycle [True, True, False]"),
        # Held back by a middleware: the app's first chunk is not on the wire yet.
        ("httptools", True, "httptools_impl.RequestResponseCycle [False, False, False]"),
        # h11 keeps per-connection state the fast path's writes would bypass: no cycle.
        ("h11", False, "builtins.NoneType []"),
    ],
)
def test_capture_sees_uvicorns_httptools_cycle_and_what_reached_it(
    http: str, hold: bool, seen: str
) -> None:
    """The capture finds uvicorn's httptools cycle (no other protocol's), and says the
    connection is caught up only when every chunk the app produced reached it."""
    pytest.importorskip(http)
    import httpx

    with _uvicorn(http, hold) as port:
        answer = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
    assert answer.status_code == 200
    assert answer.text.split("|", 1)[1].endswith(seen), answer.text
    # Outside a request, nothing is captured.
    assert asgi_cycle.current_cycle() is None


def _fastapi_app(*middleware: Any, route: bool = False) -> tuple[Any, Any]:
    # A FastAPI app with CORS (as vllm serve's) and ``middleware``, and its built stack;
    # ``route``: a /v1/completions route of its own.
    from fastapi import FastAPI
    from starlette.middleware.cors import CORSMiddleware

    app = FastAPI()
    app.add_middleware(CORSMiddleware, allow_origins=["*"])
    for layer in middleware:
        app.add_middleware(layer)
    if route:

        @app.post("/v1/completions")
        async def create_completion(body: dict) -> dict:
            return body

    return app, app.build_middleware_stack()


def test_direct_routes_run_only_middleware_they_know() -> None:
    """The direct routes run the app's middleware as copies only where they know every
    layer (vllm serve's own); a user's middleware keeps every request on the router,
    said by name, as does an app whose route is not vLLM's, or the switch."""
    from starlette.middleware.base import BaseHTTPMiddleware

    _, stack = _fastapi_app()
    layers, why = direct_route.middleware_refusal(stack)
    assert why is None
    names = [type(layer).__name__ for layer in layers]
    assert names == ["ServerErrorMiddleware", "CORSMiddleware", "ExceptionMiddleware"]

    class Audit(BaseHTTPMiddleware):
        async def dispatch(self, request: Any, call_next: Any) -> Any:
            return await call_next(request)

    _, stack = _fastapi_app(Audit)
    _, why = direct_route.middleware_refusal(stack)
    assert why == f"the app runs middleware {Audit.__module__}.{Audit.__qualname__}", why

    app, stack = _fastapi_app(route=True)
    routes = direct_route.DirectRoutes(stack)
    routes.prepare(app)
    assert routes.refusal == "POST /v1/completions is not vLLM's route"
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "app": app}
    assert routes.take(scope) is None


def test_direct_routes_off_by_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``COREWIRE_VLLM_DIRECT_ROUTE=0`` (the bench's ``corewire+fast/router`` stack sets
    it) keeps every request on the app's router."""
    from corewire.bench.serve import DIRECT_ROUTE_SWITCH, STACKS

    assert STACKS["corewire+fast/router"][1][DIRECT_ROUTE_SWITCH] == "0"
    assert DIRECT_ROUTE_SWITCH == direct_route.SWITCH
    monkeypatch.setenv(direct_route.SWITCH, "0")
    app, stack = _fastapi_app()
    routes = direct_route.DirectRoutes(stack)
    routes.prepare(app)
    assert routes.refusal == f"{direct_route.SWITCH} is off"


def test_direct_routes_leave_keep_alive_streams_to_the_app() -> None:
    """A server with ``--sse-keep-alive-interval`` wraps every stream in keep-alive
    comments in vLLM's routes: the direct routes leave its requests to the app."""
    from types import SimpleNamespace

    app, stack = _fastapi_app()
    app.state.args = SimpleNamespace(sse_keep_alive_interval=5.0)
    routes = direct_route.DirectRoutes(stack)
    routes.prepare(app)
    assert routes.refusal == "--sse-keep-alive-interval is set"


class _Renderer:
    """A renderer as vLLM's ``BaseRenderer`` builds its tokenization: the blocking
    ``_tokenize_prompt`` (a real tokenizer's encoding; it fails on an empty prompt) and
    the pooled ``_tokenize_prompt_async`` (``run_in_executor`` on a pool of its own)."""

    def __init__(self, pool: Any) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = {w: i for i, w in enumerate(["[UNK]", "hello", "tell", "me", "a", "story"])}
        tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        self.tokenizer = tokenizer
        self.threads: list[int] = []

        def pooled(prompt: Any, params: Any) -> Any:
            loop = asyncio.get_running_loop()
            return loop.run_in_executor(pool, self._tokenize_prompt, prompt, params)

        self._tokenize_prompt_async = pooled

    def _tokenize_prompt(self, prompt: dict[str, str], params: Any) -> dict[str, Any]:
        self.threads.append(threading.get_ident())
        if not prompt["prompt"]:
            raise ValueError("empty prompt")
        return {"prompt_token_ids": self.tokenizer.encode(prompt["prompt"]).ids}


def test_short_prompts_tokenize_on_the_loop_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short text prompt is tokenized by the same function on the loop's thread, a long
    one in the pool; the answers are the pool's; a failure reaches the await as the pool's
    does; the switch keeps the pool for everything."""
    from concurrent.futures import ThreadPoolExecutor

    from corewire.vllm.fast_path import inline_tokenize

    class Renderer(_Renderer):
        pass

    monkeypatch.delenv(inline_tokenize.SWITCH, raising=False)
    inline_tokenize.install(Renderer)
    inline_tokenize.install(Renderer)  # a second load of the plugin changes nothing
    short = {"prompt": "hello tell me a story"}
    long = {"prompt": "hello " * (inline_tokenize.INLINE_CHARS // 6 + 1)}

    async def run(renderer: _Renderer) -> tuple[Any, ...]:
        loop_thread = threading.get_ident()
        answers = [await renderer._tokenize_prompt_async(p, None) for p in (short, long)]
        with pytest.raises(ValueError, match="empty prompt"):
            await renderer._tokenize_prompt_async({"prompt": ""}, None)
        on_loop = [t == loop_thread for t in renderer.threads]
        return answers, on_loop

    with ThreadPoolExecutor(1) as pool:
        inline = Renderer(pool)
        answers, on_loop = asyncio.run(run(inline))
        assert on_loop == [True, False, True]
        pooled = _Renderer(pool)
        assert asyncio.run(run(pooled))[0] == answers
        assert answers[0] == {"prompt_token_ids": [1, 2, 3, 4, 5]}
        monkeypatch.setenv(inline_tokenize.SWITCH, "0")

        class Off(_Renderer):
            pass

        inline_tokenize.install(Off)
        assert asyncio.run(run(Off(pool)))[1] == [False] * 3


def _render_chat(
    threads: list[int], model_config: Any, tokenizer: Any, conversation: Any, **kwargs: Any
) -> list[int]:
    # As vLLM's safe_apply_chat_template: the template (Jinja), then the tokenization of
    # what it wrote; a template that refuses the input raises.
    import jinja2

    threads.append(threading.get_ident())
    template = kwargs.get("chat_template") or "{% for m in messages %}{{ m.content }} {% endfor %}"
    text = jinja2.Environment().from_string(template).render(messages=conversation)
    if "refuse" in text:
        raise ValueError("the template refused the chat")
    return tokenizer.encode(text).ids


class _ChatRenderer(_Renderer):
    """A renderer as vLLM's ``HfRenderer`` builds its chat rendering: the pooled
    ``_apply_chat_template_async`` (``run_in_executor`` on a pool of its own) of a blocking
    render-then-tokenize function."""

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self.render = functools.partial(_render_chat, self.threads)

        def pooled(*args: Any, **kwargs: Any) -> Any:
            call = functools.partial(self.render, *args, **kwargs)
            return asyncio.get_running_loop().run_in_executor(pool, call)

        self._apply_chat_template_async = pooled


class _OnlineRenderer:
    """vLLM's ``OnlineRenderer`` as far as it matters here: it holds the server's
    ``--chat-template``."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template


def test_short_chats_render_on_the_loop_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short chat with the model's template or the server's is rendered by the same
    function on the loop's thread; a long chat, one with data the bound cannot weigh, and
    a template a request brought go to the pool; the answers and a template's refusal are
    the pool's; the switch keeps the pool for everything."""
    from concurrent.futures import ThreadPoolExecutor

    from corewire.vllm.fast_path import inline_render

    class Renderer(_ChatRenderer):
        pass

    class Online(_OnlineRenderer):
        pass

    monkeypatch.delenv(inline_render.SWITCH, raising=False)
    monkeypatch.setattr(inline_render, "_server_templates", [])

    def install(cls: type) -> None:
        inline_render.install(cls, lambda *a, **k: cls.current.render(*a, **k), Online)

    install(Renderer)
    install(Renderer)  # a second load of the plugin changes nothing
    server_template = "{% for m in messages %}{{ m.content }} story {% endfor %}"
    Online(server_template)
    Online(server_template)  # registered once
    assert inline_render.server_templates().count(server_template) == 1
    # A request's template: the same text, but another string, as a request's JSON makes it.
    request_template = "".join(list(server_template))
    short = [{"role": "user", "content": "hello tell me"}]
    long = [{"role": "user", "content": "hello " * (inline_render.INLINE_CHARS // 6 + 1)}]
    odd = [{"role": "user", "content": "hello", "extra": object()}]
    big_tools = [{"name": "tell", "description": "x" * inline_render.INLINE_CHARS}]
    calls = [
        (short, {}),
        (short, {"chat_template": server_template, "add_generation_prompt": True}),
        (short, {"chat_template": None, "tools": [{"name": "tell"}]}),
        (long, {}),
        (odd, {}),
        (short, {"chat_template": request_template}),
        (short, {"tools": big_tools}),
    ]

    async def run(renderer: _ChatRenderer) -> tuple[Any, ...]:
        loop_thread = threading.get_ident()
        answers = [
            await renderer._apply_chat_template_async(None, renderer.tokenizer, c, **kw)
            for c, kw in calls
        ]
        # Not vLLM's call (the conversation by name): the pool, which takes any call.
        answers.append(
            await renderer._apply_chat_template_async(None, renderer.tokenizer, conversation=short)
        )
        with pytest.raises(ValueError, match="refused the chat"):
            chat = [{"role": "user", "content": "refuse"}]
            await renderer._apply_chat_template_async(None, renderer.tokenizer, chat)
        on_loop = [t == loop_thread for t in renderer.threads]
        return answers, on_loop

    with ThreadPoolExecutor(1) as pool:
        inline = Renderer(pool)
        Renderer.current = inline  # type: ignore[attr-defined]
        answers, on_loop = asyncio.run(run(inline))
        assert on_loop == [True, True, True, False, False, False, False, False, True]
        pooled = _ChatRenderer(pool)
        pooled_answers, pooled_on_loop = asyncio.run(run(pooled))
        assert pooled_answers == answers and not any(pooled_on_loop)
        assert answers[0] == [1, 2, 3] and answers[1] == [1, 2, 3, 5]
        monkeypatch.setenv(inline_render.SWITCH, "0")

        class Off(_ChatRenderer):
            pass

        install(Off)
        Off.current = Off(pool)  # type: ignore[attr-defined]
        assert asyncio.run(run(Off.current))[1] == [False] * 9


@pytest.mark.parametrize(
    ("value", "chars"),
    [
        ("hello", 5),
        ([{"role": "user", "content": "hi"}], 4 + 4 + 7 + 2),
        ({"n": 3, "flag": True, "none": None}, 1 + 1 + 4 + 1 + 4 + 1),
        (("a", ["b", ("c",)]), 3),
        ("x" * 2048, 2048),
        ("x" * 2049, None),
        ({"k": "x" * 2048}, None),
        ([[[[[[[["deep"]]]]]]]], 4),
        ([[[[[[[[["deep"]]]]]]]]], None),
        ({"tensor": object()}, None),
        (b"bytes", None),
    ],
)
def test_template_input_is_weighed_in_characters(value: Any, chars: int | None) -> None:
    """What a chat template sees is weighed in characters of plain data; anything else,
    too deep, or past the bound, is not weighed (the chat goes to the pool)."""
    from corewire.vllm.fast_path import inline_render

    assert inline_render.template_input_chars(value) == chars
