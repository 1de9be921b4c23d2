"""Layers point one way and no modules import each other in a loop.

Reads every module of the distribution with `ast` (nothing is imported), resolves each
import to the pdunit module it names, and checks two rules: an import between two
top-level packages goes down `LAYERS`, never up or sideways; and no imports form a
cycle, those under `if TYPE_CHECKING:` included: a type-only cycle is the same coupling
(a Protocol in the importing module breaks it, as engine/lb/load.py's LoadSource does).
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top-level package -> its layer; an import may only go to a lower layer (or stay inside
# its own package). Equal layers are siblings: neither imports the other.
LAYERS: dict[str, tuple[int, str]] = {
    "pdunit.kernels": (0, "kernels know tensors and the driver, nothing of requests or processes"),
    "pdunit.engine": (1, "the product's processes and protocols, built on the kernels"),
    "pdunit.sidecars": (2, "pod sidecars speak the engine's protocols (engine/proto), never define them"),
    "pdunit.operator": (2, "the operator deploys units from the engine's layout, runs none of their code"),
    "pdunit.bench": (3, "benchmarks drive the product; the product never needs a benchmark to run"),
    "pdunit": (4, "pkg/: the `pdunit` command (pdunit.cli) reaches every layer, nothing reaches it"),
}


@dataclass(frozen=True)
class Edge:
    """`importer` imports `imported` at `line`; `runs` is False under TYPE_CHECKING."""

    importer: str
    imported: str
    line: int
    runs: bool = True


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir: top-level package -> its folder."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in cfg["package-dir"].items()}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the distribution: name -> (file, is a package's __init__)."""
    dirs = package_dirs()
    out: dict[str, tuple[Path, bool]] = {}
    for top, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            out[".".join([top, *(parts[:-1] if is_init else parts)])] = (path, is_init)
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, is_init: bool, known: set[str]) -> list[Edge]:
    """The pdunit modules `name` imports: `from a.b import c` names a.b.c when that is a
    module, else a.b; relative imports resolve against `name`'s package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = _type_checking_lines(tree)
    package = name if is_init else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        for target in targets:
            if target == "pdunit" or target.startswith("pdunit."):
                imported = resolve(target)
                if imported and imported != name:
                    edges.append(Edge(name, imported, node.lineno, node.lineno not in typing_only))
    return sorted(set(edges), key=lambda e: (e.line, e.imported))


def all_edges() -> list[Edge]:
    mods = modules()
    return [e for name, (path, is_init) in mods.items() for e in imports_of(name, path, is_init, set(mods))]


def top_package(module: str) -> str:
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def backward_edges(edges: list[Edge]) -> list[str]:
    """Each import from one top-level package into another that is not below it."""
    bad = []
    for e in edges:
        src, dst = top_package(e.importer), top_package(e.imported)
        if src != dst and LAYERS[dst][0] >= LAYERS[src][0]:
            bad.append(f"{e.importer}:{e.line} imports {e.imported} ({src} is layer {LAYERS[src][0]}, "
                       f"{dst} layer {LAYERS[dst][0]}: {LAYERS[dst][1]})")
    return bad


def import_cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected groups of more than one module among all the imports,
    type-only ones included (Tarjan's algorithm, iterative), each sorted, with the lines
    that close them (a type-only one marked)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    members = set(group)
                    groups.append(sorted(
                        f"{e.importer}:{e.line} -> {e.imported}{'' if e.runs else ' (TYPE_CHECKING)'}"
                        for e in edges if e.importer in members and e.imported in members))
    return groups


def test_every_top_level_package_has_a_layer():
    assert set(package_dirs()) == set(LAYERS), "give each package of pyproject's package-dir a layer"


def test_the_walk_sees_every_package_and_resolves_its_imports():
    mods = modules()
    edges = all_edges()
    assert {top_package(m) for m in mods} == set(LAYERS)
    # one import of each kind the tree uses: absolute module, `from package import module`
    assert Edge("pdunit.engine.transfer.fabric", "pdunit.kernels.cudadrv", 0) in {
        Edge(e.importer, e.imported, 0) for e in edges}
    assert any(e.importer == "pdunit.cli" and e.imported == "pdunit.bench.main" for e in edges)


def test_no_package_imports_a_package_above_or_beside_it():
    bad = backward_edges(all_edges())
    assert not bad, "imports against the layers (tests/test_layers.py LAYERS):\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles(all_edges())
    assert not cycles, "import cycles:\n" + "\n\n".join("\n".join(c) for c in cycles)


def test_the_checks_catch_a_cycle_and_a_backward_edge():
    edges = [
        Edge("pdunit.engine.transfer.auto", "pdunit.engine.transfer.factory", 82),
        Edge("pdunit.engine.transfer.factory", "pdunit.engine.transfer.auto", 88),
        Edge("pdunit.engine.a", "pdunit.engine.b", 1),
        Edge("pdunit.engine.b", "pdunit.engine.c", 2),  # a -> b -> c, no way back: no cycle
        Edge("pdunit.kernels.cuda_rows", "pdunit.engine.transfer.cudadrv", 37),
        Edge("pdunit.engine.local", "pdunit.bench.capacity", 40),
        Edge("pdunit.sidecars.x", "pdunit.operator.y", 3),
        Edge("pdunit.bench.main", "pdunit.engine.cli", 5),  # downwards: allowed
    ]
    assert import_cycles(edges) == [[
        "pdunit.engine.transfer.auto:82 -> pdunit.engine.transfer.factory",
        "pdunit.engine.transfer.factory:88 -> pdunit.engine.transfer.auto",
    ]]
    bad = backward_edges(edges)
    assert [b.split(" ")[0] for b in bad] == [
        "pdunit.kernels.cuda_rows:37", "pdunit.engine.local:40", "pdunit.sidecars.x:3"]


def test_a_cycle_through_a_type_only_import_is_a_cycle():
    edges = [
        Edge("pdunit.engine.lb.balancer", "pdunit.engine.lb.load", 32),
        Edge("pdunit.engine.lb.load", "pdunit.engine.lb.balancer", 20, runs=False),
        Edge("pdunit.engine.lb.load", "pdunit.engine.lb.unit", 21, runs=False),  # out of the loop
    ]
    assert import_cycles(edges) == [[
        "pdunit.engine.lb.balancer:32 -> pdunit.engine.lb.load",
        "pdunit.engine.lb.load:20 -> pdunit.engine.lb.balancer (TYPE_CHECKING)",
    ]]
    # both ends type-only: still one
    both = [Edge(e.importer, e.imported, e.line, runs=False) for e in edges]
    assert len(import_cycles(both)) == 1


def test_imports_resolve_relative_and_type_only_forms(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "from ..kv import pool\n"
                    "from .base import TransferError\n"
                    "if TYPE_CHECKING:\n"
                    "    from pdunit.engine.lb.unit import UnitClient\n"
                    "def f():\n"
                    "    import pdunit.kernels.cudadrv\n")
    known = {"pdunit.engine.kv.pool", "pdunit.engine.transfer.base", "pdunit.engine.lb.unit",
             "pdunit.kernels.cudadrv", "pdunit.engine.transfer.m"}
    got = imports_of("pdunit.engine.transfer.m", path, False, known)
    assert [(e.imported, e.line, e.runs) for e in got] == [
        ("pdunit.engine.kv.pool", 2, True), ("pdunit.engine.transfer.base", 3, True),
        ("pdunit.engine.lb.unit", 5, False), ("pdunit.kernels.cudadrv", 7, True)]
