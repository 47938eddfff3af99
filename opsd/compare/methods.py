"""One method on one seed: a trainer method (OPSD, GRPO, mixed, a control) or SFT, each evaluated
at the budget's evaluation points, and the teacher's ceiling."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from opsd.compare.plan import Budget
from opsd.compare.records import EvalPoint, MethodRun, _point_text, _read_points, _say, _write_points
from opsd.errors import UserError
from opsd.metrics import mean, repetition


def _arm_config(config: Path | None, overrides: list[str], extra: list[str]):
    from opsd.config import load_config

    return load_config(config, [*overrides, *extra])


def run_trainer_method(
    method: str,
    seed: int,
    config: Path | None,
    overrides: list[str],
    extra: list[str],
    run_dir: Path,
    budget: Budget,
    base: EvalPoint | None,
    progress: bool,
    ceiling: Path | None = None,
) -> MethodRun:
    """OPSD, GRPO, mixed or a control: the Trainer with the method's overrides, evaluated every
    ``budget.eval_every`` steps; resumes from the last checkpoint when the run directory has one."""
    from opsd.checkpoint import latest_checkpoint
    from opsd.trainer import Trainer

    common = [
        f"seed={seed}",
        f"logging.run_dir={run_dir}",
        f"optim.max_steps={budget.steps}",
        "eval.every=0",  # evaluated here, between train() calls
        "checkpoint.enabled=true",
        f"checkpoint.every={budget.eval_every}",
        "checkpoint.keep_last=1",
        f"logging.progress={str(progress).lower()}",
        "logging.step_lines=false",
    ]
    cfg = _arm_config(config, overrides, [*extra, *common])
    log = run_dir / "compare_eval.jsonl"
    # Resume only what has its base evaluation; anything else in the run directory starts over.
    resume = latest_checkpoint(run_dir) is not None and bool(_read_points(log))
    trainer = Trainer(cfg, resume=resume, overwrite=not resume)
    trainer.progress_desc = f"{method} seed {seed}"
    run = MethodRun(method, seed, lr=cfg.optim.lr)
    run.points = [p for p in _read_points(log) if p.step <= trainer.step_num] if resume else []
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
    try:
        if not run.points:
            run.points.append(base or _evaluate(trainer, 0, 0, 0.0))
            _write_points(log, run.points)
        if ceiling is not None and not ceiling.is_file():
            ceiling.write_text(json.dumps(teacher_ceiling(trainer), indent=2))
        while True:
            on_grid = trainer.step_num % budget.eval_every == 0 or trainer.step_num == budget.steps
            guarded = _guard_stop(trainer)
            if run.final.step < trainer.step_num and (on_grid or guarded):  # an evaluation is due
                tokens, seconds, scored = _spent(run_dir / "metrics.jsonl", per_step)
                scored = 0 if method == "grpo" else scored  # GRPO alone has no teacher
                run.points.append(_evaluate(trainer, trainer.step_num, tokens, seconds, scored))
                _write_points(log, run.points)
                _say(progress, f"seed {seed} {method} step {trainer.step_num}: {_point_text(run.final)}")
            if guarded:  # a guard (config.guard) ended the method: its last evaluation is at the stop
                run.stopped_by = f"{guarded} at step {trainer.step_num}"
                _say(True, f"seed {seed} {method}: {run.stopped_by}")
                break
            if trainer.step_num >= budget.steps:
                break
            # The next evaluation on the grid (a resume after a signal may stand between two).
            until = min(budget.steps, (trainer.step_num // budget.eval_every + 1) * budget.eval_every)
            trainer.train(until_step=until)
            if trainer.step_num < until and not _guard_stop(trainer):  # a signal: saved, returned
                raise UserError(
                    f"stopped {method} seed {seed} at step {trainer.step_num}; run the same command "
                    "again to resume"
                )
    finally:
        trainer.close()
    run.finished = True
    return run


def _guard_stop(trainer) -> str | None:
    """The guard that stopped the trainer's last ``train()`` (its config key), or None."""
    why = trainer.stop.requested
    return why if isinstance(why, str) and why.startswith("guard.") else None


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


def _evaluate(trainer, step: int, tokens: int, seconds: float, teacher_tokens: int = 0) -> EvalPoint:
    """The trainer's held-out evaluation (its grader, engine and settings), read response by response:
    the strict accuracy, the lenient one, length, truncation, repetition, and the held-out divergence."""
    from opsd.eval.heldout import heldout_accuracy

    e = trainer.cfg.eval
    parts = (trainer.model, trainer.tokenizer, trainer.eval_examples, trainer.cfg, trainer.engine)
    res = heldout_accuracy(*parts, trainer.eval_grader, trainer.rank, trainer.world)
    divergence = trainer.heldout_divergence()["divergence"] if e.divergence else None
    return EvalPoint(
        step,
        res.avg_at_k,
        tokens,
        seconds,
        divergence,
        lenient=_lenient(res.items, e.lenient_grader),
        problems=res.num_problems,
        resp_len=res.resp_len_mean,
        truncated=res.truncated_frac,
        # the share of repeated word 4-grams, a response too short for one counting as none repeated
        repetition=mean([repetition(r.split()) or 0.0 for it in res.items for r in it["responses"]]),
        teacher_tokens=teacher_tokens,
        correct=[sum(it["correct"]) / len(it["correct"]) for it in res.items],
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


def teacher_ceiling(trainer) -> dict:
    """The base model's held-out accuracy with each problem's worked solution in its prompt (the
    teacher's prompt, eval.grader and eval.lenient_grader): what the teacher itself gets right, the
    ceiling of what it can pass on. The held-out rows' data.solution_key holds their solutions."""
    from opsd.data import load_examples
    from opsd.data.sources import take_rows
    from opsd.eval import evaluate_model

    cfg, e = trainer.cfg, trainer.cfg.eval
    examples = trainer.eval_examples
    if not cfg.data.solution_key:
        return {"accuracy": None, "why": "no data.solution_key"}
    if not e.divergence:  # the trainer loaded the held-out rows without their solutions
        examples = load_examples(
            e.path,
            problem_key=cfg.data.problem_key,
            solution_key=cfg.data.solution_key,
            answer_key=e.answer_key,
            require_answer=True,
        ).examples
        examples = take_rows(examples, e.rows, "eval.rows", e.path)[: e.limit]
    if not all(ex.solution.strip() for ex in examples):
        return {"accuracy": None, "why": f"some held-out rows have an empty {cfg.data.solution_key!r}"}
    res = evaluate_model(
        trainer.model,
        trainer.tokenizer,
        examples,
        k=1,
        temperature=0.0,
        max_new_tokens=e.max_new_tokens,
        seed=cfg.seed,
        engine=trainer.engine,
        grader=trainer.eval_grader,
        prompts=[trainer.eval_prompts(i, ex)[1] for i, ex in enumerate(examples)],
        name="teacher",
    )
    trainer.engine.sleep()
    return {
        "accuracy": res.avg_at_k,
        "lenient": _lenient(res.items, e.lenient_grader),
        "problems": res.num_problems,
        "resp_len": res.resp_len_mean,
        "truncated": res.truncated_frac,
    }


def run_sft_method(
    seed: int,
    config: Path | None,
    overrides: list[str],
    run_dir: Path,
    budget: Budget,
    lr: float,
    base: EvalPoint | None,
    progress: bool,
    ceiling: Path | None = None,
) -> MethodRun:
    """`opsd sft`'s loop on the worked solutions of the training rows, ``responses_per_step`` rows a
    step, with the config's schedule, model, LoRA setting and dtype, evaluated like the trainer
    methods (the trainer's own evaluation, on a trainer that never steps). Unfinished, it reruns."""
    import torch

    from opsd.data.controls import boxed_target
    from opsd.sft import sft, sft_pairs_from_examples
    from opsd.trainer import Trainer

    common = [
        f"seed={seed}",
        f"logging.run_dir={run_dir}",
        "eval.every=0",
        "checkpoint.enabled=false",
        "logging.progress=false",
        "teacher.mode=live",  # SFT has no teacher: no frozen copy of the weights
        "teacher.path=null",
    ]
    cfg = _arm_config(config, overrides, common)
    # A Trainer that never steps holds the model, its precision, the held-out set and the evaluation
    # every other method uses: SFT trains its model in place, and it is scored the same way.
    trainer = Trainer(cfg, overwrite=True)
    run = MethodRun("sft", seed, lr=lr)
    o = cfg.optim
    pairs = sft_pairs_from_examples(
        trainer.tokenizer,
        # GSM8K's `#### N` ending in the student's answer format (\\boxed{N}), calculator notes removed
        [replace(ex, solution=boxed_target(ex.solution)) for ex in trainer.examples],
        instruction=cfg.data.instruction,
        enable_thinking=cfg.data.student_thinking,
        max_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
    )
    clock = {"train": 0.0, "since": time.time()}

    def evaluate(step: int, loss: float) -> None:
        if step % budget.eval_every and step != budget.steps:
            return
        clock["train"] += time.time() - clock["since"]
        trainer.engine.sync_weights(trainer.model)  # SFT trained the model in place; a vLLM engine copies
        run.points.append(_evaluate(trainer, step, 0, clock["train"]))
        _say(progress, f"seed {seed} sft step {step}: {_point_text(run.final)}")
        clock["since"] = time.time()

    try:
        run.points.append(base or _evaluate(trainer, 0, 0, 0.0))
        if ceiling is not None and not ceiling.is_file():
            ceiling.write_text(json.dumps(teacher_ceiling(trainer), indent=2))
        clock["since"] = time.time()  # training time: the base evaluation is not SFT's
        torch.manual_seed(seed)
        sft(
            trainer.model,
            pairs,
            steps=budget.steps,
            lr=lr,
            batch_size=budget.responses_per_step,
            seed=seed,
            pad_id=trainer.pad_id,
            warmup=o.warmup_steps,
            schedule=o.scheduler,
            min_lr_ratio=o.min_lr_ratio,
            grad_clip=o.grad_clip or float("inf"),
            weight_decay=o.weight_decay,
            progress=progress,
            desc=f"sft seed {seed}",
            callback=evaluate,
            autocast_dtype=trainer.precision.compute if trainer.precision.mixed else None,
        )
    finally:
        trainer.close()
    _write_points(run_dir / "compare_eval.jsonl", run.points)
    run.finished = True
    return run
