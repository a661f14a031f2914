"""No import cycle among our modules, imports inside functions included (issue 44)."""

from tools.import_cycles import import_graph, main, report, strongly_connected


def test_no_import_cycle_lazy_imports_and_packages_included():
    r = report()
    assert r["module_level"] == []
    assert r["with_lazy"] == [], r["with_lazy"]
    assert r["packages"] == [], r["packages"]
    assert main([]) == 0


def test_the_walk_sees_lazy_imports_and_finds_a_cycle_through_them(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import a\n")
    modules, edges = import_graph(tmp_path, ("pkg",))
    assert {(e.src, e.dst, e.lazy) for e in edges} == {("pkg.a", "pkg.b", False),
                                                       ("pkg.b", "pkg.a", True)}
    assert strongly_connected(modules, {(e.src, e.dst) for e in edges}) == [["pkg.a", "pkg.b"]]
    assert strongly_connected(modules, {(e.src, e.dst) for e in edges if not e.lazy}) == []
