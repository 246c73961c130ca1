"""Thin caller of ``corewire bench dp`` (the benchmark ships in the package:
``corewire.bench.dp``); kept so that ``python benches/dp.py [options]`` still works."""

import sys

from corewire.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "dp", *sys.argv[1:]]))
