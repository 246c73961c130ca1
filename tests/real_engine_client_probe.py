"""Drives vLLM's real engine core with one engine-core client, outside vLLM's server.

    python tests/real_engine_client_probe.py MODEL_DIR vllm|corewire

The engine is started the way vLLM starts it (``launch_core_engines`` through the client
factory, from a ``VllmConfig`` made by vLLM's own ``AsyncEngineArgs``); the client is
vLLM's ``AsyncMPClient`` or corewire's (``corewire.vllm.adapters.classes.make_async_mp_client``).
It sends the same requests through either and prints one JSON document of what came back
(tokens, logprobs, finish reasons, an abort, utility answers), for
``test_vllm_real_engine_client.py`` to compare. A script of its own: vLLM spawns its
engine from this process, which must be a plain ``__main__``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


def _request(request_id: str, prompt: list[int], **sampling: Any) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA)
    return EngineCoreRequest(request_id, prompt, None, params, None, time.time(), None, None, None)


def _lists(logprobs: Any) -> Any:
    if logprobs is None:
        return None
    ids, values, ranks = logprobs[0], logprobs[1], logprobs[2]
    return [ids.tolist(), [[round(float(v), 5) for v in row] for row in values], ranks.tolist()]


async def _run_alone(client: Any, request: Any, abort_after: int | None = None) -> dict[str, Any]:
    """``request`` alone in the engine (a batch of one: sampled tokens and logprobs do
    not depend on what else the engine runs), to its end or, ``abort_after`` tokens in,
    aborted by the client."""
    seen: dict[str, Any] = {"tokens": [], "logprobs": [], "finish": None}
    await client.add_request_async(request)
    while seen["finish"] is None:
        if abort_after is not None and len(seen["tokens"]) >= abort_after:
            await client.abort_requests_async([request.request_id])
            # vLLM's engine reports no output for a request its client aborted: the
            # request stopped early is what both clients show.
            seen["stopped_early"] = True
            seen["tokens"] = None  # how many came before the abort landed is timing
            return seen
        outputs = await client.get_output_async()
        for out in outputs.outputs:
            if out.request_id != request.request_id:
                continue  # the last tokens of an aborted request, already on their way
            seen["tokens"] += out.new_token_ids
            if out.new_logprobs is not None:
                seen["logprobs"].append(_lists(out.new_logprobs))
            if out.finish_reason is not None:
                seen["finish"] = int(out.finish_reason)
    return seen


async def _drive(client: Any) -> dict[str, Any]:
    greedy = {"max_tokens": 10, "temperature": 0.0}
    seen = {
        "greedy": await _run_alone(
            client, _request("greedy", [5, 17, 99, 300], **greedy, logprobs=3)
        ),
        "seeded": await _run_alone(
            client, _request("seeded", [7, 8, 9], max_tokens=10, temperature=0.9, top_k=20, seed=11)
        ),
        "stop-id": await _run_alone(
            client, _request("stop-id", [5, 17, 99, 300], **greedy, stop_token_ids=[79])
        ),
        "aborted": await _run_alone(
            client,
            _request("aborted", [1, 2, 3], max_tokens=400, temperature=0.0, ignore_eos=True),
            abort_after=3,
        ),
    }
    # The engine serves on after the abort.
    after = await _run_alone(client, _request("after", [4, 5, 6], **greedy))
    seen["after-abort"] = after
    utilities = {
        "supported_tasks": list(await client.get_supported_tasks_async()),
        "is_sleeping": await client.is_sleeping_async(),
        "reset_prefix_cache": await client.reset_prefix_cache_async(),
        "check_health": await client.collective_rpc_async("check_health"),
    }
    return {"requests": seen, "utilities": utilities}


async def _main(model_dir: str, which: str) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.executor import Executor

    engine_args = AsyncEngineArgs(
        model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
        max_num_seqs=16,
    )  # fmt: skip
    config = engine_args.create_engine_config()
    if which == "corewire":
        from corewire.vllm.adapters.classes import make_async_mp_client
    else:
        from vllm.v1.engine.core_client import EngineCoreClient

        make_async_mp_client = EngineCoreClient.make_async_mp_client
    client = make_async_mp_client(config, Executor.get_class(config), False)
    try:
        result = await _drive(client)
    finally:
        client.shutdown()
    result["client"] = f"{type(client).__module__}.{type(client).__name__}"
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(_main(sys.argv[1], sys.argv[2]))))
