"""The native output processor of each vLLM release: which of corewire's
``NativeOutputProcessor`` classes processes that release's outputs as its own
``OutputProcessor`` does (:mod:`corewire.vllm.output.processor` for 0.25.1, and a subclass for each
release whose ``OutputProcessor`` changed since).

Each class imports what its release's vLLM has, so each is imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable

from corewire.releases import Release

__all__ = ["PROCESSORS", "native_output_processor"]


def _processor_0_25_1() -> type:
    from corewire.vllm.output.processor import NativeOutputProcessor

    return NativeOutputProcessor


def _processor_0_33_0() -> type:
    from corewire.vllm.output.v0_33_0 import NativeOutputProcessor0330

    return NativeOutputProcessor0330


def _processor_0_34_0() -> type:
    from corewire.vllm.output.v0_34_0 import NativeOutputProcessor0340

    return NativeOutputProcessor0340


#: Each release's native output processor (imported when called), by the release it was
#: written for (``Release.choose``). Whether the plugin may install it under a release is
#: the release's :attr:`~corewire.releases.Release.native_output`.
PROCESSORS: dict[str, Callable[[], type]] = {
    "0.25.1": _processor_0_25_1,
    "0.33.0": _processor_0_33_0,
    "0.34.0": _processor_0_34_0,
}


def native_output_processor(release: Release) -> type:
    """corewire's ``OutputProcessor`` for ``release``'s ``AsyncLLM`` (vLLM imported
    inside): vLLM's own class with plain outputs processed natively, as that release's
    ``OutputProcessor`` processes them."""
    return release.choose(PROCESSORS)()
