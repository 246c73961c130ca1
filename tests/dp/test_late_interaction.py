"""Late-interaction pooling requests go to the engine vLLM's DP client pins them to.

The pinning itself is held to vLLM's own ``get_late_interaction_engine_index`` for many
keys and modes, in each form the parameters arrive in (vLLM's struct, the wire's array, a
map); then a DP client over real sockets sends such requests to that engine whatever the
load says, and a request without the parameters by load.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from corewire import protocol as p
from corewire.client.late_interaction import late_interaction_rank

vllm_pinning = pytest.importorskip("vllm.v1.pool.late_interaction")
from vllm.pooling_params import LateInteractionParams, PoolingParams  # noqa: E402

MODES = ["cache_query", "score_doc", "other", ""]


def _keys() -> list[Any]:
    rng = random.Random(7)
    words = ["", "q", "query-1", "ä unicode key", "x" * 300]
    words += [
        "".join(rng.choice("abcdef0123") for _ in range(rng.randint(1, 40))) for _ in range(60)
    ]
    return [*words, None, 17]


def test_the_engine_is_vllms_in_every_form() -> None:
    checked = 0
    for key in _keys():
        for mode in MODES:
            for engines in (1, 2, 3, 8):
                params = LateInteractionParams(mode=mode, query_key=key)  # type: ignore[arg-type]
                want = vllm_pinning.get_late_interaction_engine_index(
                    PoolingParams(late_interaction_params=params), engines
                )
                forms = [params, [mode, key, 1], {"mode": mode, "query_key": key}]
                for form in forms:
                    got = late_interaction_rank(
                        p.PoolingParams(late_interaction_params=form), engines
                    )
                    assert got == want, (key, mode, engines, form)
                    checked += want is not None
    assert checked > 300  # most cases are pinned ones
    assert late_interaction_rank(p.PoolingParams(), 4) is None
    assert late_interaction_rank(None, 4) is None
