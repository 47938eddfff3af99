"""A run directory's records that the trainer writes and `opsd report` reads: the best checkpoint
(``RUN_DIR/checkpoints/best.json``) and the guards' stops (``RUN_DIR/guard.jsonl``), both from
:mod:`opsd.guard`. Light on purpose (no torch): :mod:`opsd.checkpoint`'s rotation and `opsd report`
read them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

BEST_FILE = "best.json"  # in RUN_DIR/checkpoints/
STOPS_FILE = "guard.jsonl"  # in RUN_DIR


def best_path(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints" / BEST_FILE


def read_best(run_dir: Path) -> dict | None:
    """The best checkpoint's record (step, metric, value, checkpoint), or None where there is none
    or it cannot be read."""
    try:
        rec = json.loads(best_path(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = {"step", "metric", "value", "checkpoint"}
    return rec if isinstance(rec, dict) and keys <= set(rec) else None


def best_checkpoint(run_dir: Path) -> Path | None:
    """The best checkpoint's directory, where it is recorded and still exists."""
    rec = read_best(run_dir)
    path = best_path(run_dir).parent / str(rec["checkpoint"]) if rec else None
    return path if path is not None and path.is_dir() else None


def write_best(run_dir: Path, step: int, metric: str, value: float, checkpoint: Path) -> None:
    """Name ``checkpoint`` (saved at ``step``, with ``metric`` = ``value``) the best, atomically."""
    path = best_path(run_dir)
    tmp = path.with_name(f".{BEST_FILE}.tmp")
    rec = {"step": int(step), "metric": metric, "value": float(value), "checkpoint": Path(checkpoint).name}
    tmp.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_stops(run_dir: Path) -> list[dict]:
    """Every guard stop recorded in ``RUN_DIR/guard.jsonl``, oldest first (unreadable lines skipped)."""
    return [rec for rec in jsonl(Path(run_dir) / STOPS_FILE) if "guard" in rec and "step" in rec]


def jsonl(path: Path) -> Iterator[dict]:
    """The records of a JSON-lines file that are objects with an integer ``step`` (nothing where the
    file is missing)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            yield rec
