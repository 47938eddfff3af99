"""The package's shape: no import cycles between opsd modules, arrows that run down the layers, a short,
readable step, small modules and functions, each name defined once and private names kept private."""

from __future__ import annotations

import ast
from collections.abc import Callable
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
LIGHT = [
    "opsd.config",
    "opsd.loss.spec",
    "opsd.data.sources",
    "opsd.data.prompts",
    "opsd.devices",
    "opsd.cpu",
]
# Packages light throughout; of the others (opsd.cpu) only the package's face is light.
LIGHT_WHOLE = {"opsd.config"}
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


# --- arrows run down the house (docs/architecture.md, "Arrows run down the house") ------------------

# Every opsd module's layer, top to bottom, a room a line; a module imports only from its own layer or
# below. Notes: `opsd` is the package's face (`from opsd import Trainer`); `opsd.eval` is the
# evaluation loop's face; `opsd.metrics`, the step's record, reads the loss's statistics;
# `opsd.loss.spec`, the loss's options and their rules (no torch), is what the config validates
# through; `opsd.fetch` is the model cache, and its `opsd fetch-model` parser imports nothing above it.
LAYERS: dict[str, list[str]] = {
    "commands": """
        opsd opsd.__main__ opsd.cli opsd.configdoc opsd.env opsd.report opsd.sft opsd.rollout.serve
        opsd.probe opsd.probe_report
        opsd.eval.cli
        opsd.compare opsd.compare.cli opsd.compare.methods opsd.compare.plan opsd.compare.records
        opsd.compare.report opsd.compare.run opsd.compare.tuning
        opsd.demo opsd.demo.base opsd.demo.cli opsd.demo.compare opsd.demo.run opsd.demo.task
    """.split(),
    "the run": "opsd.setup opsd.trainer".split(),
    "components": """
        opsd.anchor opsd.microbatch opsd.objectives opsd.optim opsd.metrics opsd.rewards opsd.grading
        opsd.teacher
        opsd.checkpoint opsd.records opsd.rundir opsd.guard
        opsd.data opsd.data.batching opsd.data.controls opsd.data.prompts opsd.data.sampler
        opsd.data.solutions opsd.data.sources
        opsd.eval opsd.eval.cut opsd.eval.heldout opsd.eval.loop opsd.eval.sets
        opsd.loss opsd.loss.fused opsd.loss.kernels opsd.loss.overlap opsd.loss.policy_gradient
        opsd.loss.reference
        opsd.rollout opsd.rollout.base opsd.rollout.hf opsd.rollout.make opsd.rollout.queue
        opsd.rollout.remote opsd.rollout.reuse opsd.rollout.vllm
    """.split(),
    "foundations": """
        opsd.config opsd.config.base opsd.config.commands opsd.config.cpu opsd.config.data opsd.config.eval
        opsd.config.load opsd.config.loss opsd.config.model opsd.config.optim opsd.config.rollout
        opsd.config.root opsd.loss.spec opsd.errors
        opsd.models opsd.tiny opsd.fetch
        opsd.devices opsd.precision opsd.distributed opsd.parallel opsd.procs
        opsd.companions opsd.companion_shim opsd.companion_shim.sitecustomize
        opsd.cpu opsd.cpu.bf16 opsd.cpu.buckets opsd.cpu.budget opsd.cpu.cache opsd.cpu.fold opsd.cpu.heap
        opsd.cpu.kv opsd.cpu.layout opsd.cpu.openmp opsd.cpu.packing
    """.split(),
}


def layer_of() -> dict[str, int]:
    """Module -> its layer's depth (0: the commands, at the top)."""
    return {m: depth for depth, modules in enumerate(LAYERS.values()) for m in modules}


def import_edges(sources: dict[str, str], top_level_only: bool = False) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for each import of one opsd module by another, lazy ones inside
    functions included (unless ``top_level_only``); ``from opsd.x import y`` imports ``opsd.x.y`` where
    that is a module, else ``opsd.x``."""
    edges = []
    for name, source in sorted(sources.items()):
        tree = ast.parse(source)
        for node in tree.body if top_level_only else ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in sources:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    edges.append((name, full if full in sources else node.module, node.lineno))
            elif isinstance(node, ast.Import):
                edges += [(name, a.name, node.lineno) for a in node.names if a.name in sources]
    return sorted({(a, b, line) for a, b, line in edges if a != b})


def upward_imports(sources: dict[str, str], layers: dict[str, int]) -> list[str]:
    """Each import of a module from a layer above the importer's, as "importer:line (layer) -> imported
    (layer)". Loading a module runs its packages' ``__init__`` first, so what a package imports at its
    top is imported by each of its modules too ("..., as package:line imports it")."""
    names = list(LAYERS)
    found = [
        f"{a}:{line} ({names[layers[a]]}) -> {b} ({names[layers[b]]})"
        for a, b, line in import_edges(sources)
        if layers[b] < layers[a]
    ]
    on_load = import_edges(sources, top_level_only=True)
    for module in sorted(sources):
        for package, b, line in on_load:
            if module.startswith(package + ".") and b != module and layers[b] < layers[module]:
                found.append(
                    f"{module} ({names[layers[module]]}) -> {b} ({names[layers[b]]}), "
                    f"as {package}:{line} imports it"
                )
    return found


def test_every_module_has_a_layer():
    classified = [m for modules in LAYERS.values() for m in modules]
    twice = sorted({m for m in classified if classified.count(m) > 1})
    assert not twice, f"in two layers: {twice}"
    modules = set(_sources())
    missing = sorted(modules - set(classified))
    assert not missing, (
        f"modules in no layer: {missing}: add each to LAYERS in tests/meta/test_layout.py (commands, "
        'the run, components, foundations) and to docs/architecture.md, "Arrows run down the house"'
    )
    gone = sorted(set(classified) - modules)
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


def test_arrows_run_down_the_house():
    """A module imports only from its own layer or below (docs/architecture.md, "Arrows run down the
    house"): commands, the run, components, foundations."""
    found = upward_imports(_sources(), layer_of())
    assert not found, "imports from a layer above the importer's:\n" + "\n".join(found)


def test_the_layer_rule_catches_an_upward_import():
    sources = {
        "opsd.cli": "import opsd.trainer\nfrom opsd import models\n",
        "opsd.trainer": "from opsd.setup import build\n",
        "opsd.setup": "def f():\n    from opsd.cli import main\n",
        "opsd.models": "from opsd import errors, __version__\n",
        "opsd.errors": "",
        "opsd": "",
        "opsd.eval": "from opsd.eval.cli import run_eval\nfrom opsd.eval.loop import evaluate_model\n",
        "opsd.eval.cli": "",
        "opsd.eval.loop": "",
    }
    layers = {
        "opsd.cli": 0,
        "opsd": 0,
        "opsd.trainer": 1,
        "opsd.setup": 1,
        "opsd.models": 3,
        "opsd.errors": 3,
    }
    layers |= {"opsd.eval": 0, "opsd.eval.cli": 0, "opsd.eval.loop": 2}
    assert upward_imports(sources, layers) == [
        "opsd.models:1 (foundations) -> opsd (commands)",
        "opsd.setup:2 (the run) -> opsd.cli (commands)",
        "opsd.eval.loop (components) -> opsd.eval.cli (commands), as opsd.eval:1 imports it",
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
        if path.is_file():
            modules = [path]
        elif name in LIGHT_WHOLE:
            modules = sorted(path.with_suffix("").rglob("*.py"))
        else:
            modules = [path.with_suffix("") / "__init__.py"]
        for module in modules:
            lines = [line for root, line in _top_level_roots(module) if root == "torch"]
            assert not lines, f"{module.name} of {name} imports torch at module level (line {lines[0]})"


def test_the_package_imports_no_bench_or_tests():
    for path in PKG.rglob("*.py"):
        roots = {root for root, _ in _top_level_roots(path, anywhere=True)}
        bad = {"bench", "tests", "helpers", "conftest", "_common"} & roots
        assert not bad, f"{path.relative_to(PKG.parent)} imports {sorted(bad)}"


# --- sizes: a newcomer reads a module, not a file; a function, not a page ---------------------------

MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
MAX_MODULE_LINES = 600


def _python_files(*folders: str, leave_out: tuple[str, ...] = ()) -> list[Path]:
    """The ``.py`` files under each folder of the repository, less those under ``leave_out``."""
    skip = [ROOT / f for f in leave_out]
    return [
        p
        for folder in folders
        for p in sorted((ROOT / folder).rglob("*.py"))
        if not any(s == p or s in p.parents for s in skip)
    ]


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from its ``def`` to its last line, the signature included and the docstring
    left out (decorators are above the ``def`` and do not count)."""
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters, ``self``/``cls`` not counted; ``*args`` and ``**kwargs`` one each."""
    a = fn.args
    named = [*a.posonlyargs, *a.args]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def functions_over(paths: list[Path], measure: Callable[[ast.AST], int], limit: int, unit: str) -> list[str]:
    """Each function whose ``measure`` is over ``limit``, as "file:line function: N unit"."""
    return [
        f"{_rel(path)}:{fn.lineno} {fn.name}: {measure(fn)} {unit}"
        for path in paths
        for fn in _functions(path)
        if measure(fn) > limit
    ]


def long_functions(paths: list[Path]) -> list[str]:
    return functions_over(paths, function_lines, MAX_FUNCTION_LINES, "lines")


def wide_functions(paths: list[Path]) -> list[str]:
    return functions_over(paths, parameter_count, MAX_PARAMETERS, "parameters")


def long_modules(paths: list[Path]) -> list[str]:
    """Each module over ``MAX_MODULE_LINES`` lines, as "file: N lines"."""
    counts = {path: len(path.read_text().splitlines()) for path in paths}
    return [f"{_rel(path)}: {n} lines" for path, n in counts.items() if n > MAX_MODULE_LINES]


def test_no_function_is_over_80_lines():
    """Counted from ``def`` to the last line, the docstring left out, in opsd/, bench/ (its GPU
    evidence scripts in bench/gpu/ aside) and scripts/: past this size a reader scrolls a function."""
    paths = _python_files("opsd", "bench", "scripts", leave_out=("bench/gpu",))
    found = long_functions(paths)
    assert not found, f"{len(found)} functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_no_function_takes_over_8_parameters():
    """In opsd/, bench/ and scripts/: more than eight, and the parameters belong together in an object
    (a config section, a dataclass) or the function does two jobs."""
    found = wide_functions(_python_files("opsd", "bench", "scripts"))
    assert not found, f"{len(found)} functions over {MAX_PARAMETERS} parameters:\n" + "\n".join(found)


def test_no_module_is_over_600_lines():
    """In opsd/, bench/ (bench/gpu/ included) and tests/, every folder down: a module says one thing."""
    found = long_modules(_python_files("opsd", "bench", "tests"))
    assert not found, f"{len(found)} modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(found)


def test_the_size_counts():
    fn = ast.parse('def f():\n    """Doc\n    more."""\n    a = 1\n    return a\n').body[0]
    assert function_lines(fn) == 3  # def, a = 1, return: the docstring left out
    fn = ast.parse("def g():\n    a = 1\n    b = 2\n    return a + b\n").body[0]
    assert function_lines(fn) == 4
    fn = ast.parse("@cache\ndef h(\n    x,\n    y,\n):\n    return x\n").body[0]
    assert function_lines(fn) == 5  # the signature's four lines and the body; the decorator not
    cls = ast.parse("class C:\n    def m(self, a, *rest, b, **kw):\n        pass\n").body[0]
    assert parameter_count(cls.body[0]) == 4  # a, *rest, b, **kw
    fn = ast.parse("def k(cls_, a, /, b, *, c=1):\n    pass\n").body[0]
    assert parameter_count(fn) == 4
    src = "def big(" + ", ".join(f"a{i}" for i in range(9)) + "):\n" + "    x = 1\n" * 80
    path = ROOT / "tests" / "meta" / "_size_probe.py"
    try:
        path.write_text(src)
        assert long_functions([path]) == ["tests/meta/_size_probe.py:1 big: 81 lines"]
        assert wide_functions([path]) == ["tests/meta/_size_probe.py:1 big: 9 parameters"]
        assert long_modules([path]) == []
    finally:
        path.unlink()


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
    """Within opsd/, and from bench/ and scripts/ into opsd/ (tests may reach a private name)."""
    scripts = {_module_name(p): p.read_text() for p in _python_files("bench", "scripts")}
    found = private_uses(_sources() | scripts)
    why = "private names used across modules (make the name public, or move it):\n"
    assert not found, why + "\n".join(found)


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
