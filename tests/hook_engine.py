"""A reference engine with fault hooks, for tests only.

The shipped :class:`~corewire.engine.reference.ReferenceEngine` answers utility calls from
any client that can reach it, so it carries nothing that fails or kills it on demand. The
hooks the fault tests need live here instead: load this engine in a spawned engine
process as ``"hook_engine:HookEngine"`` (pytest puts ``tests/`` on ``sys.path`` and spawn
children inherit it) or, for the ``corewire engine`` command, with ``tests/`` on
``PYTHONPATH``.
"""

from __future__ import annotations

import os
from typing import Any

from corewire.engine.reference import ReferenceEngine
from corewire.engine.synthetic import SyntheticEngine
from corewire.protocol import EngineCoreOutput, EngineCoreRequest

#: Request ids that make :meth:`HookEngine.add_request` fail in a set way.
INTERNAL_ERROR_ID = "hook-internal-error"
VALUE_ERROR_WITH_PATH_ID = "hook-value-error-path"


class HookEngine(ReferenceEngine):
    """The reference engine plus ``raise_error`` and ``fail_next_step`` utilities, and
    ``add_request`` failures chosen by request id (see the module constants)."""

    def __init__(self, fail_start_if_exists: str | None = None, **kwargs: object) -> None:
        # A start that fails once the file exists: engines started after the test makes
        # it (a scale-up) fail, the ones before did not.
        if fail_start_if_exists is not None and os.path.exists(fail_start_if_exists):
            raise RuntimeError("refusing to start (test hook)")
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._fail_next_step: str | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        """As the reference engine, except for the hook request ids: an unexpected
        error whose text names a file, and a ValueError whose text names one."""
        if request.request_id == INTERNAL_ERROR_ID:
            raise RuntimeError("cannot open /opt/secret/weights/shard-7.bin")
        if request.request_id == VALUE_ERROR_WITH_PATH_ID:
            raise ValueError("prompt refused by /etc/corewire/policy.json\nTraceback: x")
        super().add_request(request)

    def raise_error(self, message: str = "requested failure") -> None:
        """Fail with ``RuntimeError(message)``: a failing utility call."""
        raise RuntimeError(message)

    def fail_next_step(self, message: str = "injected step failure") -> None:
        """Make the next step raise: a fatal engine error on demand."""
        self._fail_next_step = message

    def step(self) -> list[EngineCoreOutput]:
        """The reference step, or the failure :meth:`fail_next_step` asked for."""
        if self._fail_next_step is not None:
            message, self._fail_next_step = self._fail_next_step, None
            raise RuntimeError(message)
        return super().step()


class SessionEngine(SyntheticEngine):
    """A synthetic engine that holds streaming-input sessions (``resumable`` requests:
    nothing is generated until a request with the same id and ``resumable`` False comes)
    and whose scheduler pauses (no steps until resumed)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sessions: set[str] = set()
        self.paused = False

    def add_request(self, request: EngineCoreRequest) -> None:
        """Open (``resumable``) or close a session; the closing input generates."""
        if request.resumable:
            self.sessions.add(request.request_id)
            return
        self.sessions.discard(request.request_id)
        super().add_request(request)

    def has_unfinished_requests(self) -> bool:
        """Open sessions count as unfinished."""
        return bool(self.sessions) or super().has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """No tokens while paused."""
        return [] if self.paused else super().step()

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop stepping until :meth:`resume_scheduler`."""
        self.paused = True

    def resume_scheduler(self) -> None:
        """Step again."""
        self.paused = False

    def is_scheduler_paused(self) -> bool:
        """Whether :meth:`pause_scheduler` is in effect."""
        return self.paused
