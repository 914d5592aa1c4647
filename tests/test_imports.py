"""The import graph of ``znni_core``: no cycles, and data flows one way through the packages.

Every ``import`` counts, those inside functions too (a lazy import is still a dependency):

    errors, units, version, cachedir, progress  ->  geometry  ->  net  ->  layers  ->  plan  ->  exec
        ->  inference  ->  znni_core (the API)  ->  pipeline, warmup  ->  cli
    io: beside, on geometry only

A module may import its own package and any package of a lower rank (except :data:`NEVER`'s);
two packages of the same rank never import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "znni_core"

RANK = {
    "errors": 0,
    "units": 0,
    "progress": 0,
    "version": 0,
    "cachedir": 0,
    "geometry": 1,
    "net": 2,
    "io": 2,
    "layers": 3,
    "plan": 4,
    "exec": 5,
    "inference": 6,
    "dask": 7,  # infer_dask: inference on a dask array, beside the package root
    "": 7,
    "pipeline": 8,
    "warmup": 8,
    "cli": 9,
}
#: lower packages that a package still never imports: primitives know arrays only, and the
#: planner and the executor never touch storage
NEVER = {"layers": {"geometry", "net", "io"}, "plan": {"io"}, "exec": {"io"}}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package at ``root``."""
    out = {}
    for p in root.rglob("*.py"):
        parts = (root.name,) + p.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules it imports}`` among ``mods`` (``from pkg import submodule`` names the
    submodule; other names of ``from pkg import ...`` name the package)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            else:
                continue
            edges[m].update(t for t in targets if t in mods and t != m)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def package(module: str) -> str:
    """``znni_core.plan.search`` -> ``plan``; ``znni_core`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "znni_core"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "geometry.py").write_text("from .plan import search\n")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "plan" / "search.py").write_text("def f():\n    from .graph import g\n")
    (pkg / "plan" / "graph.py").write_text("from . import search\ng = 1\n")
    edges = import_graph(modules(pkg))
    assert cycles(edges) == [["znni_core.plan.graph", "znni_core.plan.search"]]
    assert "znni_core.plan.search" in edges["znni_core.geometry"]


def test_no_import_cycles():
    found = cycles(import_graph(modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_flow_one_way():
    edges = import_graph(modules())
    unranked = sorted({package(m) for m in edges} - set(RANK))
    assert not unranked, f"packages without a rank in this test: {unranked}"
    upward = [
        f"{a} -> {b}"
        for a, targets in edges.items()
        for b in sorted(targets)
        if package(a) != package(b)
        and (RANK[package(b)] >= RANK[package(a)] or package(b) in NEVER.get(package(a), ()))
    ]
    assert not upward, "imports against the flow:\n" + "\n".join(upward)


def lazy_imports_without_reason(root: Path = ROOT) -> list[str]:
    """In-function imports with no comment on their line or the line above (``# lazy: loads numba
    and scipy only when called``): an import belongs at the module's top unless a comment names
    what importing it there would cost."""
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
                    # the comment may sit above a group of imports
                    k = node.lineno - 2
                    while k > 0 and lines[k].strip().startswith(("from ", "import ")):
                        k -= 1
                    if (
                        "#" not in lines[node.lineno - 1]
                        and not above.startswith("#")
                        and not lines[k].strip().startswith("#")
                    ):
                        out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_imports_are_at_the_top_unless_a_comment_says_why(tmp_path):
    found = lazy_imports_without_reason()
    assert not found, "imports inside functions without a reason:\n" + "\n".join(found)
    pkg = tmp_path / "znni_core"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def f():\n    import json\n\n\ndef g():\n    # lazy: loads numba only when called\n    import numba\n"
    )
    assert [s.split(": ", 1)[1] for s in lazy_imports_without_reason(pkg)] == ["import json"]
