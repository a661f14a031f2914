"""Import cycles among our own modules, lazy imports included.

    python -m tools.import_cycles [--packages codec bus discovery nodes tools] [--json]

An `ast` walk over every `.py` file of the packages (nothing is imported): each `import` and
`from ... import` names an edge from the module it is in to the module it runs. An import inside
a function is *lazy*; one under `if TYPE_CHECKING:` never runs and is left out. `from pkg import
name` runs `pkg.name` when that is a module of ours, else `pkg` (its `__init__`). Parent
packages' `__init__` files, which Python also runs, are not edges: a package's own `__init__`
re-exporting its modules would otherwise make every package a cycle.

Reported: the strongly connected groups of the module graph with module-level edges only (what
`import` runs: must be none), with every edge (module-level and lazy), and of the package graph
(modules collapsed to their first two name parts, `nodes.engine`, `tools.bench_decode`, ...) with
every edge. Exit status 1 when a group exists at module level.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("codec", "bus", "discovery", "nodes", "tools")


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    lazy: bool
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, lazy) for every import that can run, skipping `if TYPE_CHECKING:` bodies."""

    def walk(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for sub in child.orelse:
                    yield from walk_one(sub, lazy)
                continue
            yield from walk_one(child, lazy)

    def walk_one(node: ast.AST, lazy: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(node, inner)

    yield from walk(tree, False)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT, packages=PACKAGES) -> tuple[set[str], list[Edge]]:
    files: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files[module_name(path, root)] = path
    modules = set(files)
    edges: list[Edge] = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node, lazy in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(mod, is_pkg, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                # the longest prefix of ours (`import nodes.engine.core as c` -> nodes.engine.core)
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges.append(Edge(mod, t, lazy, node.lineno))
    return modules, edges


def strongly_connected(nodes: set[str], pairs: set[tuple[str, str]]) -> list[list[str]]:
    """Groups of two or more nodes that reach each other (Tarjan, iterative)."""
    out: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in pairs:
        out[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(out[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(out[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        group.append(w)
                        if w == v:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return sorted(groups)


def package_of(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def report(root: Path = ROOT, packages=PACKAGES) -> dict:
    modules, edges = import_graph(root, packages)
    top = {(e.src, e.dst) for e in edges if not e.lazy}
    every = {(e.src, e.dst) for e in edges}
    pkgs = {package_of(m) for m in modules}
    pkg_pairs = {(package_of(a), package_of(b)) for a, b in every if package_of(a) != package_of(b)}

    def detail(groups):
        return [{"modules": g, "edges": [
            f"{e.src} -> {e.dst} ({'lazy, ' if e.lazy else ''}line {e.line})"
            for e in edges if e.src in g and e.dst in g]} for g in groups]

    return {
        "modules": len(modules), "edges": len(every), "lazy_edges": len(every - top),
        "module_level": detail(strongly_connected(modules, top)),
        "with_lazy": detail(strongly_connected(modules, every)),
        "packages": strongly_connected(pkgs, pkg_pairs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.import_cycles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packages", nargs="+", default=list(PACKAGES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = report(ROOT, args.packages)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['modules']} modules, {r['edges']} import edges ({r['lazy_edges']} lazy only)")
        for title, key in (("module level", "module_level"), ("lazy included", "with_lazy")):
            print(f"cycles, {title}: {len(r[key])}")
            for g in r[key]:
                print("  " + " <-> ".join(g["modules"]))
                for e in g["edges"]:
                    print("      " + e)
        print(f"package cycles, lazy included: {len(r['packages'])}")
        for g in r["packages"]:
            print("  " + " <-> ".join(g))
    return 1 if r["module_level"] else 0


if __name__ == "__main__":
    sys.exit(main())
