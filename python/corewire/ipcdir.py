"""Private directories for ``ipc://`` endpoints, and the removal of those a dead owner left.

Each directory is made with mode 0700 in the system temp dir and named after its kind and
its owner's pid (``corewire-ipc-<pid>-<random>``). A front-end killed with SIGKILL cannot
remove its own; the next one that makes a directory removes every directory of this
naming scheme whose owner process is gone (and that belongs to the same user).

Wire format: docs/protocol.md §10 (security rules: private ipc:// directories).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

__all__ = ["make_private_dir", "remove_orphaned_dirs"]

logger = logging.getLogger("corewire")

_NAME = re.compile(r"^corewire-(?:ipc|dp|keys)-(\d+)-")


def make_private_dir(kind: str) -> str:
    """A new 0700 directory ``corewire-<kind>-<pid>-...`` (``kind``: "ipc", "dp", or
    "keys" for CURVE keys a client made for its own engines), after removing the
    directories of owners that died."""
    if kind not in ("ipc", "dp", "keys"):
        raise ValueError(f"unknown private directory kind {kind!r}")
    remove_orphaned_dirs()
    return tempfile.mkdtemp(prefix=f"corewire-{kind}-{os.getpid()}-")  # mode 0700


def remove_orphaned_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's corewire directories in ``parent`` (default: the temp dir) whose
    owner process no longer exists; returns the removed paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        # Only real directories of ours: never follow a link someone planted there.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            removed.append(entry.path)
            logger.info("removed %s, left by process %s which is gone", entry.path, match.group(1))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we wrote: leave it alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
