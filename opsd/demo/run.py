"""`opsd demo`: prepare one seed (base model, data, accuracies before), run OPSD with held-out
evaluations in between, and report. The evaluation is `opsd eval`'s loop with the task's grader; the
plot is `opsd report`'s. See docs/demo.md for the task, the choices and the numbers.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from opsd.demo import task
from opsd.demo.base import DemoSettings, build_base_model, prompt_ids
from opsd.errors import UserError
from opsd.fetch import opsd_home

# `opsd demo --compare`'s steps per method: the demo's own.
COMPARE_STEPS = DemoSettings.opsd_steps


def heldout_accuracy(model: Any, tok: Any, rows: list[dict], digits: int, *, with_solution: bool) -> float:
    """Greedy exact-match accuracy, through `opsd eval`'s loop with the HF engine and the chat template
    training uses. ``with_solution``: the teacher's prompt (problem + worked solution) instead."""
    from opsd.data import Example
    from opsd.eval import evaluate_model

    res = evaluate_model(
        model,
        tok,
        [Example(r["problem"], r["solution"], r["answer"], i) for i, r in enumerate(rows)],
        prompts=[prompt_ids(tok, r, with_solution=with_solution) for r in rows],
        grader=task.grade,
        k=1,
        temperature=0.0,
        top_p=1.0,
        max_new_tokens=task.max_response_tokens(digits),
        seed=0,
        batch_size=512,
        name="teacher" if with_solution else "student",
    )
    return res.avg_at_k


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{time.time_ns()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)


@dataclass
class Prepared:
    """What every run on one seed shares: the base model, the data files and the starting accuracies."""

    base: Path
    data_dir: Path  # train.jsonl (OPSD's problems) and heldout.jsonl
    train: list[dict]
    heldout: list[dict]
    student_before: float  # problem only
    teacher_with_solution: float  # the base model with the worked solution in its context
    seconds_base_model: float


def prepare(s: DemoSettings, cache: Path, progress: bool) -> Prepared:
    """Build (or reuse) the base model, write the data files, measure the base model on the held-out set."""
    from opsd.models import load_model, load_tokenizer

    t0 = time.time()
    base = build_base_model(s, cache=cache, progress=progress)
    t_base = time.time() - t0
    split = task.make_splits(s.seed, s.digits, s.n_sft, s.n_train, s.n_heldout)
    data_dir = cache / f"data-{s.base_key()}"
    for name in ("train", "heldout"):
        if not (data_dir / f"{name}.jsonl").is_file():
            _write_jsonl(data_dir / f"{name}.jsonl", split[name])
    heldout = split["heldout"]
    _say(progress, f"evaluating the base model on {len(heldout)} held-out problems")
    tok, model = load_tokenizer(str(base)), load_model(str(base))
    before = heldout_accuracy(model, tok, heldout, s.digits, with_solution=False)
    teacher = heldout_accuracy(model, tok, heldout, s.digits, with_solution=True)
    _say(
        progress, f"student {100 * before:.1f}% (problem only), teacher {100 * teacher:.1f}% (with solution)"
    )
    return Prepared(base, data_dir, split["train"], heldout, before, teacher, t_base)


def train_overrides(
    s: DemoSettings, base: Path, train_path: Path, run_dir: Path, *, control: bool, progress: bool
) -> list[str]:
    """The `opsd train` configuration of the demo, as the same dotted overrides the CLI takes."""
    return [
        f"seed={s.seed}",
        "device=cpu",
        f"model.path={base}",
        "model.lora.enabled=false",
        # not `auto`: that computes in bfloat16 on CPUs with AMX/AVX512-BF16 and in float32 elsewhere,
        # so the same demo would train differently by CPU
        "model.dtype=float32",
        f"data.path={train_path}",
        "data.instruction=",
        f"data.teacher_template={json.dumps(task.TEACHER_TEMPLATE)}",
        "data.max_prompt_len=64",
        "data.max_teacher_prompt_len=160",
        f"rollout.prompts_per_step={s.prompts_per_step}",
        "rollout.n=1",
        "rollout.engine=hf",  # a character-level model of 0.36M parameters: HF generate is enough
        f"rollout.temperature={s.temperature}",
        f"rollout.max_new_tokens={task.max_response_tokens(s.digits)}",
        "rollout.batch_size=256",
        "loss.mode=jsd",
        "loss.beta=0",
        "loss.clip_mode=none",
        "teacher.mode=fixed",
        f"teacher.privileged={'false' if control else 'true'}",
        f"optim.lr={s.opsd_lr}",
        "optim.grad_clip=1.0",
        f"optim.max_steps={s.opsd_steps}",
        f"optim.warmup_steps={s.opsd_warmup}",
        "optim.scheduler=cosine",
        "checkpoint.every=0",
        "checkpoint.keep_last=1",
        f"logging.run_dir={run_dir}",
        "logging.sample_every=25",
        f"logging.progress={'true' if progress else 'false'}",
        "logging.step_lines=false",  # the demo prints a line per held-out evaluation, not per step
    ]


@dataclass
class EvalPoint:
    """One held-out evaluation during training, with what training had spent to get there."""

    step: int
    accuracy: float
    generated_tokens: int  # rollout tokens sampled so far (stop tokens included); 0 for SFT
    train_seconds: float  # training wall time so far, the evaluations excluded


def generated_tokens(rec: dict, responses_per_step: int) -> int:
    """Rollout tokens one step sampled: its mean response length times its number of responses."""
    return round(rec["resp_len_mean"] * responses_per_step)


def train_with_evals(
    trainer: Any, tok: Any, p: Prepared, s: DemoSettings, run_dir: Path, progress: bool, label: str = "OPSD"
) -> list[EvalPoint]:
    """Train to ``s.opsd_steps``, scoring the held-out set every ``s.eval_every`` steps into eval.jsonl.

    Any Trainer (OPSD, its controls, GRPO). Returns the evaluations, starting at step 0 with the base
    model's accuracy.
    """
    points = [EvalPoint(0, p.student_before, 0, 0.0)]
    per_step = trainer.cfg.rollout.prompts_per_step * trainer.cfg.rollout.n
    with (run_dir / "eval.jsonl").open("w") as f:  # opsd report reads it: "accuracy" -> eval/accuracy
        f.write(json.dumps(asdict(points[0])) + "\n")
    tokens, seconds = 0, 0.0
    while trainer.step_num < s.opsd_steps:
        until = min(s.opsd_steps, trainer.step_num + s.eval_every)
        t0 = time.time()
        history = trainer.train(until_step=until)
        seconds += time.time() - t0
        if trainer.step_num < until:  # Ctrl-C / SIGTERM: the trainer saved a checkpoint and returned early
            raise KeyboardInterrupt(f"stopped after {label} step {trainer.step_num}; checkpoint in {run_dir}")
        tokens += sum(generated_tokens(rec, per_step) for rec in history)
        acc = heldout_accuracy(trainer.model, tok, p.heldout, s.digits, with_solution=False)
        points.append(EvalPoint(trainer.step_num, acc, tokens, seconds))
        with (run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps(asdict(points[-1])) + "\n")
        _say(progress, f"{label} step {trainer.step_num}: held-out accuracy {100 * acc:.1f}%")
    return points


def _check_run_dir(run_dir: Path) -> None:
    """Only a previous demo run is overwritten; anything else in the way is refused."""
    if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / "demo.json").is_file():
        raise UserError(f"{run_dir} exists and is not an `opsd demo` run directory; pass another --run-dir")


def run_opsd(
    s: DemoSettings,
    run_dir: Path,
    *,
    control: bool = False,
    progress: bool = True,
    cache: Path | None = None,
    plot: bool = True,
    threads: int | None = 1,
) -> dict:
    """The whole demo for one seed; returns before/after accuracies, the curve and timings.

    ``control``: the teacher gets no privileged information. ``threads``: torch CPU threads while it
    runs (restored after). One is the default because the model is too small to gain from more, while a
    second thread competing with any other busy process made steps 8-40x slower on a 2-core machine;
    it also keeps the numbers reproducible. None: leave as is.
    """
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_opsd(s, Path(run_dir), control=control, progress=progress, cache=cache, plot=plot)
    finally:
        torch.set_num_threads(prev)


def _run_opsd(
    s: DemoSettings, run_dir: Path, *, control: bool, progress: bool, cache: Path | None, plot: bool
) -> dict:
    from opsd.config import load_config
    from opsd.models import load_tokenizer
    from opsd.trainer import Trainer

    t0 = time.time()
    _check_run_dir(run_dir)
    p = prepare(s, Path(cache or opsd_home() / "demo"), progress)
    overrides = train_overrides(
        s, p.base, p.data_dir / "train.jsonl", run_dir, control=control, progress=progress
    )
    trainer = Trainer(load_config(None, overrides), overwrite=True)
    try:
        (run_dir / "demo.json").write_text(json.dumps({"settings": asdict(s), "control": control}, indent=2))
        points = train_with_evals(trainer, load_tokenizer(str(p.base)), p, s, run_dir, progress)
    finally:
        trainer.close()
    curve = [(e.step, e.accuracy) for e in points]
    before, after, teacher = p.student_before, curve[-1][1], p.teacher_with_solution
    result = {
        "seed": s.seed,
        "control": control,
        "student_before": before,
        "student_after": after,
        "teacher_with_solution": teacher,
        "gain": after - before,
        "gap_closed": (after - before) / (teacher - before) if teacher > before else float("nan"),
        "curve": curve,
        "generated_tokens": points[-1].generated_tokens,
        "seconds": time.time() - t0,
        "seconds_base_model": p.seconds_base_model,
        "run_dir": str(run_dir),
        "base_model": str(p.base),
        "settings": asdict(s),
    }
    if plot:
        result["plot"] = str(plot_curve(run_dir, curve, control, teacher))
    (run_dir / "demo_result.json").write_text(json.dumps(result, indent=2))
    return result


def _say(progress: bool, msg: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"demo: {msg}", file=sys.stderr)


def plot_curve(
    run_dir: Path, curve: list[tuple[int, float]], control: bool, teacher_acc: float | None = None
) -> Path:
    """demo.png: held-out accuracy above, the per-token divergence the loss minimises below."""
    from opsd.report import Panel, load_run_metrics, plot_panels, series

    steps, divergence = series(load_run_metrics(run_dir).train, "divergence")
    accuracy = Panel(
        {"student, problem only": ([c[0] for c in curve], [100 * c[1] for c in curve])},
        ylabel="held-out accuracy (%)",
        ylim=(-2, 102),
        hlines={} if teacher_acc is None else {"teacher, with the worked solution": 100 * teacher_acc},
    )
    jsd = Panel(
        {"mean per-token JSD (beta=0: KL(teacher || student))": (steps, divergence)},
        ylabel="divergence",
        xlabel="OPSD step",
    )
    what = "WITHOUT the solution (control)" if control else "reads the worked solution"
    return plot_panels(run_dir / "demo.png", f"opsd demo: the teacher {what}", [accuracy, jsd])


# ----------------------------------------------------------------------------------------------
# `opsd demo`


def format_table(r: dict) -> str:
    """The before/after table `opsd demo` prints (markdown, so it pastes into issues and docs)."""
    steps = r["settings"]["opsd_steps"]
    lines = [
        "| held-out accuracy (greedy, exact final answer) | |",
        "|---|---|",
        f"| student before OPSD (problem only) | {100 * r['student_before']:.1f}% |",
        f"| student after {steps} OPSD steps (problem only) | {100 * r['student_after']:.1f}% |",
        "| teacher: base model with the worked solution in context (the ceiling) "
        f"| {100 * r['teacher_with_solution']:.1f}% |",
    ]
    gap = r["gap_closed"]
    lines.append(
        f"\ngain {100 * r['gain']:+.1f} points; closes {100 * gap:.0f}% of the student-teacher gap"
        if not math.isnan(gap)
        else f"\ngain {100 * r['gain']:+.1f} points"
    )
    return "\n".join(lines)
