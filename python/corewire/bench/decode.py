"""``corewire bench decode``: corewire's NativeDecoder vs the installed vLLM's MsgpackDecoder.

The baseline is vLLM itself when it is installed, whichever of the releases corewire
speaks (``corewire.releases.SUPPORTED``: 0.25.1, 0.33.0): frames are made by that vLLM's
``MsgpackEncoder`` from its real ``EngineCoreOutputs`` structs, and its
``MsgpackDecoder(EngineCoreOutputs)`` decodes them next to corewire's
``NativeDecoder(release=release_for_vllm(vllm.__version__))``; corewire's pure-Python
``MsgspecDecoder`` of that version's structs (a vLLM-style reference) stays as an extra
column. Another vLLM release is refused (exit status 2, naming the supported ones) rather
than measured on a wire corewire would decode wrongly. Without vLLM the run says so, the
frames come from ``corewire.codec.Encoder`` (protocol 0.25.1) and ``MsgspecDecoder`` is
the only baseline. Under 0.33.0 every step carries ``weight_version="default"``, as
vLLM's engine stamps it.

Frames are the decode steps vLLM's scheduler sends: request ids like ``cmpl-<uuid>-0``,
one new token per output (ids up to ~150k), about 2% of the outputs finishing, at
batch 1, 32, 256 and 1024, in three cases:

- ``plain``: no logprobs;
- ``top-5``: sampled-token logprobs, per output a ``LogprobsLists`` of three tiny arrays
  that travel inline (extension type 3): ``1 x 6`` int32 token ids, ``1 x 6`` float32
  logprobs and the ``[1]`` int64 rank (vLLM's sampler counts ranks in int64), sliced per
  request from the step's arrays as vLLM's ``LogprobsLists.slice_request`` does;
- ``prompt``: prompt logprobs, per output a ``LogprobsTensors`` of a 64-token prompt
  with top-5 (``63 x 6`` int32 / float32 and ``[63]`` int64 tensors, over 256 bytes each
  so they travel as aux frames; needs torch).

Frames are handed to the decoders as ``zmq.Frame`` objects, as both clients receive them
(``recv_multipart(copy=False)``). Timed in one process, in rounds (15; 5 with
``--quick``): each round runs every decoder once for a short while (50 ms; 20 ms), the
decoders taking turns, so that a slow spell of a shared machine falls on all of them
alike. A decoder's time is its best round; the ``median`` column is the median over
rounds of the baseline's time over corewire's in the same round (a second reading of the
ratio, which a decoder's single lucky round cannot move). The modes:

- ``decode``: decode the frame only;
- ``decode+touch``: also read what a front-end reads of every output (``request_id``,
  ``new_token_ids``, ``finish_reason``, ``stop_reason`` of finished ones, both logprobs
  fields and the three arrays of each logprobs tuple). The goals are read on this mode;
- ``decode+tolist`` (logprobs cases): also what vLLM's ``LogprobsProcessor`` does with the
  arrays before detokenizing (unpack the tuple, per row ``.tolist()`` of ranks, logprobs
  and ids; the whole tensors' ``.tolist()`` for prompt logprobs), timed with the cyclic
  GC paused (the lists it makes trigger full collections, whose cost is the heap's).

Before any timing, every field of every output decoded by each decoder is compared with
the baseline's result (arrays by dtype, shape and bytes; enums by value; structs and
dataclasses field by field), and so are the lists the ``tolist`` mode produces. A further
untimed frame sets every optional field of the installed version's ``EngineCoreOutput``
(under 0.33.0 its new ones too: ``ec_transfer_params``, ``mm_cache_miss_hashes``,
``new_sampling_mask``, ``spec_decode_metrics``, ``prompt_token_id_logprobs``, ``error``)
and is compared the same way. Prints µs per frame, ns per output and the ratios
against the baseline; the goals at batch 256 (decode+touch) are >= 3x vLLM without
logprobs and >= 20x with top-5 logprobs. ``--plot FILE.png`` draws ns/output vs batch,
``--json FILE`` writes the results; exit status 1 if a decoder disagrees.

    corewire bench decode [--quick] [--plot decode.png] [--json decode.json] [--wall]
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import gc
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from corewire import protocol as cw
from corewire import releases
from corewire._optional import import_optional, is_installed
from corewire.bench import common
from corewire.codec import Encoder, MsgspecDecoder, native_decoder
from corewire.wire import layouts

__all__ = ["add_arguments", "run"]

# The baseline (vLLM) and torch are imported by _load_optional() when a run starts, so
# that building the `corewire bench` parser costs neither (each takes seconds).
vllm_engine: Any = None
vllm_outputs: Any = None
VllmDecoder: Any = None
VllmEncoder: Any = None
torch: Any = None
#: The wire version measured: the installed vLLM's (set by _load_optional), else
#: corewire's default.
release: str = releases.DEFAULT


def _load_optional(use_vllm: bool) -> None:
    """Import vLLM's structs and codec (when ``use_vllm``) and torch (when installed);
    set :data:`release` from the imported vLLM's ``__version__`` (may raise
    ``UnsupportedProtocolError``)."""
    global vllm_engine, vllm_outputs, VllmDecoder, VllmEncoder, torch, release
    if use_vllm:
        purpose = "the decode benchmark's vLLM baseline"
        vllm = import_optional("vllm", purpose)
        release = common.baseline_release(vllm.__version__)
        vllm_engine = import_optional("vllm.v1.engine", purpose)
        vllm_outputs = import_optional("vllm.v1.outputs", purpose)
        serial_utils = import_optional("vllm.v1.serial_utils", purpose)
        VllmDecoder = serial_utils.MsgpackDecoder
        VllmEncoder = serial_utils.MsgpackEncoder
    else:
        release = releases.DEFAULT
    if is_installed("torch"):  # prompt logprobs travel as torch tensors
        import torch


BATCHES = (1, 32, 256, 1024)
CASES = ("plain", "top-5", "prompt")
TOP_K = 5
PROMPT_LEN = 64
VOCAB = 151_000
FINISH_EVERY = 50
#: Goals at batch 256, decode+touch: ratio to vLLM's decoder needed, per case.
GOALS = {"plain": 3.0, "top-5": 20.0}


# -- frames --------------------------------------------------------------------------------


class Wire:
    """The structs and encoder frames are built with: vLLM's own if installed."""

    def __init__(self, use_vllm: bool) -> None:
        self.vllm = use_vllm
        if use_vllm:
            self.outputs_cls = vllm_engine.EngineCoreOutputs
            self.output_cls = vllm_engine.EngineCoreOutput
            self.finish_stop = vllm_engine.FinishReason.STOP
            self.lists_cls = vllm_outputs.LogprobsLists
            self.tensors_cls = vllm_outputs.LogprobsTensors
            self._encode = VllmEncoder().encode
        else:
            self.outputs_cls = cw.EngineCoreOutputs
            self.output_cls = cw.EngineCoreOutput
            self.finish_stop = cw.FinishReason.STOP
            self.lists_cls = cw.LogprobsLists
            self.tensors_cls = cw.LogprobsTensors
            self._encode = Encoder(release=release).encode

    def message(self, case: str, batch: int, rng: random.Random) -> Any:
        """One engine step of ``batch`` running requests."""
        tokens = [rng.randrange(VOCAB) for _ in range(batch)]
        step_lists = None
        if case == "top-5":
            # The sampler's arrays for the whole step; each output gets its row.
            ids = np.array(
                [[t] + [rng.randrange(VOCAB) for _ in range(TOP_K)] for t in tokens], np.int32
            )
            values = -np.sort(
                np.array(
                    [[rng.random() * 10 for _ in range(TOP_K + 1)] for _ in tokens], np.float32
                )
            )
            ranks = np.array([rng.randrange(1, 20) for _ in tokens], np.int64)
            step_lists = (ids, values, ranks)
        outputs = []
        for i, token in enumerate(tokens):
            new_logprobs = prompt = None
            if step_lists is not None:
                ids, values, ranks = step_lists
                new_logprobs = self.lists_cls(ids[i : i + 1], values[i : i + 1], ranks[i : i + 1])
            if case == "prompt":
                n = PROMPT_LEN - 1
                prompt = self.tensors_cls(
                    torch.randint(0, VOCAB, (n, TOP_K + 1), dtype=torch.int32),
                    -torch.rand((n, TOP_K + 1), dtype=torch.float32) * 10,
                    torch.randint(1, 20, (n,), dtype=torch.int64),
                )
            finished = i % FINISH_EVERY == FINISH_EVERY - 1
            outputs.append(
                self.output_cls(
                    request_id=f"cmpl-{uuid.UUID(int=rng.getrandbits(128))}-0",
                    new_token_ids=[token],
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs_tensors=prompt,
                    finish_reason=self.finish_stop if finished else None,
                )
            )
        return self.outputs_cls(
            engine_index=0, outputs=outputs, timestamp=time.monotonic(), **self._step_extra()
        )

    def _step_extra(self) -> dict[str, Any]:
        # 0.33.0's engine stamps its weight version on every step's message.
        if "weight_version" in self.outputs_cls.__struct_fields__:
            return {"weight_version": "default"}
        return {}

    def every_field(self, rng: random.Random) -> Any:
        """An untimed step whose outputs set every optional field the version's
        ``EngineCoreOutput`` has that a step can carry (0.33.0's new ones included), so
        that the equality check covers them."""
        fields = set(self.output_cls.__struct_fields__)
        n = PROMPT_LEN - 1
        values: dict[str, Any] = {
            "stop_reason": "</s>",
            "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": [1, 2, 3]},
            "ec_transfer_params": {"ec_cache": "hit", "blocks": [4, 5]},
            "trace_headers": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-01"},
            "num_nans_in_logits": 3,
            "routed_experts": np.arange(24, dtype=np.int32).reshape(4, 6),
            "mm_cache_miss_hashes": ["a1b2", "c3d4"],
        }
        if torch is not None:
            values["pooling_output"] = torch.arange(8, dtype=torch.float32)
            if "prompt_token_id_logprobs" in fields:
                values["prompt_token_id_logprobs"] = -torch.rand(n, dtype=torch.float32)
        if self.vllm and "new_sampling_mask" in fields:
            values["new_sampling_mask"] = vllm_outputs.SamplingMaskLists(
                np.array([3, 17, 99, 4], np.int32), np.array([0, 2, 4], np.int32), [0, 2]
            )
        elif "new_sampling_mask" in fields:
            values["new_sampling_mask"] = layouts.SamplingMaskLists(
                np.array([3, 17, 99, 4], np.int32), np.array([0, 2, 4], np.int32), [0, 2]
            )
        if self.vllm and "spec_decode_metrics" in fields:
            stats = import_optional("vllm.v1.metrics.stats", "the decode benchmark")
            values["spec_decode_metrics"] = stats.RequestSpecDecodeMetrics(
                num_spec_tokens=3, histogram=[1, 0, 2, 5], num_draft_tokens=21
            )
        outputs = [
            self.output_cls(
                request_id=f"cmpl-{uuid.UUID(int=rng.getrandbits(128))}-0",
                new_token_ids=[rng.randrange(VOCAB)],
                finish_reason=self.finish_stop,
                **{k: v for k, v in values.items() if k in fields},
            )
        ]
        if self.vllm and "error" in fields:
            request_error = import_optional("vllm.outputs", "the decode benchmark").RequestError
            outputs.append(
                self.output_cls(
                    request_id=f"cmpl-{uuid.UUID(int=rng.getrandbits(128))}-0",
                    new_token_ids=[],
                    finish_reason=vllm_engine.FinishReason.ERROR,
                    error=request_error("engine_paused", "paused for a weight update", True),
                )
            )
        return self.outputs_cls(
            engine_index=0, outputs=outputs, timestamp=time.monotonic(), **self._step_extra()
        )

    def frames(self, message: Any) -> list[zmq.Frame]:
        """The message's frames as a client receives them (``copy=False``)."""
        return [zmq.Frame(bytes(f)) for f in self._encode(message)]


# -- what a front-end does with a decoded frame --------------------------------------------


def touch(message: Any) -> None:
    """What a front-end reads of every output."""
    for out in message.outputs:
        out.request_id  # noqa: B018
        out.new_token_ids  # noqa: B018
        if out.finish_reason is not None:
            out.stop_reason  # noqa: B018
        lp = out.new_logprobs
        if lp is not None:
            lp.logprob_token_ids  # noqa: B018
            lp.logprobs  # noqa: B018
            lp.sampled_token_ranks  # noqa: B018
        lp = out.new_prompt_logprobs_tensors
        if lp is not None:
            lp.logprob_token_ids  # noqa: B018
            lp.logprobs  # noqa: B018
            lp.selected_token_ranks  # noqa: B018


def tolist(message: Any) -> list[Any]:
    """What vLLM's LogprobsProcessor turns the arrays into (before detokenizing)."""
    got = []
    for out in message.outputs:
        lp = out.new_logprobs
        if lp is not None:
            token_ids, logprobs, ranks = lp[:3]
            for rank, row, ids in zip(ranks, logprobs, token_ids):  # noqa: B905 (as vLLM)
                got.append((rank.tolist(), row.tolist(), ids.tolist()))
        lp = out.new_prompt_logprobs_tensors
        if lp is not None:
            token_ids, logprobs, ranks = lp[:3]  # 0.25.1 has 4 elements, 0.33.0 has 5
            got.append((ranks.tolist(), logprobs.tolist(), token_ids.tolist()))
    return got


# -- equality --------------------------------------------------------------------------------


def plain(v: Any) -> Any:
    """Comparable form of a decoded value: arrays and tensors by dtype, shape and bytes,
    enums by value, named tuples and lists element by element, structs and dataclasses
    as maps of their fields (vLLM 0.33.0 decodes ``error`` and ``spec_decode_metrics`` to
    dataclasses, corewire to a frozen struct and a map)."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if torch is not None and isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape), v.contiguous().numpy().tobytes())
    if isinstance(v, enum.Enum):
        return ("enum", v.name, v.value)
    if isinstance(v, tuple):
        return (type(v).__name__, *(plain(x) for x in v))
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return ("set", sorted(plain(x) for x in v))
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, msgspec.Struct):
        return {k: plain(getattr(v, k)) for k in v.__struct_fields__}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return (type(v).__name__, v)


def differences(expected: Any, got: Any, fields: tuple[str, ...], out_fields: tuple[str, ...]):
    """Where ``got`` (a decoded EngineCoreOutputs) differs from ``expected``: field names."""
    bad = [
        f
        for f in fields
        if f != "outputs" and plain(getattr(expected, f)) != plain(getattr(got, f))
    ]
    if len(expected.outputs) != len(got.outputs):
        return [*bad, "len(outputs)"]
    for i, (x, y) in enumerate(zip(expected.outputs, got.outputs, strict=True)):
        bad += [
            f"outputs[{i}].{f}" for f in out_fields if plain(getattr(x, f)) != plain(getattr(y, f))
        ]
    return bad


# -- timing ----------------------------------------------------------------------------------

#: The clock: CPU time of this process by default, so that other load on a shared
#: machine (time this process spends descheduled) does not distort the numbers;
#: ``--wall`` switches to wall-clock time.
clock: Callable[[], float] = time.process_time


#: ``quick -> (rounds, seconds per run)``. Many short runs in turns rather than a few long
#: ones: on a shared machine slow spells last about a second, and a decoder timed only
#: inside one reads slow.
TIMING = {False: (15, 0.05), True: (5, 0.02)}


def calls_for(fn: Callable[[], Any], seconds: float) -> int:
    """How many calls of ``fn`` take about ``seconds`` (calibrated by running it)."""
    calls = 1
    while True:
        start = clock()
        for _ in range(calls):
            fn()
        elapsed = clock() - start
        if elapsed >= seconds / 4:
            return max(1, int(calls * seconds / max(elapsed, 1e-9)))
        calls *= 4


def seconds_per_call(fn: Callable[[], Any], calls: int) -> float:
    """Mean seconds per call over one run of ``calls`` calls."""
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def rounds_of(
    fns: dict[str, Callable[[], Any]], rounds: int, seconds: float, gc_off: bool
) -> dict[str, list[float]]:
    """Seconds per call of each function, one short run each per round, the functions
    taking turns (the first one moving each round), so that the machine's slow spells
    fall on all of them alike; the collector paused during each run with ``gc_off``."""
    calls = {name: calls_for(fn, seconds) for name, fn in fns.items()}
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if gc_off:
                gc.disable()
            try:
                times[name].append(seconds_per_call(fns[name], calls[name]))
            finally:
                gc.enable()
        gc.collect()
    return times


def paired_median(times: dict[str, list[float]], name: str, over: str) -> float:
    """The median over rounds of ``name``'s time over ``over``'s in the same round."""
    return statistics.median(a / b for a, b in zip(times[name], times[over], strict=True))


def decoders(use_vllm: bool) -> dict[str, Any]:
    """The decoders compared, baseline first."""
    found: dict[str, Any] = {}
    if use_vllm:
        found["vllm"] = VllmDecoder(vllm_engine.EngineCoreOutputs)
    found["msgspec"] = MsgspecDecoder(layouts.types_for(release)["EngineCoreOutputs"])
    found["corewire"] = native_decoder(release)
    return found


def modes(case: str) -> tuple[str, ...]:
    """The modes timed for a case."""
    if case == "plain":
        return ("decode", "decode+touch")
    return ("decode", "decode+touch", "decode+tolist")


def check(decs: dict[str, Any], frames: list[zmq.Frame], wire: Wire) -> list[str]:
    """What any decoder gets wrong, compared with the first (the baseline): every field of
    every output, and the lists vLLM's logprobs code makes of the arrays."""
    fields = tuple(wire.outputs_cls.__struct_fields__)
    out_fields = tuple(wire.output_cls.__struct_fields__)
    names = list(decs)
    expected = decs[names[0]].decode(frames)
    wrong = []
    for name in names[1:]:
        got = decs[name].decode(frames)
        bad = differences(expected, got, fields, out_fields)
        if tolist(got) != tolist(expected):
            bad.append("tolist()")
        wrong += [f"{name}: {b}" for b in bad[:5]]
    return wrong


def check_every_field() -> list[str]:
    """What any decoder gets wrong on :meth:`Wire.every_field`'s untimed step."""
    use_vllm = vllm_engine is not None
    wire = Wire(use_vllm)
    return check(decoders(use_vllm), wire.frames(wire.every_field(random.Random(7))), wire)


def measure(quick: bool, cases: tuple[str, ...], batches: tuple[int, ...]) -> list[dict[str, Any]]:
    """Times every configuration; returns one row per (case, batch, mode)."""
    use_vllm = vllm_engine is not None
    wire = Wire(use_vllm)
    decs = decoders(use_vllm)
    names = list(decs)
    rng = random.Random(20250101)
    if torch is not None:
        torch.manual_seed(20250101)
    rounds, seconds = TIMING[quick]
    rows = []
    for case in cases:
        for batch in batches:
            frames = wire.frames(wire.message(case, batch, rng))
            wrong = check(decs, frames, wire)
            for mode in modes(case):
                fns = {name: _timed(mode, dec.decode, frames) for name, dec in decs.items()}
                # The lists decode+tolist makes trigger full collections whose cost is
                # the whole heap's, not the decoder's: timed with the collector paused
                # (the other modes run with it as usual).
                times = rounds_of(fns, rounds, seconds, gc_off=mode == "decode+tolist")
                seconds_best = {name: min(t) for name, t in times.items()}
                row = {
                    "case": case,
                    "batch": batch,
                    "mode": mode,
                    "frame_bytes": sum(len(f.bytes) for f in frames),
                    "frames": len(frames),
                    "us": {n: s * 1e6 for n, s in seconds_best.items()},
                    "ns_out": {n: s * 1e9 / batch for n, s in seconds_best.items()},
                    "paired_ratios": {
                        n: paired_median(times, n, "corewire") for n in names if n != "corewire"
                    },
                    "rounds": rounds,
                    "round_us": {n: [t * 1e6 for t in ts] for n, ts in times.items()},
                    "baseline": names[0],
                    "wrong": wrong,
                }
                rows.append(row)
                print_row(row, names)
    return rows


def _timed(mode: str, decode: Callable[[Any], Any], frames: list[zmq.Frame]) -> Callable[[], Any]:
    if mode == "decode":
        return lambda: decode(frames)
    if mode == "decode+touch":
        return lambda: touch(decode(frames))
    return lambda: tolist(decode(frames))


def header(names: list[str]) -> str:
    """The results table's header."""
    us = "".join(f"{n + ' µs':>13}" for n in names)
    ns = "".join(f"{n[:8] + ' ns/out':>16}" for n in names)
    ratios = "".join(f"{'x ' + n:>11}" for n in names[:-1])
    return f"{'case':>6} {'batch':>5} {'mode':>13} |{us} |{ns} |{ratios} |{'median':>8} | equal"


def print_row(r: dict[str, Any], names: list[str]) -> None:
    """One line of the results table."""
    us = "".join(f"{r['us'][n]:>13.2f}" for n in names)
    ns = "".join(f"{r['ns_out'][n]:>16.1f}" for n in names)
    ratios = "".join(f"{r['us'][n] / r['us']['corewire']:>10.2f}x" for n in names[:-1])
    median = f"{r['paired_ratios'][r['baseline']]:>7.2f}x"
    print(
        f"{r['case']:>6} {r['batch']:>5} {r['mode']:>13} |{us} |{ns} |{ratios} |{median} | "
        f"{'NO' if r['wrong'] else 'yes'}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Draws ns/output (decode+touch) per batch size, one panel per case (matplotlib)."""
    plt = common.pyplot()
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.5), squeeze=False)
    labels = {
        "vllm": f"vLLM {release} MsgpackDecoder",
        "msgspec": "MsgspecDecoder (reference)",
        "corewire": f"corewire NativeDecoder ({release})",
    }
    styles = {"vllm": ("o", "-"), "msgspec": ("^", ":"), "corewire": ("s", "-")}
    for ax, case in zip(axes[0], cases, strict=True):
        sel = [r for r in rows if r["case"] == case and r["mode"] == "decode+touch"]
        xs = [r["batch"] for r in sel]
        for name in sel[0]["us"]:
            marker, line = styles[name]
            ax.plot(xs, [r["ns_out"][name] for r in sel], line, marker=marker, label=labels[name])
        for r in sel:
            ax.annotate(
                f"{r['us'][r['baseline']] / r['us']['corewire']:.1f}x",
                (r["batch"], r["ns_out"]["corewire"]),
                textcoords="offset points",
                xytext=(0, -13),
                ha="center",
                fontsize=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("outputs per frame (batch)")
        ax.set_ylabel("ns per output (decode + touch)")
        ax.set_title(
            {
                "plain": "no logprobs",
                "top-5": "top-5 logprobs (inline arrays)",
                "prompt": f"prompt logprobs ({PROMPT_LEN} tokens, top-5, tensors)",
            }[case]
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    baseline = rows[0]["baseline"]
    fig.suptitle(
        f"Decoding EngineCoreOutputs frames, ratio to {labels[baseline]} annotated"
        " (lower is better)"
    )
    common.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``corewire bench decode``'s flags."""
    common.add_common_arguments(parser)
    parser.add_argument(
        "--wall", action="store_true", help="time with the wall clock instead of CPU time"
    )
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}"
    )
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes"
    )


def _parse(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[int, ...]] | str:
    """The cases and batch sizes asked for, or what is wrong with them."""
    cases = tuple(c for c in args.cases.split(",") if c)
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        return f"--cases: unknown case(s) {unknown or '(none given)'}; known: {', '.join(CASES)}"
    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b)
    except ValueError:
        return f"--batches: not a list of integers: {args.batches!r}"
    if not batches or min(batches) < 1:
        return "--batches: batch sizes must be at least 1"
    return cases, batches


def goals(rows: list[dict[str, Any]]) -> list[common.Goal]:
    """The goals at batch 256, decode+touch, for the cases that ran."""
    found = []
    for case, target in GOALS.items():
        row = next(
            (
                r
                for r in rows
                if r["batch"] == 256 and r["case"] == case and r["mode"] == "decode+touch"
            ),
            None,
        )
        if row is not None:
            baseline = row["baseline"]
            found.append(
                common.Goal(
                    f"{case}, batch 256, decode+touch: x {baseline}",
                    row["us"][baseline] / row["us"]["corewire"],
                    target,
                )
            )
    return found


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark; exit status 1 if a decoder disagrees with the baseline, 2 for
    bad arguments or an installed vLLM release corewire does not speak."""
    parsed = _parse(args)
    if isinstance(parsed, str):
        print(f"corewire bench decode: {parsed}", file=sys.stderr)
        return 2
    if not common.check_plot_possible("corewire bench decode", args):
        return 2
    cases, batches = parsed
    global clock
    clock = time.perf_counter if args.wall else time.process_time
    vllm_version = common.vllm_version()
    use_vllm = vllm_version is not None
    try:
        # Checked on the installed distribution's version first (before seconds of
        # importing vLLM), then on the imported vllm.__version__ by _load_optional.
        common.baseline_release(vllm_version)
        _load_optional(use_vllm)
    except releases.UnsupportedProtocolError as e:
        print(
            f"corewire bench decode: {e}; the baseline must be one of those releases"
            " (its MsgpackDecoder is measured on the wire corewire speaks for it)",
            file=sys.stderr,
        )
        return 2
    if torch is None and "prompt" in cases:
        print(
            "torch is not installed: the prompt-logprobs case is skipped"
            " (pip install 'corewire[torch]')"
        )
        cases = tuple(c for c in cases if c != "prompt")

    print(
        f"{time.strftime('%Y-%m-%d')}; python {platform.python_version()}, numpy {np.__version__}"
        f"; {os.cpu_count()} CPUs; {'quick' if args.quick else 'full'} run; best of "
        f"{TIMING[args.quick][0]} rounds in turns (median: of the rounds' paired ratios);"
        f" {'wall-clock' if args.wall else 'CPU'} time"
    )
    if use_vllm:
        print(
            f"baseline: vLLM {vllm_version} MsgpackDecoder on frames from its MsgpackEncoder;"
            f" corewire NativeDecoder(release={release!r})"
        )
    else:
        print(
            f"vLLM is not installed: no comparison with vLLM {common.VLLM_VERSION}; baseline is"
            f" corewire's MsgspecDecoder (reference) (pip install vllm=={common.VLLM_VERSION});"
            f" release {release!r}"
        )
    names = list(decoders(use_vllm))
    print(header(names))
    print("-" * len(header(names)))
    rows = measure(args.quick, cases, batches)

    print()
    every_field_wrong = check_every_field()
    wrong = [w for r in rows for w in r["wrong"]] + [
        f"every-field step: {w}" for w in every_field_wrong
    ]
    baseline = names[0]
    print(f"every field of every output equal to {baseline}'s: {'yes' if not wrong else 'NO'}")
    print(
        "  (the timed steps, and an untimed step setting every optional field of release"
        f" {release}'s EngineCoreOutput: {'equal' if not every_field_wrong else 'NOT equal'})"
    )
    for w in dict.fromkeys(wrong):
        print(f"  differs: {w}")
    found = goals(rows)
    for goal in found:
        verdict = "met" if goal.met else "NOT met"
        case = goal.name.split(",")[0]
        median = next(
            r["paired_ratios"][baseline]
            for r in rows
            if r["batch"] == 256 and r["case"] == case and r["mode"] == "decode+touch"
        )
        print(
            f"goal at batch 256 decode+touch, {case}: >= {goal.target:g}x "
            f"{baseline} -> {goal.value:.2f}x ({verdict}; median of paired rounds"
            f" {median:.2f}x)"
        )
    logprobs_cost = None
    for_lists = {
        r["case"]: r["ns_out"]
        for r in rows
        if r["batch"] == 256 and r["mode"] == "decode" and r["case"] in ("plain", "top-5")
    }
    if len(for_lists) == 2:
        logprobs_cost = {n: for_lists["top-5"][n] - for_lists["plain"][n] for n in names}
        print(
            "top-5 logprobs at batch 256, decode: "
            + ", ".join(
                f"{n} +{logprobs_cost[n]:.0f} ns per output ({logprobs_cost[n] / 3:.0f} ns per"
                " array)"
                for n in names
            )
            + " over plain"
        )
    if args.json:
        cases_out = [
            {
                **{k: v for k, v in r.items() if k != "wrong"},
                "ratios": {n: r["us"][n] / r["us"]["corewire"] for n in names if n != "corewire"},
                "equal": not r["wrong"],
                "differences": r["wrong"],
            }
            for r in rows
        ]
        common.write_json(
            args.json,
            "decode",
            baseline=baseline,
            release=release,
            options={
                "quick": args.quick,
                "clock": "wall" if args.wall else "cpu",
                "cases": list(cases),
                "batches": list(batches),
            },
            cases=cases_out,
            goals=found,
            units={"us": "µs per frame", "ns_out": "ns per output", "ratios": "x corewire"},
            logprobs_cost_ns_per_output=logprobs_cost,
            every_field_equal=not every_field_wrong,
            equal=not wrong,
        )
        print(f"results written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if wrong else 0
