"""No import cycle among pdserve's modules.

Every module is parsed with `ast` (nothing is imported), and every import statement counts: at module level,
under `if TYPE_CHECKING:`, and inside functions. A circle that only a deferred import keeps from failing at
import time is still a circle: each side needs the other, so neither can be read, tested or moved alone.

Edges: `import a.b` and `from a.b import name` point at module a.b; `from a import b` points at a.b when
a/b.py (or a/b/) exists, else at a itself (its __init__); relative imports are resolved against the importing
module's package. Importing a.b also runs a/__init__.py, but that is not an edge here: a package's
__init__ is its own module, with its own imports.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent
PACKAGE = "pdserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_in(source: str, name: str, is_package: bool, modules: Collection[str]) -> Iterator[str]:
    """The pdserve modules that module `name` (a package's __init__ if is_package), whose text is `source`,
    imports anywhere in its body; `modules` are the names a `from a import b` may resolve to."""
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in modules else target


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    graph = {}
    for name, path in modules.items():
        targets = set(imports_in(path.read_text(), name, path.name == "__init__.py", modules))
        unknown = targets - modules.keys()
        assert not unknown, f"{name} imports {sorted(unknown)}, which are not modules of {PACKAGE}"
        graph[name] = targets - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; singletons left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, for the failure message."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    return f"{' -> '.join(one_cycle(graph, component))}  (all of: {', '.join(component)})"


SAMPLE = """
from __future__ import annotations
import json
import pdserve.a.x
from typing import TYPE_CHECKING
from pdserve.a import y, CONSTANT
from . import z
from .y import thing
from ..b import w
if TYPE_CHECKING:
    from pdserve.b.v import Type
def later():
    from pdserve.b import u
"""


def test_every_kind_of_import_is_an_edge() -> None:
    """The walker itself: plain, `from pkg import module`, relative, TYPE_CHECKING and deferred imports."""
    modules = ["pdserve.a", "pdserve.a.x", "pdserve.a.y", "pdserve.a.z", "pdserve.b", "pdserve.b.v", "pdserve.b.u"]
    found = set(imports_in(SAMPLE, "pdserve.a.x", False, modules))
    # CONSTANT and w are names in their packages' __init__, not modules: the edge points at the package
    assert found == {"pdserve.a.x", "pdserve.a.y", "pdserve.a", "pdserve.a.z", "pdserve.b", "pdserve.b.v",
                     "pdserve.b.u"}  # fmt: skip
    assert set(imports_in("from . import z\nfrom .x import f", "pdserve.a", True, modules)) == {
        "pdserve.a.z",
        "pdserve.a.x",
    }
    graph: dict[str, set[str]] = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_the_graph_holds_deferred_imports() -> None:
    graph = import_graph()
    assert "pdserve.engine.llm" in graph["pdserve"]  # inside a function (pdserve/__init__.py's __getattr__)
    assert "pdserve.engine.runner" in graph["pdserve.engine.tp.rank"]  # inside a function


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles = [describe(graph, c) for c in strongly_connected(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
