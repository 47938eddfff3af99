"""The package's shape: no import cycles between opsd modules, and a short, readable step."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PKG = ROOT / "opsd"


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


# the command modules: nothing below them imports them (docs/architecture.md)
COMMAND_MODULES = (
    "opsd.cli",
    "opsd.demo",
    "opsd.compare",
    "opsd.probe",
    "opsd.rollout.serve",
    "opsd.env",
    "opsd.report",
    "opsd.eval.cli",
    "opsd.sft",
)


def command_imports_from_below(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a command module by a module that is not a command, as "importer -> imported";
    the package's ``__init__`` and ``__main__`` start commands and are left out."""
    bad = []
    for name, deps in sorted(graph.items()):
        if name in ("opsd", "opsd.__main__") or any(_in(name, c) for c in COMMAND_MODULES):
            continue
        bad += [f"{name} -> {d}" for d in sorted(deps) if any(_in(d, c) for c in COMMAND_MODULES)]
    return bad


def test_nothing_below_a_command_imports_one():
    assert command_imports_from_below(import_graph()) == []


def test_the_command_rule_catches_an_import_from_below():
    graph = {"opsd.anchor": {"opsd.sft", "opsd.data"}, "opsd.compare.run": {"opsd.sft"}, "opsd": {"opsd.cli"}}
    assert command_imports_from_below(graph) == ["opsd.anchor -> opsd.sft"]


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
        for module in [path] if path.is_file() else sorted(path.with_suffix("").rglob("*.py")):
            lines = [line for root, line in _top_level_roots(module) if root == "torch"]
            assert not lines, f"{module.name} of {name} imports torch at module level (line {lines[0]})"


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


# --- each name once, private names kept private ----------------------------------------------------

ONCE_EXEMPT = {"main", "__getattr__"}  # every command module has its main; lazy packages their __getattr__


def defined_twice(sources: dict[str, str]) -> list[str]:
    """Each public function or class name defined at the top level of more than one module, as
    "name: module, module"; a reader who greps a name finds one definition."""
    where: dict[str, list[str]] = {}
    for module, source in sorted(sources.items()):
        for node in ast.parse(source).body:
            named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if named and not node.name.startswith("_") and node.name not in ONCE_EXEMPT:
                where.setdefault(node.name, []).append(module)
    return [f"{name}: {', '.join(mods)}" for name, mods in sorted(where.items()) if len(mods) > 1]


def _sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_each_top_level_name_is_defined_once():
    assert defined_twice(_sources()) == []


def test_the_once_rule_catches_a_name_defined_twice():
    sources = {
        "opsd.a": "def run_x():\n    pass\nclass Loaded:\n    pass\ndef main():\n    pass\n",
        "opsd.b": "def run_x():\n    pass\ndef _helper():\n    pass\ndef main():\n    pass\n",
        "opsd.c": "class Loaded:\n    pass\ndef _helper():\n    pass\n",
    }
    assert defined_twice(sources) == ["Loaded: opsd.a, opsd.c", "run_x: opsd.a, opsd.b"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(sources: dict[str, str]) -> list[str]:
    """Each private name (one leading underscore) one opsd module takes from another, as
    "module:line what": imported (``from opsd.x import _name``) or read off an imported opsd module
    (``x._name``, ``opsd.x._name``). A name another module needs is public, or it moves."""
    found = []
    for name, source in sorted(sources.items()):
        tree = ast.parse(source)
        bound: dict[str, str] = {}  # local name -> the opsd module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]  # `import opsd.x` binds `opsd`; `import opsd.x as m`, m
                    if a.name in sources:
                        bound[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in sources:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in sources:
                        bound[a.asname or a.name] = full
                    elif _private(a.name) and node.module != name:
                        found.append(f"{name}:{node.lineno} from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                target = ".".join([bound[value.id], *reversed(chain)])
                if target in sources and target != name:
                    found.append(f"{name}:{node.lineno} {target}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    assert private_uses(_sources()) == []


def test_the_private_rule_catches_imports_and_attributes():
    sources = {
        "opsd": "",
        "opsd.a": "def _helper():\n    pass\n_flag = 1\n",
        "opsd.b": "from opsd.a import _helper, __doc__\n",
        "opsd.c": "\n".join(
            [
                "import opsd.a",
                "import opsd.a as m",
                "from opsd import a",
                "opsd.a._flag",
                "m._helper()",
                "a.__doc__",
            ]
        ),
        "opsd.d": "from opsd import a\n\ndef f(x):\n    return a._helper(), x._private\n",
        "opsd.e": "import json\njson._default_decoder\n",
    }
    assert private_uses(sources) == [
        "opsd.b:1 from opsd.a import _helper",
        "opsd.c:4 opsd.a._flag",
        "opsd.c:5 opsd.a._helper",
        "opsd.d:4 opsd.a._helper",
    ]
