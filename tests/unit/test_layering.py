"""The subpackages of ``miaohui`` import only downwards (the layering in ``miaohui/__init__.py``'s docstring):
no import cycle between them, counting imports inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import miaohui

ROOT = Path(miaohui.__file__).parent

LAYERS = (
    ("errors", "paths", "config", "gil", "gcpolicy", "priority", "cli_output"),
    ("nlp", "zoo"),
    ("models",),
    ("sources",),
    ("compile",),
    ("engines",),
    ("generation",),
    ("validate",),
    ("serving",),
    ("dialogue",),
    ("server",),
    ("bench",),
    ("prepare", "cli"),
)
"""Lowest first. A unit imports from units of its own layer or of lower layers only."""


def _unit(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imported(path: Path, tree: ast.AST) -> list[tuple[str, int]]:
    """(miaohui module, line) of every import in the file, relative ones resolved."""
    package = list(path.relative_to(ROOT).parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) + 1 - node.level]
                out.append((".".join(["miaohui", *base, node.module or ""]).rstrip("."), node.lineno))
            elif node.module:
                out.append((node.module, node.lineno))
    return out


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) → the ``file:line`` places of those imports."""
    units = {_unit(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "_pb2" in path.name or path == ROOT / "__init__.py":
            continue
        src = _unit(path)
        for module, line in _imported(path, ast.parse(path.read_text(encoding="utf-8"))):
            parts = module.split(".")
            if parts[0] == "miaohui" and len(parts) > 1 and parts[1] in units and parts[1] != src:
                edges.setdefault((src, parts[1]), []).append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_subpackages() -> None:
    edges = unit_edges()
    found = cycles(edges)
    where = [
        f"{a} -> {b}: {', '.join(places)}" for comp in found for (a, b), places in edges.items() if {a, b} <= set(comp)
    ]
    assert not found, f"import cycles between subpackages: {found}\n" + "\n".join(where)


def test_every_unit_has_a_layer_and_imports_only_downwards() -> None:
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    units = {_unit(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert not units - rank.keys(), f"units without a layer in LAYERS: {sorted(units - rank.keys())}"
    upward = [f"{a} -> {b}: {', '.join(p)}" for (a, b), p in sorted(unit_edges().items()) if rank[a] < rank[b]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_check_finds_a_cycle() -> None:
    edges = {("serving", "server"): ["serving/x.py:1"], ("server", "serving"): ["server/y.py:2"], ("cli", "server"): []}
    assert cycles(edges) == [["server", "serving"]]
