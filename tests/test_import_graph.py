"""The package's import graph has no cycle, counting imports inside functions (an
import deferred to dodge a cycle is still a cycle) and ``from resumable import x``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in (src / "resumable").rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        package = module.split(".")
        if path.name != "__init__.py":
            package.pop()
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" for a in node.names] + [base]


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports, anywhere in its body."""
    modules = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(name, path, node)
            # `from pkg import sub` names the submodule; `from mod import name` the module.
            hits = [t for t in targets[:-1] if t in modules] or targets[-1:]
            for target in hits:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
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
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "resumable.manager" in graph and graph["resumable"]  # the graph was read
    assert cycles(graph) == []


@pytest.mark.parametrize(
    "edges, expected",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_cycles_finds_every_loop(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(edges) == expected


def test_a_deferred_import_counts(tmp_path: Path) -> None:
    pkg = tmp_path / "resumable"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from resumable.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from resumable import a\n    return a\n")
    assert cycles(import_graph(tmp_path)) == [["resumable.a", "resumable.b"]]
