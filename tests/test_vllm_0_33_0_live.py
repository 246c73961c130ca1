"""vLLM 0.33.0's encoder -> corewire's decoder, live (runs only where vLLM 0.33.0 is installed).

The golden test checks corewire against frames vLLM 0.33.0 wrote once; this one runs the
same comparison against the installed vLLM itself, on the golden cases and on a batch of
varied outputs: each message is encoded by vLLM's ``MsgpackEncoder``, decoded by vLLM's
``MsgpackDecoder`` and by ``NativeDecoder(protocol=protocol_for_vllm(vllm.__version__))``,
the two results compared field by field, and the frames re-encoded by corewire's
``Encoder`` byte for byte. With vLLM 0.25.1 (the main environment) it is skipped.
"""

from __future__ import annotations

import importlib.util
import random
import warnings
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
if vllm.__version__.split("+")[0] != "0.33.0":
    pytest.skip(f"needs vLLM 0.33.0 (found {vllm.__version__})", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1 import engine as E  # noqa: E402
from vllm.v1.outputs import LogprobsLists  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from corewire.codec import Encoder, NativeDecoder  # noqa: E402
from corewire.versions import protocol_for_vllm  # noqa: E402
from golden_0_33_0_support import DATA, to_structs  # noqa: E402
from golden_support import jsonable  # noqa: E402


def _golden_cases() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cases()


def _varied_batch(seed: int) -> Any:
    """64 outputs, each with a random mix of fields (one finished id: see make_golden)."""
    rng = random.Random(seed)
    outputs = []
    for i in range(64):
        kw: dict[str, Any] = {}
        if rng.random() < 0.3:
            n = rng.randint(1, 3)
            kw["new_logprobs"] = LogprobsLists(
                np.arange(n * 6, dtype=np.int32).reshape(n, 6),
                np.full((n, 6), -0.5, dtype=np.float32),
                np.zeros(n, dtype=np.int32),
                None,
            )
        if rng.random() < 0.2:
            kw["kv_transfer_params"] = {"remote": i, "ids": [1, 2]}
        if rng.random() < 0.2:
            kw["ec_transfer_params"] = {"e": str(i)}
        if rng.random() < 0.1:
            kw["prompt_token_id_logprobs"] = torch.full((1, 2), -1.5)
        if rng.random() < 0.1:
            kw["mm_cache_miss_hashes"] = [f"h{i}"]
        if rng.random() < 0.1:
            kw["finish_reason"] = E.FinishReason.STOP
            kw["stop_reason"] = rng.choice([None, 7, "</s>"])
        kw["num_nans_in_logits"] = rng.choice([0, 0, 0, 1])
        outputs.append(E.EngineCoreOutput(f"req-{seed}-{i}", [rng.randint(0, 50000)], **kw))
    return E.EngineCoreOutputs(
        engine_index=seed % 2,
        outputs=outputs,
        timestamp=100.0 + seed,
        finished_requests={f"req-{seed}-0"},
        weight_version="default",
    )


MESSAGES = {**_golden_cases(), **{f"varied-{s}": _varied_batch(s) for s in range(8)}}


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_vllm_encodes_corewire_decodes_the_same(name: str) -> None:
    protocol = protocol_for_vllm(vllm.__version__)
    frames = [bytes(f) for f in MsgpackEncoder().encode(MESSAGES[name])]
    with warnings.catch_warnings():
        # vLLM's decoder wraps read-only bytes in tensors, which torch warns about
        warnings.simplefilter("ignore", UserWarning)
        want = jsonable(MsgpackDecoder(E.EngineCoreOutputs).decode(frames))
    got = NativeDecoder(protocol=protocol).decode(frames)
    assert jsonable(got) == want
    again = Encoder(protocol=protocol).encode(to_structs(got, protocol))
    assert [bytes(f) for f in again] == frames
