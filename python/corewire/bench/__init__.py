"""``corewire bench``: corewire's benchmarks, shipped in the package.

``corewire bench decode|client|dp|serve|output [--quick] [--plot FILE.png] [--json FILE]``, each
with options of its own. Every benchmark runs the alternatives side by side in one process
on the same input and compares corewire with the installed vLLM (any release corewire
speaks; the project's environment has 0.25.1) when there is one, and says so when there
is not. ``--json`` writes machine-readable results (machine, versions, date,
every case, the goals met or missed) and ``--plot`` draws them (needs matplotlib, the
``bench`` extra).

The chaos run (faults injected while serving) is developer tooling and does not ship:
``tools/chaos`` in a checkout (docs/reliability.md).

Each benchmark is a module here with ``add_arguments(parser)`` and ``run(args) -> int``,
like the ``corewire`` subcommands; their heavy imports (vLLM, torch, matplotlib) happen
only when one runs.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["BENCHES", "add_arguments", "run"]

#: benchmark -> one-line help
BENCHES: dict[str, str] = {
    "decode": "NativeDecoder vs vLLM's MsgpackDecoder on vLLM's own frames",
    "client": "AsyncMPClient vs vLLM's AsyncMPClient over the same fake engine",
    "dp": "data-parallel routing: decision cost and load spread vs vLLM's rule",
    "serve": "vLLM's API server: vLLM's stack vs corewire's client (and native output processing)",
    "output": "vLLM's OutputProcessor vs corewire's native output processing, in process",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one sub-command per benchmark."""
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, help_text in BENCHES.items():
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(f"corewire.bench.{name}")
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; returns its exit status."""
    return int(args._bench_run(args) or 0)
