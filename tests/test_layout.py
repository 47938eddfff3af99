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


def test_the_step_reads_top_to_bottom():
    """``Trainer.step`` calls the algorithm's phases itself, in order (docs/architecture.md, "The step
    reads top to bottom"): rollouts, splicing, the objective's scores, micro-batches, the micro-batch
    loop, the optimizer step."""
    tree = ast.parse((PKG / "trainer.py").read_text())
    step = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == "Trainer"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "step"
    )
    calls = []
    for node in ast.walk(step):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            calls.append((node.lineno, node.col_offset, name))
    order = [name for _, _, name in sorted(calls)]
    phases = ["next", "make_sample", "score", "microbatches", "forward_backward", "optimizer_step"]
    positions = [order.index(p) for p in phases]
    assert positions == sorted(positions), order


# --- the "never" rules of docs/architecture.md ----------------------------------------------------

MODEL_CODE = {"opsd.models", "opsd.teacher", "opsd.parallel", "opsd.rollout", "opsd.trainer"}
LIGHT = ["opsd.config", "opsd.loss.spec", "opsd.data.sources", "opsd.data.prompts", "opsd.devices"]
COMMANDS = ("opsd.cli", "opsd.eval", "opsd.sft", "opsd.demo", "opsd.compare", "opsd.probe")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def never_rule_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import the architecture forbids, as "importer -> imported"."""
    bad = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            loss_out = _in(name, "opsd.loss") and not _in(dep, "opsd.loss") and dep != "opsd.errors"
            data_models = _in(name, "opsd.data") and any(_in(dep, m) for m in MODEL_CODE)
            trainer = dep == "opsd.trainer" and name != "opsd" and not any(_in(name, c) for c in COMMANDS)
            if loss_out or data_models or (trainer and name != "opsd.trainer"):
                bad.append(f"{name} -> {dep}")
    return bad


def test_the_never_rules_hold():
    assert never_rule_violations(import_graph()) == []


def test_the_never_rules_catch_each_kind_of_violation():
    graph = {
        "opsd.loss.fused": {"opsd.models", "opsd.errors", "opsd.loss.spec"},
        "opsd.data.batching": {"opsd.teacher", "opsd.errors"},
        "opsd.report": {"opsd.trainer"},
        "opsd.eval.loop": {"opsd.trainer"},
        "opsd": {"opsd.trainer"},
    }
    assert never_rule_violations(graph) == [
        "opsd.data.batching -> opsd.teacher",
        "opsd.loss.fused -> opsd.models",
        "opsd.report -> opsd.trainer",
    ]


def _top_level_roots(path: Path, anywhere: bool = False) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    roots = []
    for node in ast.walk(tree) if anywhere else tree.body:
        if isinstance(node, ast.Import):
            roots += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.append((node.module.split(".")[0], node.lineno))
    return roots


def test_light_modules_do_not_import_torch_at_module_level():
    for name in LIGHT:
        path = PKG.parent / (name.replace(".", "/") + ".py")
        lines = [line for root, line in _top_level_roots(path) if root == "torch"]
        assert not lines, f"{name} imports torch at module level (line {lines[0]})"


def test_the_package_imports_no_bench_or_tests():
    for path in PKG.rglob("*.py"):
        roots = {root for root, _ in _top_level_roots(path, anywhere=True)}
        bad = {"bench", "tests", "helpers", "conftest", "_common"} & roots
        assert not bad, f"{path.relative_to(PKG.parent)} imports {sorted(bad)}"


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines without its docstring."""
    body = fn.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    if docstring and isinstance(body[0].value.value, str):
        if len(body) == 1:
            return 0
        return fn.end_lineno - body[1].lineno + 1
    return fn.end_lineno - body[0].lineno + 1


def test_modules_and_functions_stay_small():
    """No module over 600 lines (config.py, which only declares fields, is exempt) and no function over
    80 lines, docstring excluded: past these sizes a newcomer reads a file instead of a module."""
    long_modules, long_functions = [], []
    for path in sorted(PKG.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 600 and path.name != "config.py":
            long_modules.append(str(path.relative_to(PKG.parent)))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 80:
                long_functions.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name}")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_the_size_count_leaves_out_the_docstring_only():
    fn = ast.parse('def f():\n    """Doc\n    more."""\n    a = 1\n    return a\n').body[0]
    assert _body_lines(fn) == 2
    fn = ast.parse("def g():\n    a = 1\n    b = 2\n    return a + b\n").body[0]
    assert _body_lines(fn) == 3
