"""The ``corewire`` command: ``demo``, ``engine``, ``keygen``, ``bench``.

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
    "bench": (
        "corewire.bench",
        "measure corewire against the installed vLLM (decode, client, dp, serve, output)",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module is imported (all when None)."""
    parser = argparse.ArgumentParser(prog="corewire", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``corewire`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import just the chosen subcommand's module: `corewire engine` need not load the demo.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in _COMMANDS else None).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
