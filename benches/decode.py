"""Thin caller of ``corewire bench decode`` (the benchmark ships in the package:
``corewire.bench.decode``); kept so that ``python benches/decode.py [options]`` still works."""

import sys

from corewire.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
