"""corewire's modules import one way, top to bottom, and no module imports itself back.

The layers, highest first, are :data:`LAYERS`: a module may import its own layer's modules
and any lower layer's, never a higher one's, and no set of modules may import each other in
a loop. Every import counts: at module level, inside functions (the way a cycle hides from
a reading of the top of each file) and under ``if TYPE_CHECKING:``. The Rust extension
``corewire._native`` counts as the modules its stub imports and those its Rust code imports
at run time (``py.import("corewire....")`` in ``rust/src``). Names loaded by string
(``importlib.import_module``, the CLI's subcommands) are not imports here: those only ever
load from the top.

A new module must be placed in a layer here: the test fails for one that is not.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paths_support import REPO_ROOT as ROOT

PACKAGE = ROOT / "python" / "corewire"
RUST = ROOT / "rust" / "src"

#: The layers, highest first: each a name and the modules (and packages: a module under
#: one belongs to it) it holds.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "command line and benchmarks",
        ("corewire", "corewire.cli", "corewire.demo", "corewire.bench"),
    ),
    ("vLLM adapters", ("corewire.vllm",)),
    ("clients", ("corewire.client",)),
    ("engines", ("corewire.engine",)),
    (
        "codec and coordination",
        ("corewire.codec", "corewire.coordinator", "corewire.dp_messages", "corewire.metrics"),
    ),
    ("wire", ("corewire.wire", "corewire.layouts", "corewire._native", "corewire.errors")),
    ("releases and protocol", ("corewire.releases", "corewire.protocol")),
    (
        "plumbing",
        (
            "corewire._optional",
            "corewire.curve",
            "corewire.fast_exit",
            "corewire.ipcdir",
            "corewire.keygen",
            "corewire.logtext",
            "corewire.ports",
        ),
    ),
)

NATIVE = "corewire._native"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``; the
    extension by its stub)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    found[NATIVE] = PACKAGE / "_native.pyi"
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    # The nearest module at or above a dotted name (``corewire.codec.Encoder`` is codec).
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, node: ast.AST, modules: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            found = _known(alias.name, modules)
            if found:
                yield found
        return
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if modules[module].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        # ``from corewire import codec`` imports the module, ``from corewire import
        # AsyncMPClient`` the package's ``__init__``.
        full = f"{base}.{alias.name}"
        found = full if full in modules else _known(base, modules)
        if found:
            yield found


def _native_runtime_imports(modules: dict[str, Path]) -> set[str]:
    names = set()
    for path in RUST.rglob("*.rs"):
        for name in re.findall(r'py\.import\("(corewire[\w.]*)"\)', path.read_text()):
            found = _known(name, modules)
            assert found is not None, f"{path}: imports {name}, which is no module"
            names.add(found)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each module -> the corewire modules it imports (itself left out)."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _imported(name, node, modules) if t != name)
    graph[NATIVE] |= _native_runtime_imports(modules) - {NATIVE}
    return graph


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (0 is the top), or None: that
    of the longest name in the layers that is the module or a package above it (the
    package ``corewire`` itself is only its ``__init__``)."""
    best: tuple[int, int] | None = None
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            inside = module.startswith(member + ".") and member != "corewire"
            if (module == member or inside) and (best is None or len(member) > best[0]):
                best = (len(member), index)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, without
    recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


GRAPH = import_graph()


def test_every_module_has_a_layer() -> None:
    assert [m for m in sorted(GRAPH) if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} ({LAYERS[layer_of(module) or 0][0]}) imports {target} "
        f"({LAYERS[layer_of(target) or 0][0]})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if (layer_of(target) or 0) < (layer_of(module) or 0)
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_loops(graph: dict[str, set[str]], expected: list[Any]) -> None:
    assert sorted(cycles(graph)) == expected


def test_the_graph_sees_imports_inside_functions_and_the_extensions_own() -> None:
    # What the checks above rest on: a function-level import is an arrow (the codec's
    # output converter), and so is what the Rust extension imports at run time.
    assert "corewire.wire.outputs" in GRAPH["corewire.codec"]
    assert {"corewire.protocol", "corewire.wire.layouts", "corewire.releases"} <= GRAPH[NATIVE]
    # ``from corewire import X`` is the module X where X is one, else the package.
    assert "corewire" not in GRAPH["corewire.errors"]
