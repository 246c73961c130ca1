"""vLLM 0.29.0 (and 0.30.0): the client applies the ready response's
``mamba_block_size`` (docs/protocol.md §11.3)."""

from __future__ import annotations

from corewire.releases.v0_28_0 import Release0280

__all__ = ["Release0290"]


class Release0290(Release0280):
    """vLLM 0.29.0: the ready response gains ``supports_lora`` and ``max_loras``
    (required, in its record) and ``mamba_block_size``, which the client applies to
    ``cache_config``. 0.30.0 passes the client factory a ``renderer`` (its multimodal
    warm-up starts once engines are forked), which every corewire client inside vLLM
    takes: nothing else changed, so this class stands for 0.30.0 too."""

    __slots__ = ()
    NAME = "0.29.0"
    LIVE_CHECKED = ("0.29.0", "0.30.0")
