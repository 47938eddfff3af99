"""Write one benchmark's results into docs/results.md without touching the others' sections."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

TITLE = "# Results"


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
    section = f"{header_line}\n\n{body.strip()}\n"

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
