"""Where the suite and the project are, for the test modules in the area folders below.

The test modules live one folder down (``tests/codec/``, ``tests/client/``, ...); the
support modules, ``conftest.py`` and ``data/`` stay here at ``tests/``, which pytest puts
on ``sys.path`` (the rootdir conftest). A child process that imports a support module
needs :data:`TESTS_DIR` on its ``PYTHONPATH``, not the folder of the test that starts it.
"""

from __future__ import annotations

from pathlib import Path

#: ``tests/``: the support modules, ``conftest.py``, ``data/``.
TESTS_DIR = Path(__file__).resolve().parent
#: The repository root: ``docs/``, ``scripts/``, ``tools/``, ``pyproject.toml``.
REPO_ROOT = TESTS_DIR.parent
#: ``tests/data/``: the recorded frames of each release.
DATA_DIR = TESTS_DIR / "data"
