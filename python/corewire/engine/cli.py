"""``corewire engine``: run one engine that connects to a front-end already listening.

This is external engine mode (like vLLM's headless engines): the front-end binds its
ROUTER and PULL sockets, and each engine process started this way connects to them::

    corewire engine --input-address ipc:///run/fe/in --output-address ipc:///run/fe/out \\
        --engine-index 0 --engine reference --engine-args '{"max_batch": 64}'

To join a vLLM 0.25.1 API server started front-end only (``vllm serve MODEL
--data-parallel-size-local 0 --data-parallel-address HOST --data-parallel-rpc-port
PORT ...``), give its handshake address instead; the engine then does vLLM's start-up
handshake and learns the addresses from the front-end (:mod:`corewire.engine.handshake`)::

    corewire engine --handshake-address tcp://127.0.0.1:PORT --engine-index 0

``--release`` names the vLLM release whose wire the engine speaks: ``0.25.1`` (the
default) or ``0.33.0``. Nothing on the wire tells them apart (a 0.33.0 front-end refuses
a 0.25.1 ready response, and each version misreads the other's outputs), so it must match
the front-end's vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from corewire import releases
from corewire.coordinator import TcpEndpoints
from corewire.curve import is_loopback_address
from corewire.keygen import CurveClientKeys

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
        "--handshake-address",
        metavar="tcp://HOST:PORT",
        default=None,
        help="join the vLLM front-end whose start-up handshake listens here (vLLM's "
        "--data-parallel-address and --data-parallel-rpc-port), as a headless vLLM "
        "engine does; replaces --input-address/--output-address",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --handshake-address: how long to wait for the front-end's answer (default 300)",
    )
    parser.add_argument(
        "--join-record",
        metavar="PATH",
        default=None,
        help="with --handshake-address: keep the front-end's answer (its addresses) in "
        "this file, for an engine started again in this one's place (--rejoin)",
    )
    parser.add_argument(
        "--rejoin",
        action="store_true",
        help="with --handshake-address and --join-record: take the addresses from the "
        "record instead of a handshake (replacing a lost engine of the same index; "
        "corewire's DP client takes it back)",
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
        "--release",
        # The option's name before 0.2, still taken.
        "--protocol",
        dest="release",
        choices=releases.SUPPORTED,
        default=releases.DEFAULT,
        help=f"the vLLM release whose engine-core wire to speak (default {releases.DEFAULT};"
        " --protocol is its deprecated name)",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process exits (default: run until SIGTERM / SIGINT)",
    )
    # Data parallel: --connect tcp://HOST:PORT, --data-parallel-size, --curve-keys.
    _add_connect_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT (status 0) or a fatal engine error (status 1)."""
    from corewire.engine.launch import EngineLaunch, serve_engine

    if args.handshake_address is not None:
        if args.connect is not None or args.input_address or args.output_address:
            print(
                "corewire engine: --handshake-address replaces --connect, --input-address "
                "and --output-address",
                file=sys.stderr,
            )
            return 2
        return _join(args)
    if args.rejoin or args.join_record is not None:
        print("corewire engine: --join-record and --rejoin go with --handshake-address",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.connect is not None:
        try:
            addresses = _connect_options(args)
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
    launch = EngineLaunch.of(
        engine_index=args.engine_index,
        engine=args.engine,
        engine_args=args.engine_args,
        release=args.release,
        **addresses,
    )
    return serve_engine(launch, parent_pid=args.parent_pid)


def _join(args: argparse.Namespace) -> int:
    from corewire.engine.handshake import DEFAULT_HANDSHAKE_TIMEOUT_S, join_frontend

    size, index = args.data_parallel_size, args.engine_index
    # The DP size is only reported (the front-end knows the group); an index past a
    # size that was given is still a mistake worth stopping on.
    if size < 1 or index < 0 or (size > 1 and index >= size):
        print(
            f"corewire engine: --engine-index {index} is outside a group of "
            f"--data-parallel-size {size}",
            file=sys.stderr,
        )
        return 2
    if args.rejoin and args.join_record is None:
        print("corewire engine: --rejoin needs --join-record", file=sys.stderr)
        return 2
    timeout = args.handshake_timeout
    return join_frontend(
        handshake_address=args.handshake_address,
        engine_index=args.engine_index,
        engine=args.engine,
        engine_args=args.engine_args,
        parent_pid=args.parent_pid,
        data_parallel_size=args.data_parallel_size,
        handshake_timeout_s=DEFAULT_HANDSHAKE_TIMEOUT_S if timeout is None else timeout,
        release=args.release,
        join_record=args.join_record,
        rejoin=args.rejoin,
    )


def _add_connect_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``corewire engine`` for joining a DP front-end on another host."""
    parser.add_argument(
        "--connect",
        metavar="tcp://HOST:PORT",
        default=None,
        help="join the DP front-end listening on this data_parallel_address (its requests, "
        "outputs and coordinator ports); replaces --input-address/--output-address",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines in the DP group (with --connect); default 1",
    )
    parser.add_argument(
        "--curve-keys",
        metavar="DIR",
        default=None,
        help="client key directory written by `corewire keygen` (client-K); required "
        "when --connect names a non-loopback host",
    )


def _connect_options(args: argparse.Namespace) -> dict[str, Any]:
    """:class:`EngineLaunch` keyword arguments for ``--connect`` (addresses, DP options, CURVE
    keys); raises ``ValueError`` for a missing key directory on a non-loopback host."""
    endpoints = TcpEndpoints.from_address(args.connect)
    keys = None
    if args.curve_keys is not None:
        keys = CurveClientKeys.from_dir(args.curve_keys)
    elif not is_loopback_address(args.connect):
        raise ValueError(
            f"{args.connect} is on another host: pass --curve-keys DIR (from `corewire keygen`)"
        )
    if args.data_parallel_size < 1 or not 0 <= args.engine_index < args.data_parallel_size:
        raise ValueError(
            f"--engine-index {args.engine_index} is outside a group of "
            f"--data-parallel-size {args.data_parallel_size}"
        )
    return {
        "input_address": endpoints.input,
        "output_address": endpoints.output,
        "data_parallel_size": args.data_parallel_size,
        "coordinator_addresses": ["", endpoints.coordinator_stats, endpoints.coordinator_publish],
        "curve_keys": keys.to_wire() if keys is not None else None,
        "include_finished_set": True,
    }


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--engine-args is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--engine-args must be a JSON object")
    return value
