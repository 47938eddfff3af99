"""What a comparison writes and reads back: each evaluation point, each finished method, and the
progress lines in between."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class EvalPoint:
    step: int
    accuracy: float  # eval.grader (strict), mean over problems x eval.k samples
    generated_tokens: int  # rollout tokens sampled so far; 0 for SFT
    train_seconds: float  # training wall time so far, evaluations excluded
    divergence: float | None = None  # held-out divergence (eval.divergence)
    lenient: float | None = None  # eval.lenient_grader's accuracy; None without one
    problems: int = 0  # held-out problems evaluated (0: not recorded)
    resp_len: float | None = None  # mean response tokens
    truncated: float | None = None  # share of responses cut at eval.max_new_tokens
    repetition: float | None = None  # mean share of repeated word 4-grams (:func:`opsd.metrics.repetition`)
    teacher_tokens: int = 0  # response tokens the teacher scored so far; 0 for GRPO and SFT
    correct: list[float] | None = None  # per held-out problem, its share of correct samples (paired tests)
    sets: dict[str, dict] | None = None  # eval.sets, where evaluated: at the base and each new best
    artifacts: float | None = None  # eval.artifacts' share of the held-out responses


@dataclass
class MethodRun:
    method: str
    seed: int
    points: list[EvalPoint] = field(default_factory=list)
    lr: float = 0.0
    finished: bool = False
    stopped_by: str | None = None  # the guard that ended it early (config.guard), and the step

    @property
    def final(self) -> EvalPoint:
        return self.points[-1]


def write_points(path: Path, points: list[EvalPoint]) -> None:
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in points))


def read_points(path: Path) -> list[EvalPoint]:
    if not path.is_file():
        return []
    return [EvalPoint(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def read_run(path: Path) -> MethodRun:
    d = json.loads(path.read_text())
    points = [EvalPoint(**p) for p in d.pop("points")]
    return MethodRun(points=points, **d)


def point_text(p: EvalPoint) -> str:
    div = f", held-out divergence {p.divergence:.4f}" if p.divergence is not None else ""
    return f"held-out accuracy {100 * p.accuracy:.1f}%{div}"
