"""The ``corewire`` command: ``demo``, ``engine``, ``keygen``.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only dispatches, so a subcommand's heavy imports (torch,
zmq) happen only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("corewire.demo", "run streaming requests against the built-in reference engine"),
    "engine": ("corewire.engine.cli", "start an engine that connects to a listening front-end"),
    "keygen": ("corewire.keygen", "write a ZeroMQ CURVE key pair for engines on other hosts"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="corewire", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``corewire`` console script."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
