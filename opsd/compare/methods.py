"""One method on one seed (OPSD, GRPO, mixed, SFT or a control: each the Trainer with its objective),
evaluated at the budget's evaluation points, and the teacher's ceiling."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from opsd.compare.plan import Budget, MethodJob
from opsd.compare.records import EvalPoint, MethodRun, point_text, read_points, write_points
from opsd.errors import UserError
from opsd.metrics import mean, repetition, say
from opsd.rundir import StopReason


def arm_config(config: Path | None, overrides: list[str], extra: list[str]):
    from opsd.config import load_config

    return load_config(config, [*overrides, *extra])


def run_trainer_method(
    job: MethodJob,
    budget: Budget,
    base: EvalPoint | None,
    progress: bool,
    ceiling: Path | None = None,
) -> MethodRun:
    """OPSD, GRPO, mixed, SFT or a control: the Trainer with the method's overrides, evaluated every
    ``budget.eval_every`` steps; resumes from the last checkpoint when the run directory has one.
    ``base``: the seed's base evaluation when another method made it; ``ceiling``: where to write the
    teacher's ceiling (:func:`teacher_ceiling`) when it is not there yet."""
    from opsd.checkpoint import latest_checkpoint
    from opsd.trainer import Trainer

    common = [
        f"seed={job.seed}",
        f"logging.run_dir={job.run_dir}",
        f"optim.max_steps={budget.steps}",
        "eval.every=0",  # evaluated here, between train() calls
        "checkpoint.enabled=true",
        f"checkpoint.every={budget.eval_every}",
        "checkpoint.keep_last=1",
        f"logging.progress={str(progress).lower()}",
        "logging.step_lines=false",
    ]
    cfg = arm_config(job.config, job.overrides, common)
    log = job.run_dir / "compare_eval.jsonl"
    # Resume only what has its base evaluation; anything else in the run directory starts over.
    resume = latest_checkpoint(job.run_dir) is not None and bool(read_points(log))
    trainer = Trainer(cfg, resume=resume, overwrite=not resume)
    trainer.progress_desc = f"{job.method} seed {job.seed}"
    run = MethodRun(job.method, job.seed, lr=cfg.optim.lr)
    run.points = [p for p in read_points(log) if p.step <= trainer.step_num] if resume else []
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
    lenient = cfg.eval.lenient_grader
    try:
        if not run.points:
            run.points.append(base or _with_sets(trainer, _evaluate(trainer, lenient, 0, 0, 0.0), []))
            write_points(log, run.points)
        if ceiling is not None and not ceiling.is_file():
            ceiling.write_text(json.dumps(teacher_ceiling(trainer, cfg), indent=2))
        while True:
            on_grid = trainer.step_num % budget.eval_every == 0 or trainer.step_num == budget.steps
            guarded = _guard_stop(trainer)
            if run.final.step < trainer.step_num and (on_grid or guarded):  # an evaluation is due
                tokens, seconds, scored = _spent(job.run_dir / "metrics.jsonl", per_step)
                tokens = _sft_tokens(job.run_dir) if cfg.objective == "sft" else tokens  # SFT generates none
                scored = scored if cfg.reads_teacher() else 0  # GRPO alone and SFT have no teacher
                point = _evaluate(trainer, lenient, trainer.step_num, tokens, seconds, scored)
                run.points.append(_with_sets(trainer, point, run.points))
                write_points(log, run.points)
                say(
                    progress, f"seed {job.seed} {job.method} step {trainer.step_num}: {point_text(run.final)}"
                )
            if guarded:  # a guard (config.guard) ended the method: its last evaluation is at the stop
                run.stopped_by = f"{guarded} at step {trainer.step_num}"
                say(True, f"seed {job.seed} {job.method}: {run.stopped_by}")
                break
            if trainer.step_num >= budget.steps:
                break
            # The next evaluation on the grid (a resume after a signal may stand between two).
            until = min(budget.steps, (trainer.step_num // budget.eval_every + 1) * budget.eval_every)
            trainer.train(until_step=until)
            if trainer.step_num < until and not _guard_stop(trainer):  # a signal: saved, returned
                raise UserError(
                    f"stopped {job.method} seed {job.seed} at step {trainer.step_num}; run the same command "
                    "again to resume"
                )
    finally:
        trainer.close()
    run.finished = True
    return run


def _with_sets(trainer, point: EvalPoint, earlier: list[EvalPoint]) -> EvalPoint:
    """``point`` with every ``eval.sets`` entry evaluated where eval.path's accuracy is a new best (the
    base always): the figures at the step a run picks on eval.path, at no cost where it picks none."""
    if not trainer.run.eval_sets or any(p.accuracy >= point.accuracy for p in earlier):
        return point
    sets = {}
    for name, r in trainer.evaluate_sets().items():
        res = r.accuracy
        sets[name] = {
            "accuracy": res.avg_at_k,
            "problems": res.num_problems,
            "resp_len": res.resp_len_mean,
            "truncated": res.truncated_frac,
            "drift": r.drift,
            "seen": r.seen,
            "other": r.other,
            "artifacts": r.artifacts,
            "correct": [sum(it["correct"]) / len(it["correct"]) for it in res.items],
        }
    return replace(point, sets=sets)


def _sft_tokens(run_dir: Path) -> int:
    """What SFT generated: nothing on the data's targets, the initial model's answers for context
    distillation (``data.sft_targets: teacher``, generated once before its first step)."""
    path = run_dir / "sft_targets.jsonl"
    if not path.is_file():
        return 0
    return sum(len(json.loads(line)["token_ids"]) for line in path.read_text().splitlines() if line.strip())


def _guard_stop(trainer) -> StopReason | None:
    """The guard that stopped the trainer's last ``train()`` (``str()``: its config key), or None."""
    why = trainer.run.stop.requested
    return why if why is not None and why.kind == "guard" else None


def _spent(metrics_path: Path, responses_per_step: int) -> tuple[int, float, int]:
    """Generated tokens, training seconds and the tokens the loss scored (the teacher's, for a method
    with one) so far, from the run's own step records (a resumed run's records end at its checkpoint,
    so these count every step once)."""
    tokens, seconds, scored = 0, 0.0, 0
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if "time_step" in rec:
            # rollout.reuse counts what was generated, not what was trained on
            tokens += rec.get("rollout/generated_tokens", round(rec["resp_len_mean"] * responses_per_step))
            seconds += rec["time_step"]
            scored += int(rec.get("tokens", 0))
    return tokens, seconds, scored


def _evaluate(
    trainer, lenient: str | None, step: int, tokens: int, seconds: float, teacher_tokens: int = 0
) -> EvalPoint:
    """The trainer's held-out evaluation (its grader, engine and settings), read response by response:
    the strict accuracy, the lenient one (``lenient``: eval.lenient_grader), length, truncation,
    repetition, and the held-out divergence."""
    evaluation = trainer.evaluate(sets=False)  # the sets where the run improves: _with_sets
    res = evaluation.accuracy
    return EvalPoint(
        step,
        res.avg_at_k,
        tokens,
        seconds,
        evaluation.divergence,
        lenient=_lenient(res.items, lenient),
        problems=res.num_problems,
        resp_len=res.resp_len_mean,
        truncated=res.truncated_frac,
        # the share of repeated word 4-grams, a response too short for one counting as none repeated
        repetition=mean([repetition(r.split()) or 0.0 for it in res.items for r in it["responses"]]),
        teacher_tokens=teacher_tokens,
        correct=[sum(it["correct"]) / len(it["correct"]) for it in res.items],
        artifacts=evaluation.artifacts,
    )


def _lenient(items: list[dict], name: str | None) -> float | None:
    """The share of responses ``name`` (eval.lenient_grader) grades correct; None without one."""
    if not name:
        return None
    from opsd.grading import as_grade, resolve_grader

    grader = resolve_grader(name, "eval.lenient_grader")
    return mean([float(as_grade(grader(r, it["gold"])).correct) for it in items for r in it["responses"]])


def ceiling_context(cfg) -> list[str]:
    """The override that lets a vLLM engine hold the ceiling's prompts (a teacher prompt, solution
    included, plus a held-out answer), set alike for every method of a comparison; none where the
    config sets rollout.max_model_len itself."""
    if cfg.rollout.max_model_len is not None:
        return []
    prompt = max(cfg.data.max_prompt_len, cfg.data.max_teacher_prompt_len)
    return [f"rollout.max_model_len={prompt + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)}"]


def teacher_ceiling(trainer, cfg) -> dict:
    """The base model's held-out accuracy with each problem's worked solution in its prompt (the
    teacher's prompt, eval.grader and eval.lenient_grader): what the teacher itself gets right, the
    ceiling of what it can pass on. The held-out rows' data.solution_key holds their solutions."""
    from opsd.setup import load_heldout

    if not cfg.data.solution_key:
        return {"accuracy": None, "why": "no data.solution_key"}
    examples = load_heldout(cfg, solutions=True)
    if not all(ex.solution.strip() for ex in examples):
        return {"accuracy": None, "why": f"some held-out rows have an empty {cfg.data.solution_key!r}"}
    res = trainer.evaluate_with_solutions(examples)
    return {
        "accuracy": res.avg_at_k,
        "lenient": _lenient(res.items, cfg.eval.lenient_grader),
        "problems": res.num_problems,
        "resp_len": res.resp_len_mean,
        "truncated": res.truncated_frac,
    }
