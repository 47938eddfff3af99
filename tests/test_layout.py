"""The package's shape: no import cycles between opsd modules, and a short, readable step."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "opsd"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """opsd module -> the opsd modules it imports (at module level, or anywhere)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        deps: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        # a package's own submodules are not a dependency of its __init__ cycle-wise
        graph[name] = {d for d in deps if not d.startswith(name + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_cycles():
    """Checked over every import, the lazy ones inside functions included."""
    graph = import_graph()
    assert "opsd.trainer" in graph and graph["opsd.trainer"], "the scan found no imports: it is broken"
    assert find_cycle(graph) is None, find_cycle(graph)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_step_reads_like_a_loop():
    src = (PKG / "trainer.py").read_text()
    tree = ast.parse(src)
    step = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == "Trainer"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "step"
    )
    assert step.end_lineno - step.lineno + 1 <= 45
