"""Optional dependencies: one clear error that names what to install.

corewire's core needs only pyzmq, msgspec and numpy. The reference engine needs torch,
the vLLM adapters need vLLM, plots need matplotlib. Whoever reaches for one of these
without it gets a :class:`MissingDependency` (an ``ImportError``) whose message is one
line ending in the command that installs it, raised in the process that asked (never a
traceback from a child process that found out later).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["INSTALL", "MissingDependency", "import_optional", "is_installed", "require"]

#: What installs each optional dependency (a module name's top-level package).
INSTALL: dict[str, str] = {
    "torch": "pip install 'corewire[torch]'",
    "vllm": "pip install vllm==0.25.1",
    "matplotlib": "pip install 'corewire[bench]'",
    "psutil": "pip install 'corewire[bench]'",
    "prometheus_client": "pip install 'corewire[metrics]'",
}


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message says how to install it."""

    def __init__(self, module: str, purpose: str) -> None:
        top = module.partition(".")[0]
        install = INSTALL.get(top, f"pip install {top}")
        super().__init__(f"{purpose} needs {top}, which is not installed: {install}", name=top)
        #: How to install it (a shell command).
        self.install = install


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (torch takes
    seconds to import; finding it takes a few file lookups)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        # A missing parent package (ImportError), or a module in sys.modules without a
        # spec (ValueError). A module set to None there (an import blocked on purpose)
        # is not found: find_spec returns None.
        return False


def require(module: str, purpose: str) -> None:
    """Raise :class:`MissingDependency` unless ``module`` is installed; ``purpose`` says
    what needs it ("the reference engine")."""
    if not is_installed(module):
        raise MissingDependency(module, purpose)


def import_optional(module: str, purpose: str) -> ModuleType:
    """Import ``module``; its absence raises :class:`MissingDependency`.

    Only the absence of ``module``'s own package turns into that error: an installed
    package that fails on a dependency of its own raises its own error, unchanged.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.partition(".")[0] == module.partition(".")[0]:
            raise MissingDependency(module, purpose) from exc
        raise
