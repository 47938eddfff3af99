"""`opsd demo`: prepare one seed (base model, data, accuracies before), run OPSD with held-out
evaluations in between, and report. The evaluation is `opsd eval`'s loop with the task's grader; the
plot is `opsd report`'s. See docs/demo.md for the task, the choices and the numbers.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from opsd.demo import task
from opsd.demo.base import DemoSettings, build_base_model, prompt_ids
from opsd.errors import UserError
from opsd.fetch import opsd_home
from opsd.metrics import say

# `opsd demo --compare`'s steps per method: the demo's own.
COMPARE_STEPS = DemoSettings.opsd_steps


def demo_accuracy(model: Any, tok: Any, rows: list[dict], digits: int, *, with_solution: bool) -> float:
    """Greedy exact-match accuracy, through `opsd eval`'s loop with the HF engine and the chat template
    training uses. ``with_solution``: the teacher's prompt (problem + worked solution) instead."""
    from opsd.config import EvalConfig
    from opsd.data import Example
    from opsd.eval import EvalRun, evaluate_model

    examples = [Example(r["problem"], r["solution"], r["answer"], i) for i, r in enumerate(rows)]
    e = EvalConfig(k=1, temperature=0.0, top_p=1.0, max_new_tokens=task.max_response_tokens(digits))
    prompts = [prompt_ids(tok, r, with_solution=with_solution) for r in rows]
    name = "teacher" if with_solution else "student"
    run = EvalRun(grader=task.grade_digits, seed=0, batch_size=512, prompts=prompts, name=name)
    res = evaluate_model(model, tok, examples, e, run=run)
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
    say(progress, f"demo: evaluating the base model on {len(heldout)} held-out problems")
    tok, model = load_tokenizer(str(base)), load_model(str(base))
    before = demo_accuracy(model, tok, heldout, s.digits, with_solution=False)
    teacher = demo_accuracy(model, tok, heldout, s.digits, with_solution=True)
    read = f"student {100 * before:.1f}% (problem only), teacher {100 * teacher:.1f}% (with solution)"
    say(progress, f"demo: {read}")
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


def heldout_overrides(s: DemoSettings, p: Prepared, progress: bool, *, control: bool = False) -> list[str]:
    """The demo's `opsd train` configuration for one seed with its held-out set and grader: what the
    demo and every method of `opsd demo --compare` train and evaluate from."""
    train = p.data_dir / "train.jsonl"
    return [
        *train_overrides(s, p.base, train, p.data_dir, control=control, progress=progress),
        "grpo.grader=opsd.demo.task:grade_digits",
        f"eval.path={p.data_dir / 'heldout.jsonl'}",
        "eval.grader=opsd.demo.task:grade_digits",
        "eval.k=1",
        "eval.temperature=0",
        f"eval.max_new_tokens={task.max_response_tokens(s.digits)}",
        "eval.divergence=true",
        "rollout.batch_size=512",
    ]


def _check_run_dir(run_dir: Path) -> None:
    """Only a previous demo run is overwritten (finished: demo.json; cut short: the evaluations its
    loop writes first); anything else in the way is refused."""
    ours = (run_dir / "demo.json").is_file() or (run_dir / "compare_eval.jsonl").is_file()
    if run_dir.exists() and any(run_dir.iterdir()) and not ours:
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
    """Train with `opsd compare`'s loop (:func:`opsd.compare.run_trainer_method`): the Trainer on the
    demo's overrides, evaluated on the held-out set every ``s.eval_every`` steps. A run cut short
    resumes from its last checkpoint; a finished one starts afresh."""
    from opsd.checkpoint import latest_checkpoint
    from opsd.compare import Budget, EvalPoint, MethodJob, run_trainer_method

    t0 = time.time()
    _check_run_dir(run_dir)
    p = prepare(s, Path(cache or opsd_home() / "demo"), progress)
    if (run_dir / "demo.json").is_file() or latest_checkpoint(run_dir) is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*heldout_overrides(s, p, progress, control=control), "eval.divergence=false"]
    budget = Budget(s.opsd_steps, s.prompts_per_step, s.eval_every)
    start = EvalPoint(0, p.student_before, 0, 0.0)  # prepare() measured it: not evaluated again
    method = "control" if control else "opsd"
    run = run_trainer_method(MethodJob(method, s.seed, None, overrides, run_dir), budget, start, progress)
    (run_dir / "demo.json").write_text(json.dumps({"settings": asdict(s), "control": control}, indent=2))
    # `opsd report` reads eval.jsonl: "accuracy" -> eval/accuracy
    keys = ("step", "accuracy", "generated_tokens", "train_seconds")
    evals = [{k: getattr(e, k) for k in keys} for e in run.points]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    curve = [(e.step, e.accuracy) for e in run.points]
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
        "generated_tokens": run.final.generated_tokens,
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


def format_before_after(r: dict) -> str:
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
