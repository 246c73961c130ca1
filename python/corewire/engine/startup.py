"""Engine start-up failures, told to the client that starts the engine process.

A client checks what it can before it starts any process (:func:`check_engine_spec`:
the engine's module imports, the name is an :class:`~corewire.engine.Engine`, the
engine arguments fit its constructor; for the reference engine, that torch is
installed), so those mistakes fail at once, in the caller, with their own exception.

What only the engine process can find out (a constructor that raises, a model that does
not load) it reports itself: the client starts every engine process through
:func:`engine_process_main`, which records the exception that ends the start-up as one
plain-text line, ``"TypeName: message"``, in a file of the client's private (0700) ipc
directory. When the process exits before its ready message, the client reads that line
(:func:`read_startup_error`) and puts it into the exception its caller gets. Plain text in
a private directory: nothing pickled, no pipe to hand over or close.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from corewire._optional import require
from corewire.engine.interface import Engine

__all__ = [
    "ENGINE_ALIASES",
    "REQUIRED_METHODS",
    "check_engine_spec",
    "describe_error",
    "engine_process_main",
    "read_startup_error",
    "report_startup_error",
    "split_engine_spec",
]

#: Short names accepted wherever an engine spec ("module:Class") is.
ENGINE_ALIASES = {"reference": "corewire.engine.reference:ReferenceEngine"}

#: The methods without which a class is no engine (``load_engine`` checks them too).
REQUIRED_METHODS = ("add_request", "abort_requests", "step", "has_unfinished_requests")
#: Built-in engine modules that import torch: checked for torch, not imported (seconds).
_TORCH_MODULES = frozenset({"corewire.engine.reference"})
#: Longest report kept: the cause, not a page of text.
_MAX_REPORT_CHARS = 2000

#: Where this process reports its start-up error (set by :func:`engine_process_main`).
_report_path: str | None = None


def describe_error(exc: BaseException) -> str:
    """``"TypeName: message"`` (the type alone when the message is empty)."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def report_startup_error(exc: BaseException) -> None:
    """Record ``exc`` as this engine process's start-up error, for the client that
    started it; a no-op in a process not started by a client (``corewire engine``)."""
    path = _report_path
    if path is None:
        return
    try:
        # O_EXCL: the first report is the cause; a later one would only repeat it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(describe_error(exc)[:_MAX_REPORT_CHARS])


def engine_process_main(
    target: Callable[..., Any], report_path: str | None, /, **kwargs: Any
) -> None:
    """Process target of a client's engine process: runs ``target(**kwargs)`` and
    reports an exception that escapes it to ``report_path`` (see the module doc)."""
    global _report_path
    _report_path = report_path
    try:
        target(**kwargs)
    except Exception as exc:
        report_startup_error(exc)
        raise


def read_startup_error(report_path: str | None) -> str | None:
    """The start-up error an engine process reported to ``report_path``, if any."""
    if report_path is None:
        return None
    try:
        with open(report_path, encoding="utf-8", errors="replace") as f:
            return f.read(_MAX_REPORT_CHARS).strip() or None
    except OSError:
        return None


def check_engine_spec(spec: str | None, engine_args: Mapping[str, Any] | None) -> None:
    """Check in the client what can be checked before an engine process starts.

    ``spec`` is what ``corewire.engine.launch.load_engine`` takes ("module:Class", an
    alias, or None for the reference engine). Raises the import's own error when the
    module does not import, ``AttributeError`` when it has no such name, ``TypeError``
    when the name is not an engine or ``engine_args`` do not fit its constructor, and
    :class:`~corewire._optional.MissingDependency` when the reference engine's torch is
    not installed.
    """
    module_name, attr = split_engine_spec(spec)
    resolved = f"{module_name}:{attr}"
    if module_name in _TORCH_MODULES:
        require("torch", "the reference engine")
        return
    factory: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            owner = getattr(factory, "__name__", type(factory).__name__)
            raise AttributeError(
                f"engine {resolved!r}: {owner!r} has no attribute {part!r}"
            ) from None
    if isinstance(factory, type) and not issubclass(factory, Engine):
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(factory, m, None))]
        if missing:
            raise TypeError(
                f"engine {resolved!r} is not an Engine: subclass corewire.engine.Engine "
                f"(it lacks {', '.join(missing)})"
            )
    elif not callable(factory):
        raise TypeError(f"engine {resolved!r} is not a class or factory: {factory!r}")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: the process will tell
        return
    try:
        signature.bind(**dict(engine_args or {}))
    except TypeError as exc:
        raise TypeError(f"engine {resolved!r} does not take these engine_args: {exc}") from None


def split_engine_spec(spec: str | None) -> tuple[str, str]:
    """The module and the attribute path ``spec`` names ("module:Class", an alias of
    :data:`ENGINE_ALIASES`, or None for the reference engine); ``ValueError`` for any
    other string."""
    resolved = ENGINE_ALIASES.get(spec or "reference", spec or "")
    module_name, sep, attr = resolved.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"engine must be 'module:Class', got {resolved!r}")
    return module_name, attr
