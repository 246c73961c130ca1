"""Leaving an engine or coordinator process that stopped cleanly, without Python's
interpreter teardown.

``corewire.protocol`` imports torch when it is installed (tensor fields), and tearing
torch down at exit takes about 1.5 s of CPU on a 2-core machine, over 4 s when the machine
is loaded: past the client's SIGTERM grace (``TERMINATE_GRACE_S``), so the client SIGKILLed
engines and coordinators that had already stopped, and every shutdown (a DP group's
restart after a death among them) waited the whole grace. By the time the process is done
it has closed its sockets (lingering as it chose) and owns nothing else its exit must
release, so it flushes its logs and standard streams and ends at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(status: int) -> NoReturn:
    """Flush the logs and standard streams, then end the process with ``status``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
