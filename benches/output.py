"""Thin caller of ``corewire bench output`` (the benchmark ships in the package:
``corewire.bench.output``); ``python benches/output.py [options]`` works too."""

import sys

from corewire.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "output", *sys.argv[1:]]))
