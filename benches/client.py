"""Thin caller of ``corewire bench client`` (the benchmark ships in the package:
``corewire.bench.client``); kept so that ``python benches/client.py [options]`` still works."""

import sys

from corewire.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "client", *sys.argv[1:]]))
