"""Image requests under corewire's client, against vLLM's own, over vLLM's real engine.

A tiny LLaVA (a CLIP vision tower and the tiny llama, real random weights from a seed,
:func:`corewire.vllm.serve.model_dir_llava.write_llava_dir`) behind two ``vllm serve`` servers on
vLLM's CPU build, one per client. Image chats, plain and streamed, with logprobs, each
image twice (the second time vLLM's multimodal cache sends only its hash), two images
that must answer differently, and text requests on the same server: every answer the same
on both, ids and timestamps aside. corewire's client hands requests with images to vLLM's
own encoder (:mod:`corewire.vllm.adapters.multimodal`), which says so once in the log.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

import httpx  # noqa: E402

from corewire.vllm.serve.model_dir_llava import IMAGE_SIZE, write_llava_dir  # noqa: E402
from real_engine_support import RealEngineServer, one_server_per_client  # noqa: E402
from serve_support import (  # noqa: E402
    PLUGIN_LOG_LINE,
    SharedPids,
    chat,
    completion,
    first_difference,
    joined_chat_stream,
    stream,
    without_ids,
)

_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree
ENCODER_LOG_LINE = "requests with multimodal inputs are written by vLLM's own encoder"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RealEngineServer]]:
    """One LLaVA server per client, started side by side, shared by the module."""
    root = tmp_path_factory.mktemp("real-engine-llava")
    args = ("--limit-mm-per-prompt", '{"image": 1}')
    with one_server_per_client(
        write_llava_dir(root / "model"), root, _SHARED_PIDS, args=args
    ) as made:
        yield made


def _image_url(color: tuple[int, int, int], stripe: int) -> str:
    """A PNG data URL: one colour, stripes of its complement every ``stripe`` columns."""
    from PIL import Image

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), color)
    inverse = tuple(255 - c for c in color)
    for x in range(0, IMAGE_SIZE, stripe):
        for y in range(IMAGE_SIZE):
            image.putpixel((x, y), inverse)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = [_image_url((200, 30, 30), 4), _image_url((30, 200, 60), 6)]


def _ask(image: str, text: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }


def _workload(http: httpx.Client) -> list[Any]:
    answers: list[Any] = []
    for _ in range(2):  # the second round meets vLLM's multimodal cache
        for image in IMAGES:
            answers.append(without_ids(chat(http, **_ask(image, "what is this"))))
            events = stream(
                http,
                "/v1/chat/completions",
                **_ask(image, "say more"),
                stream_options={"include_usage": True},
            )
            answers.append(joined_chat_stream(events))
    answers.append(without_ids(chat(http, messages=[{"role": "user", "content": "hello"}],
                                    max_tokens=6, temperature=0.0)))  # fmt: skip
    answers.append(without_ids(completion(http, prompt="the old house", max_tokens=6,
                                          temperature=0.0)))  # fmt: skip
    return answers


def test_image_and_text_requests_answer_as_under_vllms_client(
    servers: dict[str, RealEngineServer],
) -> None:
    runs = {}
    for name, server in servers.items():
        with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
            runs[name] = _workload(http)
    for i, (mine, theirs) in enumerate(zip(runs["corewire"], runs["vllm"], strict=True)):
        assert mine == theirs, f"answer {i}: {first_difference(mine, theirs)}"
    # Not vacuous: the images reached the model (two images, two answers; each image
    # the same answer with and without the cache).
    texts = [a["choices"][0]["message"]["content"] for a in runs["vllm"][0:8:2]]
    assert texts[0] != texts[1] and texts[0] == texts[2] and texts[1] == texts[3], texts


def test_the_corewire_server_says_who_encodes_images(
    servers: dict[str, RealEngineServer],
) -> None:
    log = servers["corewire"].log()
    assert PLUGIN_LOG_LINE in log
    assert log.count(ENCODER_LOG_LINE) == 1
    assert "Traceback" not in log
