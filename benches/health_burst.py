"""A burst of requests against the health watchdog: no false kill (issue 24).

Sends ``--requests`` requests at once into one engine (default 1M) and, with ``--dp N``,
``--per-engine`` requests into each of N data-parallel engines (default 100k each), with
the watchdog on (``--interval``, ``--timeout``: 1 s and 5 s), while a consumer reads every
output and a prober runs health checks back to back. Prints, per run: how long sending
took, how long until every request was answered, the slowest health reply (how far it
lagged behind the burst), how many checks passed, and whether any engine was declared
dead. The engine is the model-free synthetic engine, so the engine's input path, not a
model, sets the pace. Exit status 1 if a request was left unanswered or an engine died.

    python benches/health_burst.py                        # 1M into one engine, 4 x 100k
    python benches/health_burst.py --requests 200000 --dp 0   # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from corewire import AsyncMPClient, DPLBAsyncMPClient, EngineDeadError
from corewire.protocol import EngineCoreRequest, SamplingParams

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
    )


async def _run(client: Any, count: int, timeout: float) -> dict[str, Any]:
    done = asyncio.Event()
    replies: list[float] = []

    async def probe() -> None:
        while not done.is_set():
            started = time.monotonic()
            await client.check_health_async(timeout)
            replies.append(time.monotonic() - started)

    async def consume() -> int:
        finished = 0
        while finished < count:
            outputs = await client.get_output_async()
            finished += sum(1 for o in outputs.outputs if o.finish_reason is not None)
        return finished

    started = time.monotonic()
    for i in range(count):
        await client.add_request_async(_request(f"r{i}"))
    sent = time.monotonic() - started
    prober = asyncio.ensure_future(probe())
    dead = None
    try:
        answered = await consume()
    except EngineDeadError as exc:
        answered, dead = -1, str(exc)
    done.set()
    try:
        await prober
    except EngineDeadError as exc:
        dead = dead or str(exc)
    return {
        "requests": count,
        "sent_s": sent,
        "answered_s": time.monotonic() - started,
        "answered": answered,
        "slowest_health_reply_s": max(replies, default=float("nan")),
        "checks_passed": len(replies),
        "dead": dead or client.engine_dead,
    }


def _report(name: str, r: dict[str, Any]) -> bool:
    ok = r["answered"] == r["requests"] and not r["dead"]
    print(
        f"{name}: {r['requests']:,} requests sent in {r['sent_s']:.1f} s, all answered "
        f"{r['answered_s']:.1f} s after the first; slowest health reply "
        f"{r['slowest_health_reply_s']:.1f} s, {r['checks_passed']} checks passed; "
        f"engine declared dead: {r['dead'] or 'no'} -> {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    return ok


async def main(args: argparse.Namespace) -> int:
    watchdog = {"health_check_interval": args.interval, "health_check_timeout": args.timeout}
    ok = True
    if args.requests:
        client = AsyncMPClient(engine=SYNTHETIC, **watchdog)
        try:
            ok &= _report("1 engine", await _run(client, args.requests, args.timeout))
        finally:
            client.shutdown()
    if args.dp:
        client = DPLBAsyncMPClient(data_parallel_size=args.dp, engine=SYNTHETIC, **watchdog)
        try:
            result = await _run(client, args.dp * args.per_engine, args.timeout)
            ok &= _report(f"{args.dp} DP engines", result)
        finally:
            client.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000, help="into one engine")
    parser.add_argument("--dp", type=int, default=4, help="DP engines (0: no DP run)")
    parser.add_argument("--per-engine", type=int, default=100_000, help="per DP engine")
    parser.add_argument("--interval", type=float, default=1.0, help="watchdog interval (s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="health timeout (s)")
    sys.exit(asyncio.run(main(parser.parse_args())))
