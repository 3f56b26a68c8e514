"""No module of memstrata imports itself back, directly or through others, not even under TYPE_CHECKING or inside a
function: a cycle is two modules that can only be understood, changed and tested together."""
from __future__ import annotations

import sys

import grimp

PACKAGES = ("memstrata.api", "memstrata.plan", "memstrata.node", "memstrata.operator", "memstrata.nodeagent",
            "memstrata.cli", "memstrata.runtime")


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)
    assert len(graph.modules) > 100, "the graph must see the whole product, or passing proves nothing"
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("m.a", "m.b"), ("m.b", "m.c"), ("m.c", "m.a"), ("m.c", "m.d")):
        graph.add_import(importer=a, imported=b)
    assert cycles(graph) == [["m.a", "m.b", "m.c"]]
