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
