"""The gate of the test modules that need vLLM 0.33.0 itself (``test_vllm_0_33_0_*.py``).

``scripts/test`` runs those modules a second time in a cached environment with vLLM
0.33.0 and ``COREWIRE_REQUIRE_VLLM=0.33.0``: there a missing or other vLLM must fail the
step, not skip it. Elsewhere (the main environment, vLLM 0.25.1) they skip.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Any

import pytest

#: The release these modules test against: 0.33.0, or a later release that behaves as
#: it does (its class derives from 0.33.0's: 0.34.0) named by ``COREWIRE_REQUIRE_VLLM``,
#: against which the same modules run in that release's own venv.
RELEASE = os.environ.get("COREWIRE_REQUIRE_VLLM") or "0.33.0"


def require_vllm_0_33_0() -> ModuleType:
    """The imported ``vllm`` module if it is release 0.33.0; otherwise skip the calling
    module (call at module level), or raise where ``COREWIRE_REQUIRE_VLLM`` is set."""
    required = os.environ.get("COREWIRE_REQUIRE_VLLM")
    if required:
        import vllm
    else:
        vllm = pytest.importorskip("vllm")
    if vllm.__version__.split("+")[0] != RELEASE:
        if required:
            raise RuntimeError(f"COREWIRE_REQUIRE_VLLM={required}, found vLLM {vllm.__version__}")
        pytest.skip(f"needs vLLM {RELEASE} (found {vllm.__version__})", allow_module_level=True)
    # Some releases (0.32.0, with torch 2.13) reach torch.compile while importing their
    # outputs and engine modules, and torch warns there about its own deprecated APIs
    # (torch.jit); not this project's to fix, so imported once here with that ignored.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import vllm.outputs
        import vllm.v1.engine
    return vllm


def as_the_client_sends(request: Any) -> Any:
    """vLLM's ``request`` as the installed release's own client sends it: vLLM 0.34.0's
    packs the prompt as an int32 ndarray (``_with_packed_prompt``), which its engines
    expect; earlier releases send it as it is."""
    from vllm.v1.engine import core_client

    pack = getattr(core_client, "_with_packed_prompt", None)
    return request if pack is None else pack(request)
