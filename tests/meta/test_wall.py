"""The CPU room's wall: outside ``opsd/cpu/`` and ``opsd/devices.py`` no code branches on the kind of
device. CPU-only behaviour is the CPU plan's (behind ``cpu.tuning``, reached through its hooks), and
a device fact or a device-specific action is a function in ``opsd/devices.py``."""

from __future__ import annotations

import ast

from helpers import ROOT

PKG = ROOT / "opsd"
DEVICE_TYPES = {"cpu", "cuda"}
TYPE_NAMES = {"type", "device_type"}  # torch.device.type, DeviceMesh.device_type
ASKS = {"is_cpu", "is_cuda"}  # vLLM's current_platform.is_cpu(), a tensor's .is_cuda
# Files outside this package's reach when the wall was built: each still branches, and the test
# below fails once it no longer does, so the entry is removed with its last branch.
NOT_YET: dict[str, str] = {}


def _names_a_device(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in DEVICE_TYPES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_device(e) for e in node.elts)
    return False


def _is_a_type(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in TYPE_NAMES
    if isinstance(node, ast.Name):
        return node.id in TYPE_NAMES
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str"


def _mentions_cuda(node: ast.AST) -> bool:
    for n in ast.walk(node):
        name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else ""
        if "cuda" in name.lower() or (isinstance(n, ast.Constant) and n.value == "cuda"):
            return True
    return False


def device_branches(source: str) -> list[tuple[int, str]]:
    """Each place in ``source`` that branches on the kind of device, with what it is: a device type
    compared with "cpu" or "cuda" (``==``, ``!=``, ``in``, either side, ``.type``, ``.device_type``
    or ``str(device)``), an ``is_cpu``/``is_cuda`` question, or a test that mentions CUDA with an else
    (or negated: its body is the CPU's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_a_type(s) for s in sides) and any(_names_a_device(s) for s in sides):
                found.append((node.lineno, "device type compared"))
        elif isinstance(node, ast.Attribute) and node.attr in ASKS:
            found.append((node.lineno, node.attr))
        if isinstance(node, (ast.If, ast.IfExp)):
            negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
            if _mentions_cuda(node.test) and (node.orelse or negated):
                found.append((node.lineno, "CUDA-else"))
    return found


def _outside_the_room() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "devices.py" or PKG / "cpu" in path.parents:
            continue
        hits = device_branches(path.read_text())
        if hits:
            found[str(path.relative_to(PKG.parent))] = hits
    return found


def test_no_device_branch_outside_the_cpu_room_and_devices():
    found = _outside_the_room()
    assert {k: v for k, v in found.items() if k not in NOT_YET} == {}
    assert set(NOT_YET) <= set(found), "a file no longer branches: remove it from NOT_YET"


def test_the_wall_check_finds_each_spelling():
    src = "\n".join(
        [
            'a = x.device.type == "cpu"',
            'b = "cuda" != t.type',
            'c = d.type in ("cuda",)',
            'e = mesh.device_type == "cuda"',
            'f = str(dev) == "cpu"',
            "g = current_platform.is_cpu()",
            "h = w.is_cuda",
            "i = 1 if torch.cuda.is_available() else 2",
            "if not torch.cuda.is_available():\n    pass",
            "if cuda:\n    pass\nelse:\n    pass",
            'j = frozen_copy == "cpu"',  # a config value, not a device: allowed
            "if torch.cuda.is_available():\n    torch.cuda.empty_cache()",  # CUDA-only, no else: allowed
        ]
    )
    lines = [n for n, _ in device_branches(src)]
    assert sorted(set(lines)) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]


# --- the CPU room's one door: the package ``opsd.cpu``, its plan's hooks ---------------------------

CPU_SUBMODULES = {p.stem for p in (PKG / "cpu").glob("*.py") if p.stem != "__init__"}


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """``a.b.c`` as the module path it names, its first name resolved through ``bound``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *reversed(parts)])


def cpu_submodule_uses(source: str) -> list[str]:
    """Each place ``source`` reaches past the package ``opsd.cpu`` into one of its modules, as
    "line what": ``import opsd.cpu.x``, ``from opsd.cpu.x import ...``, ``from opsd.cpu import x``, or
    ``opsd.cpu.x`` read off a bound name (``import opsd``, ``from opsd import cpu``), lazy imports
    inside functions included."""
    found, bound = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("opsd.cpu."):
                    found.append(f"{node.lineno} import {a.name}")
                if a.name == "opsd" or a.name.startswith("opsd."):
                    bound[a.asname or "opsd"] = a.name if a.asname else "opsd"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("opsd.cpu."):
                found.append(f"{node.lineno} from {node.module} import ...")
            for a in node.names:
                if node.module == "opsd.cpu" and a.name in CPU_SUBMODULES:
                    found.append(f"{node.lineno} from opsd.cpu import {a.name}")
                if node.module == "opsd":
                    bound[a.asname or a.name] = f"opsd.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = _dotted(node, bound)
            if name and name.count(".") == 2 and name.startswith("opsd.cpu.") and node.attr in CPU_SUBMODULES:
                found.append(f"{node.lineno} {name}")
    return sorted(set(found), key=lambda s: (int(s.split()[0]), s))


def _plan_fields() -> set[str]:
    from dataclasses import fields

    from opsd.cpu import CpuPlan

    return {f.name for f in fields(CpuPlan)}


def plan_field_reads(source: str, names: set[str]) -> list[str]:
    """Each ``.name`` read in ``source`` whose name is one of CpuPlan's fields, as "line .name": the
    plan's fields are read inside ``opsd/cpu/`` alone; outside, a hook says what the plan means."""
    return [
        f"{node.lineno} .{node.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in names
    ]


def _outside_cpu() -> dict[str, str]:
    return {
        str(p.relative_to(PKG.parent)): p.read_text()
        for p in sorted(PKG.rglob("*.py"))
        if PKG / "cpu" not in p.parents
    }


def test_nothing_outside_the_cpu_room_imports_its_modules():
    """Code outside ``opsd/cpu/`` reaches the room through the package ``opsd.cpu`` alone: its plan,
    ``resolve_plan``, ``apply_plan``, ``default_plan`` and the entry points it exports (tests and the
    ``bench/cpu/`` probes, which measure one mechanism each, read the modules themselves)."""
    found = {path: hits for path, src in _outside_cpu().items() if (hits := cpu_submodule_uses(src))}
    assert found == {}, "import these from the package opsd.cpu (export them in opsd/cpu/__init__.py)"


def test_no_cpu_plan_field_is_read_outside_the_cpu_room():
    names = _plan_fields()
    assert {"pack_rows", "bucket_widths", "loss_slab_elements"} <= names
    found = {path: hits for path, src in _outside_cpu().items() if (hits := plan_field_reads(src, names))}
    assert found == {}, "read the plan through a hook (a CpuPlan method in opsd/cpu/__init__.py)"


def test_the_cpu_door_checks_find_each_spelling():
    src = "\n".join(
        [
            "import opsd.cpu.heap",
            "from opsd.cpu.kv import serve_flags",
            "from opsd.cpu import heap, CpuPlan, resolve_plan",
            "from opsd import cpu",
            "import opsd",
            "def f():",
            "    from opsd.cpu.packing import pack_rows",
            "    return cpu.heap.trim_heap(), opsd.cpu.layout, cpu.resolve_plan, cpu.CpuPlan",
            "from opsd.cpu import openmp_waiting",
            "import opsd.cpu as room",
            "room.budget",
        ]
    )
    assert cpu_submodule_uses(src) == [
        "1 import opsd.cpu.heap",
        "2 from opsd.cpu.kv import ...",
        "3 from opsd.cpu import heap",
        "7 from opsd.cpu.packing import ...",
        "8 opsd.cpu.heap",
        "8 opsd.cpu.layout",
        "11 opsd.cpu.budget",
    ]
    reads = "plan.bucket_widths\nself.plan.pack_from = 3\nparts.plan.row_widths()\ncfg.size\n"
    assert plan_field_reads(reads, {"bucket_widths", "pack_from"}) == ["1 .bucket_widths"]
