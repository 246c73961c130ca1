"""Every release corewire speaks, end to end between its own client and engine.

For each recorded vLLM release (``corewire.releases.SUPPORTED``, 0.25.1 to the newest):
a client of that protocol starts a real reference engine (torch, CPU) speaking it, sends
a request built in the release's own struct layout (``corewire.wire.layouts.types_for``: for a
release only recorded, no hand-kept class is involved; 0.34.0's prompt packed as an
int32 ndarray, as its front-end sends it), and reads the outputs back in that layout.
The reference engine is deterministic, so every release must yield the very tokens of
the default release: a release whose wire loses or misplaces a field the engine reads
(the prompt, ``max_tokens``, the stop rules) gives other tokens or none. A utility call
goes through each release as well. Runs in any environment (no vLLM).

Checks ``docs/protocol.md`` §11 (every recorded release's layouts, both directions).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from corewire import AsyncMPClient, releases
from corewire.protocol import FinishReason
from corewire.wire import layouts
from engine_support import LIGHT_REFERENCE

PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 6


def release_request(release: releases.Release, request_id: str, max_tokens: int) -> Any:
    """A greedy request that ignores EOS, in ``release``'s own ``EngineCoreRequest``."""
    types = layouts.types_for(release)
    sampling = types["SamplingParams"](temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt: Any = list(PROMPT)
    if release.packs_prompts:
        prompt = np.asarray(PROMPT, dtype=np.int32)
    return types["EngineCoreRequest"](
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=sampling,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


async def _run(release: releases.Release) -> tuple[list[int], Any, Any]:
    """The greedy tokens and finish reason of one request and a utility call's answer,
    through ``release``'s wire."""
    client = AsyncMPClient(engine_args=dict(LIGHT_REFERENCE), release=release)
    try:
        await client.add_request_async(release_request(release, "r", MAX_TOKENS))
        tokens: list[int] = []
        finish = None
        while finish is None:
            outputs = await asyncio.wait_for(client.get_output_async(), 60)
            for out in outputs.outputs:
                assert out.request_id == "r"
                tokens += out.new_token_ids
                finish = out.finish_reason
        answer = await client.call_utility_async("is_sleeping")
        return tokens, finish, answer
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def default_tokens() -> list[int]:
    tokens, finish, _ = asyncio.run(_run(releases.DEFAULT))
    assert finish == FinishReason.LENGTH and len(tokens) == MAX_TOKENS
    return tokens


@pytest.mark.parametrize("release", releases.SUPPORTED, ids=str)
def test_each_release_carries_a_request_and_its_outputs(
    release: releases.Release, default_tokens: list[int]
) -> None:
    tokens, finish, answer = asyncio.run(_run(release))
    assert tokens == default_tokens
    assert finish == FinishReason.LENGTH
    assert answer is False
