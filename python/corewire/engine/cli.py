"""``corewire engine``: run one engine that connects to a front-end already listening.

This is external engine mode (like vLLM's headless engines): the front-end binds its
ROUTER and PULL sockets, and each engine process started this way connects to them::

    corewire engine --input-address ipc:///run/fe/in --output-address ipc:///run/fe/out \\
        --engine-index 0 --engine reference --engine-args '{"max_batch": 64}'
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from corewire.coordinator import add_connect_arguments, connect_options

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``engine`` subcommand's options."""
    parser.add_argument(
        "--input-address", default=None, help="the front-end's request (ROUTER) address"
    )
    parser.add_argument(
        "--output-address", default=None, help="the front-end's output (PULL) address"
    )
    parser.add_argument(
        "--engine-index",
        type=int,
        default=0,
        help="this engine's index (its ZeroMQ identity); default 0",
    )
    parser.add_argument(
        "--engine",
        default=None,
        help="'module:Class' of the engine, or 'reference' (the default)",
    )
    parser.add_argument(
        "--engine-args",
        type=_json_object,
        default=None,
        help="JSON object of keyword arguments for the engine's constructor",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process exits (default: run until SIGTERM / SIGINT)",
    )
    # Data parallel: --connect tcp://HOST:PORT, --data-parallel-size, --curve-keys.
    add_connect_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT (status 0) or a fatal engine error (status 1)."""
    from corewire.engine.launch import serve_engine

    if args.connect is not None:
        try:
            addresses = connect_options(args)
        except (ValueError, OSError) as exc:
            print(f"corewire engine: {exc}", file=sys.stderr)
            return 2
    elif args.input_address and args.output_address:
        addresses = {"input_address": args.input_address, "output_address": args.output_address}
    else:
        print(
            "corewire engine: give --input-address and --output-address, or --connect",
            file=sys.stderr,
        )
        return 2
    return serve_engine(
        engine_index=args.engine_index,
        engine=args.engine,
        engine_args=args.engine_args,
        parent_pid=args.parent_pid,
        **addresses,
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--engine-args is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--engine-args must be a JSON object")
    return value
