"""Thin caller of ``corewire bench serve`` (the benchmark ships in the package:
``corewire.bench.serve``); kept so that ``python benches/serve.py [options]`` still works."""

import sys

from corewire.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
