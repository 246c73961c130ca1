"""NativeDecoder(protocol="0.33.0") vs vLLM 0.33.0's MsgpackDecoder, on vLLM 0.33.0's frames.

Run with vLLM 0.33.0 installed (corewire importable, e.g. on PYTHONPATH)::

    python benches/decode_0_33_0.py [--batches 1,256] [--seconds 0.2] [--repeats 7]

Frames are made as ``corewire bench decode`` makes them (``corewire.bench.decode.Wire``:
vLLM's own structs and encoder), so the numbers sit beside that benchmark's 0.25.1 ones:
ns per output, best of interleaved repeats, CPU time. Every decoded field is checked equal
to vLLM's first. (A later slice folds this into ``corewire bench decode``.)
"""

from __future__ import annotations

import argparse
import random
import sys

import vllm
from vllm.v1 import engine as vllm_engine
from vllm.v1.serial_utils import MsgpackDecoder

from corewire.bench import decode as bench
from corewire.bench.decode import Wire, differences, time_per_call, touch
from corewire.codec import NativeDecoder
from corewire.versions import protocol_for_vllm


def main(argv: list[str] | None = None) -> int:
    """Prints one line per case, batch and mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    protocol = protocol_for_vllm(vllm.__version__)
    bench._load_optional(True)
    wire = Wire(use_vllm=True)
    decs = {
        "vllm": MsgpackDecoder(vllm_engine.EngineCoreOutputs),
        "corewire": NativeDecoder(protocol=protocol),
    }
    fields = tuple(wire.outputs_cls.__struct_fields__)
    out_fields = tuple(wire.output_cls.__struct_fields__)
    print(f"vLLM {vllm.__version__}, protocol {protocol}; ns per output (CPU time)")
    print(f"{'case':>6} {'batch':>5} {'mode':>13} | {'vllm':>9} {'corewire':>9} | x vllm")
    for case in ("plain", "top-5"):
        for batch in (int(b) for b in args.batches.split(",")):
            frames = wire.frames(wire.message(case, batch, random.Random(batch)))
            want = decs["vllm"].decode(frames)
            bad = differences(want, decs["corewire"].decode(frames), fields, out_fields)
            if bad:
                print(f"corewire differs from vLLM in {bad[:5]}", file=sys.stderr)
                return 1
            for mode in ("decode", "decode+touch"):
                best = {}
                for name, dec in decs.items():
                    if mode == "decode":

                        def fn(dec=dec, frames=frames) -> None:
                            dec.decode(frames)
                    else:

                        def fn(dec=dec, frames=frames) -> None:
                            touch(dec.decode(frames))

                    best[name] = time_per_call(fn, args.seconds, args.repeats) * 1e9 / batch
                ratio = best["vllm"] / best["corewire"]
                print(
                    f"{case:>6} {batch:>5} {mode:>13} | {best['vllm']:>9.1f} "
                    f"{best['corewire']:>9.1f} | {ratio:.2f}x"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
