"""Processes as the tests see them through /proc (Linux): which descendants a process has, and
whether they have ended. Shared by tests/rollout/test_procs.py and tests/rollout/test_vllm_serve.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """A process that runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def gone(*pids: int, limit_s: float = 60.0) -> bool:
    """Whether every one of ``pids`` has ended; a SIGKILL takes effect when the kernel next schedules
    its target, so this looks until ``limit_s`` has passed (a guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` in the process tree, now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_for_file(path: Path, proc: subprocess.Popen, limit_s: float = 120.0) -> str:
    """The file's text once it exists; fails if ``proc`` ends first or ``limit_s`` passes (a guard
    against a hung test, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode} before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {limit_s} s"
        time.sleep(0.1)
    return path.read_text()
