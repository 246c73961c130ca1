"""How an engine core answers utility calls: its own methods, the utilities a release's
front-end calls that it answers from its own state (:data:`RELEASE_UTILITIES`), then the
engine's, then the defaults; each reply encoded at once, so that an unsendable result
becomes a failure reply naming the method (docs/protocol.md §4.6, §5.6)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from corewire.codec import Encoder
from corewire.engine.core_output import EncodedFrames
from corewire.engine.interface import INTERFACE_METHODS
from corewire.engine.utilities import DEFAULT_UTILITIES
from corewire.engine.utilities_0_33_0 import Utilities0330
from corewire.engine.utilities_0_34_0 import Utilities0340
from corewire.logtext import Bounded, bounded
from corewire.protocol import EngineCoreOutputs, UtilityOutput, UtilityResult, utility_failure_text

__all__ = ["RELEASE_UTILITIES", "UtilityAnswers"]

logger = logging.getLogger("corewire.engine")

#: The utilities a release's front-end calls beyond an engine's own methods, answered from
#: the engine core's own state (None: the engine's methods answer every call), by the
#: release each set was written for (``Release.choose``): 0.27.0's calls (weight versions)
#: are in 0.33.0's set, and the rest of that set is never called there.
RELEASE_UTILITIES: dict[str, type[Utilities0330] | None] = {
    "0.25.1": None,
    "0.27.0": Utilities0330,
    "0.34.0": Utilities0340,
}


class UtilityAnswers:
    """The utility calls' part of :class:`~corewire.engine.core.EngineCoreProc` (a mixin:
    its engine, encoders and output queue are the engine core's)."""

    def _handle_utility(self, client_index: int, call_id: int, method: str, args: list) -> None:
        try:
            result = self._resolve_utility(method)(*args)
        except Exception as exc:
            self._reply_utility(client_index, call_id, method, failure=exc)
            return
        if isinstance(result, concurrent.futures.Future):

            def _done(future: concurrent.futures.Future) -> None:
                if threading.get_ident() == self._loop_thread_id:
                    self._deferred_replies.append((client_index, call_id, method, future))
                else:
                    self._reply_future(client_index, call_id, method, future)

            result.add_done_callback(_done)
        else:
            self._reply_utility(client_index, call_id, method, result)

    def _reply_future(
        self, client_index: int, call_id: int, method: str, future: concurrent.futures.Future
    ) -> None:
        try:
            value = future.result()
        except BaseException as exc:  # CancelledError is a BaseException
            self._reply_utility(client_index, call_id, method, failure=exc, fresh=True)
        else:
            self._reply_utility(client_index, call_id, method, value, fresh=True)

    def _flush_deferred_replies(self) -> None:
        """Send the replies of futures completed on the busy-loop thread; call after
        queueing the outputs produced alongside them (the base loop does)."""
        while self._deferred_replies:
            replies, self._deferred_replies = self._deferred_replies, []
            for client_index, call_id, method, future in replies:
                self._reply_future(client_index, call_id, method, future)

    def engine_core_counters(self) -> dict[str, int]:
        """Input this process dropped or refused since it started (the utility call
        ``engine_core_counters``): frames that did not decode, ADDs dropped for reusing
        the id of a request in flight, requests finished with ERROR at once, the
        warnings about them left out of the log, and the times the loop paused stepping
        because the front-end was not taking its outputs (backpressure)."""
        logs = (self._malformed_log, self._refused_log, self._duplicate_log)
        return {
            "malformed_frames": self._malformed_log.total,
            "duplicate_requests": self._duplicate_log.total,
            "refused_requests": self._refused_log.total,
            "log_lines_suppressed": sum(log.suppressed for log in logs),
            "output_pauses": self.output_pauses,
            "input_pauses": self.input_pauses,
        }

    def _resolve_utility(self, method: str) -> Any:
        if method in self.PROC_UTILITIES:
            return getattr(self, method)
        if method in self._release_utility_names:
            return getattr(self._release_utilities, method)
        return self._engine_utility(method)

    def _engine_utility(self, method: str) -> Any:
        """The engine's own utility ``method``, or the default answer for it."""
        if method.startswith("_") or method in INTERFACE_METHODS:
            raise AttributeError(f"{Bounded(method)!r} is not a utility method")
        fn = getattr(self.engine, method, None)
        if fn is None and method in DEFAULT_UTILITIES:
            fn = getattr(self._utility_defaults, method)
        if fn is None:
            raise AttributeError(f"engine has no utility method {Bounded(method)!r}")
        if not callable(fn):
            raise TypeError(f"{Bounded(method)!r} is not callable")
        return fn

    def _reply_utility(
        self,
        client_index: int,
        call_id: int,
        method: str,
        value: Any = None,
        *,
        failure: BaseException | None = None,
        fresh: bool = False,
    ) -> None:
        """Encode a utility reply now (so that an unsendable result becomes a failure
        reply naming the method) and queue the frames."""
        # Future callbacks run on arbitrary threads; the shared encoder is not reentrant.
        encoder = Encoder(release=self.release) if fresh else self._utility_encoder
        wire = self._wire_message
        if failure is not None:
            frames = encoder.encode(wire(self._utility_failure(call_id, method, failure)))
        else:
            try:
                frames = encoder.encode(
                    wire(
                        self._outputs(
                            utility_output=UtilityOutput(call_id, None, UtilityResult(value))
                        )
                    )
                )
            except (TypeError, ValueError, OverflowError) as exc:
                err = TypeError(f"result of type {type(value).__name__} cannot be sent: {exc}")
                frames = encoder.encode(wire(self._utility_failure(call_id, method, err)))
        self.output_queue.put((client_index, EncodedFrames(frames)))

    def _wire_message(self, message: Any) -> Any:
        """``message`` in this engine's protocol layout (for frames encoded outside the
        output thread)."""
        return message if self._to_wire is None else self._to_wire(message)

    def _utility_failure(
        self, call_id: int, method: str, failure: BaseException
    ) -> EngineCoreOutputs:
        if not isinstance(failure, concurrent.futures.CancelledError):
            logger.debug("utility call %s failed: %r", bounded(method), bounded(failure))
        message = utility_failure_text(method, failure)
        return self._outputs(utility_output=UtilityOutput(call_id, message, None))
