"""Guards that stop a run going bad, and the record of its best checkpoint.

OPSD runs can degrade: responses collapse in length, most responses run into the token limit, or
held-out accuracy falls away from its best. :class:`StopRules` watches each step's record (the
``guard`` section of the config, every guard off by default) and, when one fires, stops the run as a
signal does: the step's checkpoint is saved, and rank 0 prints one line naming the guard, the step, the
measured value against its limit, the best checkpoint and the resume command (`opsd train` exits 0:
the stop is deliberate). Each stop is appended to ``RUN_DIR/guard.jsonl``.

With ``eval.every`` and ``checkpoint.keep_best``, :class:`BestCheckpoint` names the checkpoint saved
at the best held-out accuracy in ``RUN_DIR/checkpoints/best.json`` (``{"step", "metric", "value",
"checkpoint"}``), which the keep-last rotation (:func:`opsd.checkpoint.prune_checkpoints`) never
deletes. The trainer holds one of each.

The records themselves are read and written by :mod:`opsd.records` (light: `opsd report` reads them).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from tqdm.auto import tqdm

from opsd.checkpoint import latest_checkpoint, prune_checkpoints
from opsd.records import STOPS_FILE, best_checkpoint, best_path, jsonl, read_best, write_best
from opsd.rundir import StopReason


@dataclass(frozen=True)
class Fired:
    """A guard that fired: its config key, the step, the measured value, its limit, and in words what
    was measured."""

    guard: str
    step: int
    value: float
    limit: float
    detail: str

    @property
    def reason(self) -> StopReason:
        """The stop this guard asks for."""
        return StopReason("guard", self.guard.removeprefix("guard."))


class StopRules:
    """The guards of one run (:class:`opsd.config.GuardConfig`) over its step records: whether to stop,
    and the line that says why.

    ``metric``: the held-out accuracy key (``eval/avg@k``). Only rank 0 (``active``) decides and writes;
    other ranks learn of a stop through the trainer's stop collective.
    """

    def __init__(self, cfg, *, metric: str, run_dir: Path, active: bool = True) -> None:
        self.cfg = cfg
        self.metric = metric
        self.run_dir = Path(run_dir)
        self.active = active
        self.steps: list[int] = []  # steps with a training record, and their lengths and truncation
        self.lengths: list[float] = []
        self.truncated: list[float] = []
        self.accuracy: float | None = None  # the latest record's held-out accuracy, where it had one
        self.best: tuple[int, float] | None = None  # the best held-out accuracy so far: (step, value)
        self.fired: Fired | None = None

    @classmethod
    def for_run(cls, cfg, run_dir: Path, step: int, rank: int) -> StopRules:
        """The guards of a run at ``step``, their history read back from ``metrics.jsonl`` (rank 0; a
        resumed run's file holds exactly the steps up to its checkpoint)."""
        rules = cls(cfg.guard, metric=f"eval/avg@{cfg.eval.k}", run_dir=run_dir, active=rank == 0)
        if rank == 0:
            for rec in jsonl(Path(run_dir) / "metrics.jsonl"):
                if rec["step"] <= step:
                    rules.add(rec)
        return rules

    def add(self, rec: dict[str, Any]) -> None:
        """Take one step's record into the history, without checking anything."""
        if "resp_len_mean" in rec and "truncated_frac" in rec:
            self.steps.append(int(rec["step"]))
            self.lengths.append(float(rec["resp_len_mean"]))
            self.truncated.append(float(rec["truncated_frac"]))
        acc = rec.get(self.metric)
        self.accuracy = float(acc) if isinstance(acc, (int, float)) else None
        if self.accuracy is not None and (self.best is None or self.accuracy > self.best[1]):
            self.best = (int(rec["step"]), self.accuracy)

    def observe(self, rec: dict[str, Any]) -> Fired | None:
        """Take the step's record and check every guard that is on; the first that fires (accuracy,
        length, truncation) is returned and kept in ``fired``. Ranks other than 0 never fire."""
        if not self.active:
            return None
        self.add(rec)
        self.fired = self.check(int(rec["step"]))
        return self.fired

    def check(self, step: int) -> Fired | None:
        """The first guard that fires on the history up to ``step``: accuracy against its best, the
        trailing mean length against the first ``window`` steps', the trailing truncation rate."""
        c, w = self.cfg, self.cfg.window
        if c.max_accuracy_drop is not None and self.accuracy is not None and self.best is not None:
            drop = self.best[1] - self.accuracy
            if drop > c.max_accuracy_drop:
                return Fired(
                    "guard.max_accuracy_drop",
                    step,
                    drop,
                    c.max_accuracy_drop,
                    f"{self.metric} {self.accuracy:.3f} is {drop:.3f} below its best {self.best[1]:.3f} "
                    f"(step {self.best[0]}), more than the limit {c.max_accuracy_drop:g}",
                )
        if len(self.steps) < w:
            return None
        base_end, recent_start = self.steps[w - 1], self.steps[-w]
        if c.min_length_ratio is not None:
            base, recent = fmean(self.lengths[:w]), fmean(self.lengths[-w:])
            ratio, limit = (recent / base if base > 0 else 1.0), c.min_length_ratio
            if ratio < limit:
                return Fired(
                    "guard.min_length_ratio",
                    step,
                    ratio,
                    limit,
                    f"mean response length {recent:.1f} over steps {recent_start}-{step} is {ratio:.3f} of "
                    f"its {base:.1f} over steps {self.steps[0]}-{base_end}, below the limit {limit:g}",
                )
        if c.max_truncation is not None:
            rate = fmean(self.truncated[-w:])
            if rate > c.max_truncation:
                return Fired(
                    "guard.max_truncation",
                    step,
                    rate,
                    c.max_truncation,
                    f"{rate:.3f} of the responses over steps {recent_start}-{step} were cut at "
                    f"rollout.max_new_tokens, above the limit {c.max_truncation:g}",
                )
        return None

    def stops(self, rec: dict[str, Any], stop) -> bool:
        """Whether this rank asks to stop after this step: a signal it received (``stop``, an
        :class:`opsd.rundir.GracefulStop`), or on rank 0 a guard that fired, which is named in
        ``stop.requested``."""
        fired = self.observe(rec)
        if fired is not None and stop.requested is None:
            stop.requested = fired.reason
        return stop.requested is not None

    def line(self) -> str:
        """The one line that says which guard stopped the run, where the best checkpoint is, and how to
        resume."""
        f = self.fired
        assert f is not None
        best, rec = best_checkpoint(self.run_dir), read_best(self.run_dir)
        latest = latest_checkpoint(self.run_dir)
        if best is not None and rec is not None:
            where = f"best checkpoint: {best} ({rec['metric']}={rec['value']:.3f} at step {rec['step']})"
        elif latest is not None:
            where = f"no best checkpoint recorded (eval.every at a saved step); latest: {latest}"
        else:
            where = "no checkpoint saved"
        resume = f"; resume with: opsd train --resume {self.run_dir}" if latest is not None else ""
        return f"{f.guard} stopped the run after step {f.step}: {f.detail}; {where}{resume}"

    def say_stopped(self, stop, step: int) -> None:
        """Rank 0 says what stopped the run: the guard's one line (also appended to guard.jsonl), or
        the signal's message (:meth:`opsd.rundir.GracefulStop.say_stopped`)."""
        if not self.active:
            return
        if self.fired is None or stop.requested != self.fired.reason:  # a signal came first
            stop.say_stopped(step, self.run_dir)
            return
        line = self.line()
        with (self.run_dir / STOPS_FILE).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(self.fired) | {"line": line}) + "\n")
        tqdm.write(line, file=sys.stderr)


class BestCheckpoint:
    """The checkpoint saved at the best held-out accuracy, named in ``checkpoints/best.json`` so the
    keep-last rotation never deletes it (``checkpoint.keep_best`` with ``eval.every``).

    ``metric``: the held-out accuracy key (``eval/avg@k``). Only rank 0 (``active``) writes.
    """

    def __init__(
        self, *, metric: str, run_dir: Path, keep_best: bool, keep_last: int, active: bool = True
    ) -> None:
        self.metric = metric
        self.run_dir = Path(run_dir)
        self.keep_best = keep_best
        self.keep_last = keep_last
        self.active = active

    @classmethod
    def for_run(cls, cfg, run_dir: Path, rank: int) -> BestCheckpoint:
        """The keeper of a run's best checkpoint; without ``checkpoint.keep_best`` an earlier record is
        removed (rank 0), since the next rotation may delete the checkpoint it names."""
        keeper = cls(
            metric=f"eval/avg@{cfg.eval.k}",
            run_dir=run_dir,
            keep_best=cfg.checkpoint.keep_best and cfg.eval.every > 0,
            keep_last=cfg.checkpoint.keep_last,
            active=rank == 0,
        )
        if rank == 0 and not cfg.checkpoint.keep_best:
            best_path(run_dir).unlink(missing_ok=True)
        return keeper

    def saved(self, checkpoint: Path, rec: dict[str, Any]) -> None:
        """After a checkpoint was saved at ``rec``'s step (rank 0): with ``keep_best`` and a held-out
        accuracy at this step above the recorded best, name it the best, and prune the older one."""
        acc = rec.get(self.metric)
        if not (self.active and self.keep_best and isinstance(acc, (int, float))):
            return
        best = read_best(self.run_dir)
        standing = best is not None and best["metric"] == self.metric and best_checkpoint(self.run_dir)
        if standing and float(acc) <= float(best["value"]):
            return
        write_best(self.run_dir, int(rec["step"]), self.metric, float(acc), checkpoint)
        prune_checkpoints(self.run_dir, self.keep_last)
