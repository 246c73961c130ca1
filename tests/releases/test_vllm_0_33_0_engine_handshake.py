"""``corewire engine --release 0.33.0 --handshake-address`` joins vLLM 0.33.0's front-end.

The 0.33.0 counterpart of ``test_vllm_engine_handshake.py``: vLLM 0.33.0's engine-core
client built the way ``vllm serve --data-parallel-size-local 0`` builds it (its own
factory, a handshake ROUTER on ``--data-parallel-rpc-port``, and with DP > 1 vLLM
0.33.0's own DP coordinator process); the engines are ``corewire engine`` processes
started first. The HELLO / metadata / READY handshake is unchanged in 0.33.0; the
coordinator now publishes ``[waiting, running, kv_cache_usage]`` per engine, which the
engines' reports feed.

Runs only where vLLM 0.33.0 is installed (skipped under 0.25.1; with
``COREWIRE_REQUIRE_VLLM`` set, a missing or other vLLM fails instead).

Checks ``docs/vllm-0.33.0-notes.md`` §5.2 (HELLO, metadata, READY) and §5.3 (the DP
coordinator's counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_0_33_0_gate import RELEASE, require_vllm_0_33_0

vllm = require_vllm_0_33_0()

from vllm.v1.engine.core_client import EngineCoreClient  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402

from corewire import releases  # noqa: E402
from vllm_join_support import (  # noqa: E402
    Joining,
    assert_one_engine_joins,
    private_root,
    two_engines_behind_vllms_coordinator,
)
from vllm_support import offline_environment  # noqa: E402

offline_environment()


def _make_client(config: Any) -> Any:
    # 0.33.0's AsyncLLM passes keywords (and a renderer, None for text).
    return EngineCoreClient.make_async_mp_client(
        vllm_config=config, executor_class=Executor, log_stats=False
    )


#: What the release under test does (its class, read as the modules around read it).
RELEASE_FACTS = releases.get(RELEASE)
#: The release's wire: from 0.27.0 step messages carry a weight version, others none.
JOINING = Joining(
    RELEASE,
    90,
    _make_client,
    weight_versions=("default", None) if RELEASE_FACTS.weight_versions else None,
)
#: Load counts per engine: [waiting, running], and the KV cache's usage from 0.27.0.
COUNT_LEN = 3 if RELEASE_FACTS.counts_carry_kv_usage else 2


@pytest.fixture
def root() -> Iterator[Path]:
    with private_root("corewire-vllm-0330-join-") as path:
        yield path


def test_one_engine_joins_a_frontend_only_vllm_0_33_0_client(root: Path) -> None:
    # The 0.33.0 ready response reaches vLLM's config: the engine's smaller limit wins.
    assert_one_engine_joins(root, JOINING)


def test_two_engines_join_behind_vllm_0_33_0s_dp_coordinator(root: Path) -> None:
    counts = two_engines_behind_vllms_coordinator(root, JOINING)
    # The engines' counts reached 0.33.0's coordinator, which published them as
    # [waiting, running, kv_cache_usage] (both engines busy at some point, all idle at
    # the end; these engines have no KV cache).
    idle = [0, 0, 0.0][:COUNT_LEN]
    assert any(c[0] != idle for c in counts) and any(c[1] != idle for c in counts), counts
    assert all(len(e) == COUNT_LEN and e[2:] in ([], [0.0]) for c in counts for e in c), counts
    assert counts[-1] == [idle, idle]
