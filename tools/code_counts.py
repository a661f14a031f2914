"""Counts of the code's shape (issue 44's "must hold" figures), for a tree at any commit.

    python -m tools.code_counts [ROOT] [--json]

Over the source packages (`codec bus discovery nodes tools`, not tests), from the `ast` alone:
the largest classes and longest functions (lines from the `def`/`class` line to the last line
of the body, decorators excluded), names used by more than one class or module in different
places (a class name defined in two modules; a module file name, `__init__` aside, in two
packages), the classes whose name says "Session", and the import cycles
(`tools.import_cycles`, lazy imports included). ROOT defaults to this checkout; give another
(a `git worktree` of an older commit) to compare.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

from tools.import_cycles import report

PACKAGES = ("codec", "bus", "discovery", "nodes", "tools")


def _files(root: Path):
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


def counts(root: Path) -> dict:
    classes, functions = [], []
    class_homes: dict[str, list[str]] = defaultdict(list)
    module_homes: dict[str, list[str]] = defaultdict(list)
    lines = 0
    for path in _files(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        lines += text.count("\n")
        if path.name != "__init__.py":
            module_homes[path.name].append(rel)
        for node in ast.walk(ast.parse(text, rel)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(
                node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef):
                classes.append((size, f"{rel}:{node.name}", len([
                    n for n in node.body if isinstance(n, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef))])))
                class_homes[node.name].append(rel)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((size, f"{rel}:{node.name}"))
    classes.sort(reverse=True)
    functions.sort(reverse=True)
    cycles = report(root, PACKAGES)
    return {
        "source_lines": lines,
        "largest_classes": [{"lines": s, "class": n, "methods": m} for s, n, m in classes[:3]],
        "longest_functions": [{"lines": s, "function": n} for s, n in functions[:5]],
        "functions_over_60_lines": sum(1 for s, _ in functions if s > 60),
        "class_names_in_several_modules": {
            k: v for k, v in sorted(class_homes.items()) if len(set(v)) > 1},
        "module_names_in_several_packages": {
            k: v for k, v in sorted(module_homes.items()) if len(v) > 1},
        "session_classes": sorted(k for k in class_homes if "Session" in k),
        "import_cycles": {"module_level": len(cycles["module_level"]),
                          "with_lazy": len(cycles["with_lazy"]),
                          "packages": len(cycles["packages"])},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.code_counts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    c = counts(Path(args.root))
    if args.json:
        print(json.dumps(c, indent=2))
        return 0
    print(f"source lines: {c['source_lines']}")
    for k in ("largest_classes", "longest_functions"):
        print(f"{k}:")
        for row in c[k]:
            print("  " + ", ".join(f"{a}={b}" for a, b in row.items()))
    print(f"functions over 60 lines: {c['functions_over_60_lines']}")
    for k in ("class_names_in_several_modules", "module_names_in_several_packages"):
        print(f"{k}: {len(c[k])}")
        for name, where in c[k].items():
            print(f"  {name}: {', '.join(where)}")
    print(f"session_classes: {', '.join(c['session_classes'])}")
    print(f"import cycles: {c['import_cycles']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
