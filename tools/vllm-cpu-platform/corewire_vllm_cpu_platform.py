"""A vLLM platform plugin that names vLLM's CPU platform, for GPU-less serve/test machines.

vLLM picks a platform while it builds its argument parser; on a machine without a GPU and
with a CUDA build of vLLM no built-in platform matches and ``vllm serve`` stops with
"Failed to infer device type". corewire's serve stack runs vLLM's API server front-end only
(the engines are corewire's), so the front-end needs a platform but no device: vLLM's CPU
platform is enough.

An out-of-tree platform plugin wins over vLLM's built-in ones in every vLLM process of the
environment it is installed in. That is why this is a separate distribution that only
corewire's ``scripts/serve`` and test set-up install: never install it where vLLM should
use a GPU. ``COREWIRE_VLLM_CPU_PLATFORM=0`` switches it off without uninstalling it.
"""

from __future__ import annotations

import os

__all__ = ["CPU_PLATFORM", "cpu_platform"]

CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"


def cpu_platform() -> str | None:
    """Entry point of ``vllm.platform_plugins``: vLLM's CPU platform class, by qualified name.

    Returns ``None`` (no platform from this plugin) when ``COREWIRE_VLLM_CPU_PLATFORM`` is
    ``0``, so that vLLM's own detection applies.
    """
    if os.environ.get("COREWIRE_VLLM_CPU_PLATFORM", "1") == "0":
        return None
    return CPU_PLATFORM
