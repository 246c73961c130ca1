"""A vLLM platform plugin that names a CPU platform, for GPU-less serve/test machines.

vLLM picks a platform while it builds its argument parser; on a machine without a GPU and
with a CUDA build of vLLM no built-in platform matches and ``vllm serve`` stops with
"Failed to infer device type". corewire's serve stack runs vLLM's API server front-end only
(the engines are corewire's), so the front-end needs a platform but no device: vLLM's CPU
platform is enough, with one adjustment (:class:`FrontendCpuPlatform`).

An out-of-tree platform plugin wins over vLLM's built-in ones in every vLLM process of the
environment it is installed in. That is why this is a separate distribution that only
corewire's ``scripts/serve`` and test set-up install: never install it where vLLM should
use a GPU. ``COREWIRE_VLLM_CPU_PLATFORM=0`` switches it off without uninstalling it.
"""

from __future__ import annotations

import os
from typing import Any

# FrontendCpuPlatform comes from the module's __getattr__ (made on first use).
__all__ = ["CPU_PLATFORM", "FrontendCpuPlatform", "cpu_platform"]  # noqa: F822

#: The platform class this plugin names, by qualified name (vLLM imports it).
CPU_PLATFORM = f"{__name__}.FrontendCpuPlatform"


def cpu_platform() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the CPU platform class, by qualified name.

    Returns ``None`` (no platform from this plugin) when ``COREWIRE_VLLM_CPU_PLATFORM`` is
    ``0``, so that vLLM's own detection applies.
    """
    if os.environ.get("COREWIRE_VLLM_CPU_PLATFORM", "1") == "0":
        return None
    return CPU_PLATFORM


def _frontend_cpu_platform() -> type:
    """vLLM's ``CpuPlatform`` without its model-runner requirement on Triton.

    From vLLM 0.34.0 on, the CPU platform's config check refuses x86 machines without
    ``triton-cpu`` ("vLLM on x86 CPUs requires Triton"), which the package index does not
    carry; 0.33.0 only warned. Triton matters to vLLM's CPU model runner, which never runs
    in a front-end whose engines are elsewhere, so the check runs with Triton reported
    present. Everything else is vLLM's platform as it is.
    """
    from vllm.platforms.cpu import CpuPlatform

    class FrontendCpuPlatform(CpuPlatform):  # type: ignore[misc,valid-type]
        """vLLM's CPU platform for a front-end only (see the module docstring)."""

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            try:
                import vllm.triton_utils as triton_utils
            except ImportError:  # releases without the module never checked for Triton
                return super().check_and_update_config(vllm_config)
            missing = object()
            had = triton_utils.__dict__.get("HAS_TRITON", missing)
            triton_utils.HAS_TRITON = True
            try:
                super().check_and_update_config(vllm_config)
            finally:
                if had is missing:
                    del triton_utils.HAS_TRITON
                else:
                    triton_utils.HAS_TRITON = had

    FrontendCpuPlatform.__module__ = __name__
    FrontendCpuPlatform.__qualname__ = "FrontendCpuPlatform"
    return FrontendCpuPlatform


def __getattr__(name: str) -> Any:
    # The class is made on first use: vLLM imports this module while it resolves its
    # platform, and vLLM's own platform modules must not be imported before then.
    if name == "FrontendCpuPlatform":
        cls = _frontend_cpu_platform()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
