"""Write one benchmark's results into docs/results.md without touching the others' sections."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

TITLE = "# Results"
ROOT = Path(__file__).resolve().parents[1]
# The 1-minute load when the benchmark began measuring: when it imported this module, or when
# `_common.wait_for_idle` last returned.
LOAD_AT_START = os.getloadavg()[0]
# The CPU flags that change the figures, as /proc/cpuinfo names them and as the sections write them.
FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX512", "avx2": "AVX2"}


@contextmanager
def _locked(path: Path):
    """Benchmarks may run concurrently; serialise the read-modify-write of the shared file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)  # lock the folder: leaves no lock file behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace the `## heading` section (up to the next `## `) or append it.

    Several benchmark scripts share one file, so each owns exactly one section.
    """
    path = Path(path)
    heading = heading.strip()
    if heading.startswith("## "):
        heading = heading[3:].strip()
    header_line = f"## {heading}"
    body = body.strip()
    if not body.startswith("Measured: "):
        body = f"{measured_line()}\n\n{body}"
    section = f"{header_line}\n\n{body}\n"

    with _locked(path):
        _write(path, header_line, section)


def _write(path: Path, header_line: str, section: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else f"{TITLE}\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.rstrip() == header_line), None)
    if start is None:
        out = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        before = "\n".join(lines[:start]).rstrip("\n")
        after = "\n".join(lines[end:]).strip("\n")
        out = (before + "\n\n" if before else "") + section + ("\n" + after + "\n" if after else "")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(out, encoding="utf-8")
    tmp.replace(path)


def measured_line() -> str:
    """The section's first line, which tests/meta/test_freshness.py reads: `Measured: commit C; date D; cpu
    FLAGS; load BEFORE -> AFTER`. C says "with uncommitted changes" where opsd/ differs from it."""
    commit = _git("rev-parse", "--short", "HEAD") or "not recorded"
    if commit != "not recorded" and _git("status", "--porcelain", "--", "opsd"):
        commit += " with uncommitted changes"
    date = time.strftime("%Y-%m-%d")
    load = f"{LOAD_AT_START:.2f} -> {os.getloadavg()[0]:.2f}"
    return f"Measured: commit {commit}; date {date}; cpu {cpu_flags()}; load {load}"


def cpu_flags() -> str:
    """The CPU's model and which of :data:`FLAGS` it has ("not recorded" where /proc/cpuinfo is not)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "not recorded"
    lines = info.splitlines()
    model = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "CPU")
    have = set(next((x.split(":", 1)[1].split() for x in lines if x.startswith("flags")), []))
    named = [name if flag in have else f"no {name}" for flag, name in FLAGS.items()]
    return f"{model} with {', '.join(named)}"


def _git(*args: str) -> str:
    """A git command's output in the repository, or "" where git or its history is not there."""
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
