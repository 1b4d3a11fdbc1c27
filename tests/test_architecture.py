"""The package's import graph: imports point downward only and there are no cycles.

The layers, top to bottom (docs/design.md): cli -> commands -> train -> bench / models / adapters ->
registry -> layers / analysis -> functional -> ops. Inside ops/, each variant's folder
(ops/<variant>/) uses the shared modules (ops/*.py) and the shared kernel families (ops/kernels/),
never another variant's folder; the shared code never imports a variant, except ops/builtin.py,
which lists the variants that ship. The graph is read from the source (every import statement,
those inside functions included), so the test needs nothing importable.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "attnzoo"

RANK = {"__main__": 9, "cli": 8, "commands": 7, "train": 6, "bench": 5, "models": 5, "adapters": 5,
        "registry": 4, "layers": 3, "analysis": 3, "functional": 2, "ops": 1}
SHARED_OPS_FOLDERS = {"kernels", "measured_tables"}
VARIANT_CATALOG = "attnzoo.ops.builtin"


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = modules()


def imported(name: str) -> set[str]:
    """The attnzoo modules ``name`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "attnzoo"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "attnzoo":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported(name) for name in MODULES}


def component(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def ops_folder(name: str) -> str | None:
    """For a module under attnzoo/ops/<folder>/, the folder; None for ops/*.py and everything else."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] != "ops":
        return None
    path, is_package = MODULES[name]
    return parts[2] if (is_package or len(parts) > 3) else None


def test_the_graph_is_read():
    # a scanner that found nothing would pass every rule below
    assert len(MODULES) > 100
    assert "attnzoo.ops.catalog" in GRAPH["attnzoo.ops.softmax"]
    assert "attnzoo.registry" in GRAPH["attnzoo.adapters.spec"] or any(
        "attnzoo.registry" in GRAPH[m] for m in MODULES if m.startswith("attnzoo.adapters"))


def test_every_component_has_a_rank():
    unranked = sorted({component(m) for m in MODULES if component(m) is not None} - set(RANK))
    assert not unranked, f"add these to RANK (and to docs/design.md's layering): {unranked}"


def test_imports_point_downward():
    upward = [f"{src} -> {dst}" for src, targets in GRAPH.items() for dst in targets
              if component(src) and component(dst) and RANK[component(src)] < RANK[component(dst)]]
    assert not upward, "imports that point up the layering:\n" + "\n".join(sorted(upward))


def test_a_variant_folder_uses_only_shared_ops_code():
    bad = []
    for src, targets in GRAPH.items():
        if component(src) != "ops" or src == VARIANT_CATALOG:
            continue
        own = ops_folder(src)
        for dst in targets:
            other = ops_folder(dst)
            if component(dst) == "ops" and other is not None and other != own and other not in SHARED_OPS_FOLDERS:
                bad.append(f"{src} -> {dst}")
    assert not bad, "ops code importing a variant folder other than its own:\n" + "\n".join(sorted(bad))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return out


def graph_without_package_faces() -> dict[str, set[str]]:
    """Importing a submodule runs its package's __init__, but a package face that re-exports its own
    submodules is not a dependency of theirs: drop edges from a module to the packages that contain it."""
    return {src: {dst for dst in targets if not src.startswith(dst + ".")} for src, targets in GRAPH.items()}


def test_no_import_cycles():
    found = cycles(graph_without_package_faces())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected
