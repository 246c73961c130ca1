"""Decode benchmark: MsgspecDecoder (reference) vs NativeDecoder (Rust), same frames.

Frames are built with ``corewire.codec.Encoder`` from realistic decode steps: request ids
like ``cmpl-<uuid>-0``, one new token per output (ids up to ~150k), about 2% of the
outputs finishing, optionally top-5 logprobs (``LogprobsLists`` of int32/float32 arrays
[1, 6] and int32 [1], sent inline). Both decoders run in one process, interleaved, on
the same frames, in two modes:

- ``decode``: decode the frame only;
- ``decode+touch``: also read ``request_id``, ``new_token_ids`` and ``finish_reason`` of
  every output, and the logprobs arrays when present (what a front-end always does).

Prints µs per frame, ns per output and the speed-up, checks that both decoders' results
are equal field by field, and says whether the goals at batch 256 decode+touch are met
(>= 2x without logprobs, >= 20x with). ``--plot FILE.png`` draws the table (needs
matplotlib), ``--quick`` runs a short version.

    python benches/decode.py [--quick] [--plot decode.png]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from corewire import protocol as p
from corewire.codec import Encoder, MsgspecDecoder, NativeDecoder

BATCHES = (1, 32, 256, 1024)
TOP_K = 5
VOCAB = 151_000
FINISH_EVERY = 50
GOALS = {False: 2.0, True: 20.0}  # batch 256, decode+touch: speed-up needed


def make_message(batch: int, logprobs: bool, rng: random.Random) -> p.EngineCoreOutputs:
    """One decode step of ``batch`` running requests."""
    outputs = []
    for i in range(batch):
        token = rng.randrange(VOCAB)
        lp = None
        if logprobs:
            ids = np.array([[token] + [rng.randrange(VOCAB) for _ in range(TOP_K)]], np.int32)
            values = np.array([[-rng.random() * 10 for _ in range(TOP_K + 1)]], np.float32)
            lp = p.LogprobsLists(ids, values, np.array([rng.randrange(TOP_K)], np.int32))
        finished = i % FINISH_EVERY == FINISH_EVERY - 1
        outputs.append(
            p.EngineCoreOutput(
                request_id=f"cmpl-{uuid.UUID(int=rng.getrandbits(128))}-0",
                new_token_ids=[token],
                new_logprobs=lp,
                finish_reason=p.FinishReason.STOP if finished else None,
                stop_reason=None,
            )
        )
    return p.EngineCoreOutputs(engine_index=0, outputs=outputs, timestamp=time.monotonic())


def touch(message: Any) -> None:
    """What a front-end reads of every output."""
    for out in message.outputs:
        out.request_id  # noqa: B018
        out.new_token_ids  # noqa: B018
        out.finish_reason  # noqa: B018
        lp = out.new_logprobs
        if lp is not None:
            lp.logprob_token_ids  # noqa: B018
            lp.logprobs  # noqa: B018
            lp.sampled_token_ranks  # noqa: B018


def _plain(v: Any) -> Any:
    """Comparable form of a decoded value (arrays by dtype, shape and bytes)."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return tuple(_plain(x) for x in v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def results_equal(a: Any, b: Any) -> bool:
    """Whether two decoded EngineCoreOutputs hold the same values and types, field by field."""

    def same(x: Any, y: Any) -> bool:
        return type(x) is type(y) and _plain(x) == _plain(y)

    for name in p.EngineCoreOutputs.__struct_fields__:
        if name != "outputs" and not same(getattr(a, name), getattr(b, name)):
            return False
    if len(a.outputs) != len(b.outputs):
        return False
    return all(
        same(getattr(x, name), getattr(y, name))
        for x, y in zip(a.outputs, b.outputs, strict=True)
        for name in p.EngineCoreOutput.__struct_fields__
    )


#: The clock: CPU time of this process by default, so that other load on a shared
#: machine (time this process spends descheduled) does not distort the numbers;
#: ``--wall`` switches to wall-clock time.
clock: Callable[[], float] = time.process_time


def time_per_call(fn: Callable[[], Any], min_seconds: float, repeats: int) -> float:
    """Best mean seconds per call over ``repeats`` runs of about ``min_seconds`` each."""
    calls = 1
    while True:  # calibrate
        start = clock()
        for _ in range(calls):
            fn()
        elapsed = clock() - start
        if elapsed >= min_seconds / 4:
            break
        calls *= 4
    calls = max(1, int(calls * min_seconds / max(elapsed, 1e-9) / 4 * 4))
    best = math.inf
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - start) / calls)
    return best


def run(quick: bool) -> list[dict[str, Any]]:
    """Times every configuration; returns one row per (batch, logprobs, mode)."""
    rng = random.Random(20250101)
    encoder = Encoder()
    reference = MsgspecDecoder(p.EngineCoreOutputs)
    native = NativeDecoder()
    min_seconds = 0.05 if quick else 0.3
    repeats = 3 if quick else 7
    rows = []
    for logprobs in (False, True):
        for batch in BATCHES:
            message = make_message(batch, logprobs, rng)
            # As received with copy=True: the payload and each aux frame as bytes.
            frames = [bytes(f) for f in encoder.encode(message)]
            equal = results_equal(reference.decode(frames), native.decode(frames))
            for mode in ("decode", "decode+touch"):
                if mode == "decode":

                    def ref_fn(frames: list[bytes] = frames) -> Any:
                        return reference.decode(frames)

                    def nat_fn(frames: list[bytes] = frames) -> Any:
                        return native.decode(frames)

                else:

                    def ref_fn(frames: list[bytes] = frames) -> Any:
                        return touch(reference.decode(frames))

                    def nat_fn(frames: list[bytes] = frames) -> Any:
                        return touch(native.decode(frames))

                # Interleave the two so that machine noise hits both alike.
                ref_times, nat_times = [], []
                for _ in range(2):
                    ref_times.append(time_per_call(ref_fn, min_seconds / 2, repeats))
                    nat_times.append(time_per_call(nat_fn, min_seconds / 2, repeats))
                    gc.collect()
                ref_s, nat_s = min(ref_times), min(nat_times)
                rows.append(
                    {
                        "batch": batch,
                        "logprobs": logprobs,
                        "mode": mode,
                        "frame_bytes": sum(len(f) for f in frames),
                        "msgspec_us": ref_s * 1e6,
                        "native_us": nat_s * 1e6,
                        "msgspec_ns_out": ref_s * 1e9 / batch,
                        "native_ns_out": nat_s * 1e9 / batch,
                        "ratio": ref_s / nat_s,
                        "equal": equal,
                    }
                )
                print_row(rows[-1])
    return rows


HEADER = (
    f"{'batch':>5} {'logprobs':>8} {'mode':>12} | {'msgspec µs/frame':>16} {'native µs/frame':>15}"
    f" | {'msgspec ns/out':>14} {'native ns/out':>13} | {'speed-up':>8} | equal"
)


def print_row(r: dict[str, Any]) -> None:
    """One line of the results table."""
    print(
        f"{r['batch']:>5} {'top-5' if r['logprobs'] else 'no':>8} {r['mode']:>12} | "
        f"{r['msgspec_us']:>16.2f} {r['native_us']:>15.2f} | "
        f"{r['msgspec_ns_out']:>14.1f} {r['native_ns_out']:>13.1f} | "
        f"{r['ratio']:>7.2f}x | {'yes' if r['equal'] else 'NO'}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Draws ns/output per batch size for both decoders; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, logprobs in zip(axes, (False, True), strict=True):
        for mode, style in (("decode", "--"), ("decode+touch", "-")):
            sel = [r for r in rows if r["logprobs"] == logprobs and r["mode"] == mode]
            xs = [r["batch"] for r in sel]
            ax.plot(
                xs,
                [r["msgspec_ns_out"] for r in sel],
                style,
                marker="o",
                label=f"MsgspecDecoder {mode}",
            )
            ax.plot(
                xs,
                [r["native_ns_out"] for r in sel],
                style,
                marker="s",
                label=f"NativeDecoder {mode}",
            )
            for r in sel:
                ax.annotate(
                    f"{r['ratio']:.1f}x",
                    (r["batch"], r["native_ns_out"]),
                    textcoords="offset points",
                    xytext=(0, -12),
                    ha="center",
                    fontsize=7,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("outputs per frame (batch)")
        ax.set_ylabel("ns per output")
        ax.set_title("with top-5 logprobs" if logprobs else "no logprobs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("corewire: decoding EngineCoreOutputs frames (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; exit status 1 if the decoders disagree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (less precise)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the results (matplotlib)")
    parser.add_argument(
        "--wall", action="store_true", help="time with the wall clock instead of CPU time"
    )
    args = parser.parse_args(argv)
    global clock
    clock = time.perf_counter if args.wall else time.process_time

    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}; "
        f"{'quick' if args.quick else 'full'} run; best of interleaved repeats; "
        f"{'wall-clock' if args.wall else 'CPU'} time"
    )
    print(HEADER)
    print("-" * len(HEADER))
    rows = run(args.quick)

    print()
    all_equal = all(r["equal"] for r in rows)
    print(
        f"results equal (every field of every output, both decoders): "
        f"{'yes' if all_equal else 'NO'}"
    )
    for logprobs, goal in GOALS.items():
        row = next(
            r
            for r in rows
            if r["batch"] == 256 and r["logprobs"] == logprobs and r["mode"] == "decode+touch"
        )
        verdict = "met" if row["ratio"] >= goal else "NOT met"
        print(
            f"goal at batch 256 decode+touch, {'top-5 logprobs' if logprobs else 'no logprobs'}:"
            f" >= {goal:g}x -> {row['ratio']:.2f}x ({verdict})"
        )
    if args.plot:
        if plot(rows, args.plot):
            print(f"plot written to {args.plot}")
        else:
            print("--plot: matplotlib is not installed; no plot drawn (pip install matplotlib)")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
