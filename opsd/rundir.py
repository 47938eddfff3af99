"""The run directory: created, refused, overwritten or resumed, and what it records of the config.

A run directory holds ``config.yaml`` (the effective config of the latest start or resume),
``config_history.jsonl`` (one line per start or resume, with the overrides that changed it),
``metrics.jsonl``, ``samples.jsonl``, ``data_report.json`` and ``checkpoints/``.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from opsd.errors import UserError


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, has_checkpoint: bool) -> None:
    """Refuse to clobber a run by accident; ``--resume`` of a run without a complete checkpoint
    (e.g. killed during its first save) starts it again from step 0 rather than refusing."""
    if resume and overwrite:
        raise UserError("choose one of --resume and --overwrite")
    exists = run_dir.exists() and any(run_dir.iterdir())
    if resume and not (run_dir / "config.yaml").is_file() and not has_checkpoint:
        raise UserError(
            f"--resume {run_dir}: not an opsd run directory (no config.yaml, no checkpoint); "
            f"start it with `opsd train --config ... logging.run_dir={run_dir}`"
        )
    if resume and not has_checkpoint:
        print(f"{run_dir}: no complete checkpoint yet; starting this run again from step 0", file=sys.stderr)
    if exists and not resume:
        if not overwrite:
            raise UserError(
                f"run directory {run_dir} already exists: pass --resume {run_dir} to continue it, "
                "or --overwrite to delete it and start over"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def record_config(run_dir: Path, config: dict, *, resume: bool) -> None:
    """Write the effective config to ``config.yaml`` (so a later plain ``--resume`` keeps any
    overrides given now) and append what changed to ``config_history.jsonl``."""
    path = run_dir / "config.yaml"
    old = yaml.safe_load(path.read_text()) if resume and path.is_file() else None
    changes = _diff(old, config) if old is not None else {}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "event": "resume" if resume else "start",
        "changes": changes,
    }
    with (run_dir / "config_history.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")
    if changes:
        print(
            "config changed on resume: " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()),
            file=sys.stderr,
        )


def _diff(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_diff(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = (a, b)
    return out


@dataclass(frozen=True)
class StopReason:
    """Why a run stops before its last step, as a value callers compare instead of text they parse.

    ``kind``: ``signal`` (one this rank received; ``key`` is its name, ``SIGTERM``), ``peer`` (another
    rank asked: a signal there, or a guard on rank 0), ``guard`` (``key`` is the guard's config key
    without its section, ``max_truncation``). ``str()`` gives the words the messages print."""

    kind: Literal["signal", "peer", "guard"]
    key: str = ""

    def __str__(self) -> str:
        if self.kind == "guard":
            return f"guard.{self.key}"
        if self.kind == "peer":
            return "a signal to another rank"
        return self.key


class GracefulStop:
    """Ctrl-C / SIGTERM set ``requested`` (the loop finishes its step, saves and exits); a second
    signal aborts. Handlers are installed on ``__enter__`` (main thread only) and restored on exit."""

    def __init__(self) -> None:
        self.requested: StopReason | None = None
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = StopReason("signal", signal.Signals(signum).name)
        print(
            f"\n{self.requested}: finishing the current step, then saving a checkpoint "
            "(signal again to abort without saving)",
            file=sys.stderr,
        )

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)
        self._old.clear()

    def join_peers(self) -> None:
        """Some rank asked to stop after this step, so this one stops too: its own reason where it has
        one, else ``peer``."""
        if self.requested is None:
            self.requested = StopReason("peer")

    def say_stopped(self, step: int, run_dir: Path) -> None:
        """What stopped the run, after which step, and the command that resumes it."""
        print(
            f"\nstopped by {self.requested} after step {step}; resume with:\n  opsd train --resume {run_dir}",
            file=sys.stderr,
        )
