"""`opsd compare`: the paper's comparison on the user's own model and data.

OPSD against GRPO, GRPO with a distillation term (``mixed``), SFT on the worked solutions and three
controls (A: no solution; B: another problem's; wrong-answer: its own with the final answer made
wrong), every method from the same config: the same model, training rows, held-out set
(``eval.path``), evaluation, schedule and budget. The budget is defined once (:class:`Budget`) and
printed: equal optimizer steps and equal responses per step (OPSD samples ``rollout.n`` responses to
each of ``rollout.prompts_per_step`` problems; GRPO and mixed sample ``grpo_n`` to each of fewer
problems; SFT trains on as many worked solutions a step, which count as its data).

Every trainer method is `opsd train`'s Trainer with a few overrides (:func:`method_overrides`), in a
run directory of its own (``OUT/seedS/METHOD``; `opsd report` works on each). The comparison resumes
where it stopped: a finished method is read back, not rerun; an unfinished one resumes from its last
checkpoint (written at every evaluation). GRPO's settings come from ``OUT/tune/grpo.json`` when
`opsd compare --tune grpo` has chosen them (by training reward on seeds that are not reported), and
from the config otherwise; GRPO + distillation's from ``OUT/tune/mixed.json`` (`--tune mixed`), and
GRPO's otherwise.

The report (compare.md, :func:`format_table`): per method and for the base model, strict accuracy
(eval.grader) with a 95% Wilson interval over the held-out problems, lenient accuracy
(eval.lenient_grader), mean response length, truncation, repetition (:func:`repetition_rate`),
held-out divergence and the cost of reaching its best evaluation; underneath, the teacher's ceiling
(:func:`teacher_ceiling`). SFT's targets are the worked solutions, a GSM8K ``#### N`` ending rewritten
as ``\\boxed{N}`` (:func:`opsd.data.controls.boxed_target`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from opsd.errors import UserError

METHODS: dict[str, str] = {
    "opsd": "OPSD",
    "grpo": "GRPO",
    "mixed": "GRPO + distillation",
    "sft": "SFT on the solutions",
    "control_a": "control A: teacher without the solution",
    "control_b": "control B: teacher with another problem's solution",
    "control_wrong": "wrong-answer control: teacher with its solution's final answer made wrong",
}
NOTES = {
    "control_a": "with teacher.mode=fixed its teacher is the initial student reading the same prompt: the "
    "divergence starts at zero and the gradient is rounding noise, which AdamW scales to full-size steps, so "
    "its row shows how far noise alone moves the student",
}
MARKER = "compare.json"  # only a directory holding it is written into again


@dataclass(frozen=True)
class Variant:
    """A method of :data:`METHODS` under a name of its own with some config keys changed
    (``--variant opsd_entry=opsd:loss.clip_mode=entry,loss.clip=0.05``): several settings of one method
    side by side at the same budget, on the same base evaluation."""

    name: str
    method: str
    overrides: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, sep, rest = text.partition("=")
        method, sep2, keys = rest.partition(":")
        overrides = tuple(k.strip() for k in keys.split(",") if k.strip())
        if not (sep and sep2 and name.strip() and overrides) or any("=" not in k for k in overrides):
            raise UserError(f"--variant {text!r}: expected NAME=METHOD:KEY=VALUE[,KEY=VALUE...]")
        if method not in METHODS:
            raise UserError(f"--variant {text!r}: unknown method {method!r}; choose from {list(METHODS)}")
        if name in METHODS:
            raise UserError(f"--variant {text!r}: {name!r} is a method's own name; choose another")
        return cls(name.strip(), method, overrides)

    def label(self) -> str:
        return f"{METHODS[self.method]} ({', '.join(self.overrides)})"


def label(result: dict, method: str) -> str:
    """A method's name in the report: its description, or a variant's method and keys."""
    variant = result.get("variants", {}).get(method)
    return (
        Variant(method, variant["method"], tuple(variant["overrides"])).label()
        if variant
        else METHODS[method]
    )


TUNED = ("grpo", "mixed")  # the methods `opsd compare --tune` chooses settings for


def tune_file(method: str) -> Path:
    """Where `opsd compare --tune METHOD` writes its choice, relative to the comparison's directory."""
    return Path("tune") / f"{method}.json"


@dataclass(frozen=True)
class Budget:
    """What every method gets: optimizer steps, responses (or worked solutions) per step, and the
    held-out evaluations in between."""

    steps: int
    responses_per_step: int
    eval_every: int

    def describe(self) -> str:
        return (
            f"equal budget: {self.steps} optimizer steps and {self.responses_per_step} responses per step "
            f"for every method (SFT: {self.responses_per_step} worked solutions per step, its data); "
            f"held-out evaluation every {self.eval_every} steps"
        )


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO's own choices within the budget: learning rate, sampling temperature, samples per
    problem (``n`` divides the responses per step), and std scaling of the advantages."""

    lr: float
    temperature: float
    n: int
    scale_rewards: bool

    def overrides(self, budget: Budget) -> list[str]:
        return [
            "objective=grpo",
            "grpo.distill_coef=0",
            f"optim.lr={self.lr}",
            f"rollout.temperature={self.temperature}",
            f"rollout.n={self.n}",
            f"rollout.prompts_per_step={budget.responses_per_step // self.n}",
            f"grpo.scale_rewards={str(self.scale_rewards).lower()}",
        ]


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
    repetition: float | None = None  # mean share of repeated word 4-grams (:func:`repetition_rate`)
    teacher_tokens: int = 0  # response tokens the teacher scored so far; 0 for GRPO and SFT
    correct: list[float] | None = None  # per held-out problem, its share of correct samples (paired tests)


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


def method_overrides(
    method: str, grpo: GRPOSettings, distill_coef: float, budget: Budget, mixed: GRPOSettings | None = None
) -> list[str]:
    """What a trainer method changes in the user's config. ``mixed``: GRPO + distillation's own
    settings (default GRPO's)."""
    if method == "opsd":
        return ["objective=opsd"]
    if method == "control_a":
        return ["objective=opsd", "teacher.privileged=false"]
    if method == "control_b":
        return ["objective=opsd", "teacher.solution_source=other"]
    if method == "control_wrong":
        return ["objective=opsd", "teacher.solution_source=wrong_answer"]
    if method == "grpo":
        return grpo.overrides(budget)
    if method == "mixed":
        return [*(mixed or grpo).overrides(budget), f"grpo.distill_coef={distill_coef}"]
    raise UserError(f"unknown method {method!r}; choose from {list(METHODS)}")


def default_grpo(cfg, budget: Budget, n: int) -> GRPOSettings:
    """GRPO's settings from the config, with ``n`` samples per problem."""
    check_group_size(n, budget)
    return GRPOSettings(cfg.optim.lr, cfg.rollout.temperature, n, cfg.grpo.scale_rewards)


def check_group_size(n: int, budget: Budget) -> None:
    r = budget.responses_per_step
    if n < 2 or r % n:
        raise UserError(
            f"--grpo-n {n}: GRPO needs at least 2 samples per problem, and a divisor of the {r} responses "
            "per step (rollout.prompts_per_step x rollout.n) so that every method samples as many"
        )


# ----------------------------------------------------------------------------------------------
# One method on one seed


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
            tokens += round(rec["resp_len_mean"] * responses_per_step)
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
        repetition=_mean([repetition_rate(r) for it in res.items for r in it["responses"]]),
        teacher_tokens=teacher_tokens,
        correct=[sum(it["correct"]) / len(it["correct"]) for it in res.items],
    )


def _lenient(items: list[dict], name: str | None) -> float | None:
    """The share of responses ``name`` (eval.lenient_grader) grades correct; None without one."""
    if not name:
        return None
    from opsd.grading import as_grade, resolve_grader

    grader = resolve_grader(name, "eval.lenient_grader")
    return _mean([float(as_grade(grader(r, it["gold"])).correct) for it in items for r in it["responses"]])


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def repetition_rate(text: str, n: int = 4) -> float:
    """The share of repeated word n-grams in one response: 1 - distinct / total (0 with fewer than n
    words). Over words, not token ids, so that every engine and tokenizer reads it alike; a response
    looping one phrase approaches 1."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


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


# ----------------------------------------------------------------------------------------------
# Every method on every seed


def run_compare(
    config: Path | None,
    overrides: list[str] | Callable[[int], list[str]],
    out: Path,
    *,
    methods: list[str],
    seeds: list[int],
    steps: int | None = None,
    eval_every: int | None = None,
    grpo_n: int = 8,
    grpo_lr: float | None = None,
    sft_lr: float | None = None,
    distill_coef: float | None = None,
    progress: bool = True,
    ceiling: bool = False,
    variants: list[Variant] = (),
) -> dict:
    """Every method on every seed into ``out``; writes compare.json, compare.md and compare.png.

    ``variants``: more methods, each a method of :data:`METHODS` with some keys changed (:class:`Variant`),
    named in ``methods`` like the others.

    ``ceiling``: also evaluate the base model once with each held-out problem's solution in its
    prompt (:func:`teacher_ceiling`, into ``OUT/ceiling.json``) before the first method trains.

    ``overrides``: dotted overrides on ``config``, or a function of the seed giving them (the demo's
    data and base model differ per seed). ``grpo_lr``: GRPO's learning rate when not tuned (default
    the config's)."""
    per_seed = overrides if callable(overrides) else (lambda seed: overrides)
    cfg = _arm_config(config, per_seed(seeds[0]), [])
    if not cfg.eval.path:
        raise UserError(
            "opsd compare needs eval.path: a held-out file with answers, the same for every method"
        )
    named = {v.name: v for v in variants}
    unknown = [m for m in methods if m not in METHODS and m not in named]
    if unknown:
        raise UserError(f"--methods: unknown {unknown}; choose from {list(METHODS)} or a --variant's name")
    steps = steps or cfg.optim.max_steps
    budget = Budget(steps, cfg.rollout.prompts_per_step * cfg.rollout.n, eval_every or max(1, steps // 4))
    out = Path(out)
    claim_dir(out)
    grpo, grpo_source = read_tuned(out, "grpo", budget)
    if grpo is None:
        grpo = default_grpo(cfg, budget, min(grpo_n, budget.responses_per_step))
        grpo = replace(grpo, lr=grpo_lr or grpo.lr)
        grpo_source = "from the config (run `opsd compare --tune grpo` to choose them)"
    mixed, mixed_source = read_tuned(out, "mixed", budget)
    if mixed is None:
        mixed = grpo
        mixed_source = "GRPO's (run `opsd compare --tune mixed` to choose its own)"
    coef = distill_coefficient(cfg, distill_coef)
    sft_lr = sft_lr or cfg.optim.lr
    _say(True, budget.describe())
    _say(True, f"GRPO settings {asdict(grpo)}, {grpo_source}")
    _say(True, f"mixed settings {asdict(mixed)}, {mixed_source}; with grpo.distill_coef={coef}")
    for m in methods:
        if m in NOTES:
            _say(True, f"{METHODS[m]}: {NOTES[m]}")
    runs: list[MethodRun] = []
    ceiling_path = out / "ceiling.json"
    context = ceiling_context(cfg) if ceiling else []
    for seed in seeds:
        base = None
        overrides = [*per_seed(seed), *context]
        for method in methods:
            run_dir = out / f"seed{seed}" / method
            done = run_dir / "compare_method.json"
            want = ceiling_path if ceiling and not ceiling_path.is_file() else None
            kind, keys = (
                (named[method].method, list(named[method].overrides)) if method in named else (method, [])
            )
            if done.is_file():  # finished earlier: read back, not rerun
                run = _read_run(done)
            elif kind == "sft":
                over = [*overrides, *keys]
                run = run_sft_method(seed, config, over, run_dir, budget, sft_lr, base, progress, want)
                run.method = method
            else:
                extra = [*method_overrides(kind, grpo, coef, budget, mixed), *keys]
                run = run_trainer_method(
                    method, seed, config, overrides, extra, run_dir, budget, base, progress, want
                )
            done.write_text(json.dumps(asdict(run), indent=2))
            base = base or run.points[0]  # every method of a seed starts from one base evaluation
            runs.append(run)
    result = {
        "budget": asdict(budget),
        "grpo": asdict(grpo),
        "grpo_source": grpo_source,
        "mixed": asdict(mixed),
        "mixed_source": mixed_source,
        "distill_coef": coef,
        "lr": {"opsd": cfg.optim.lr, "sft": sft_lr, "grpo": grpo.lr, "mixed": mixed.lr},
        "methods": methods,
        "variants": {v.name: {"method": v.method, "overrides": list(v.overrides)} for v in variants},
        "seeds": seeds,
        "runs": [asdict(r) for r in runs],
        "ceiling": json.loads(ceiling_path.read_text()) if ceiling_path.is_file() else None,
    }
    (out / MARKER).write_text(json.dumps(result, indent=2))
    table = format_table(result)
    (out / "compare.md").write_text(table + "\n")
    result["plot"] = str(plot_compare(out / "compare.png", result))
    print(table)
    return result


def distill_coefficient(cfg, given: float | None) -> float:
    """GRPO + distillation's grpo.distill_coef: ``given`` (--distill-coef), else the config's, else 1."""
    return given if given is not None else (cfg.grpo.distill_coef or 1.0)


def no_signal(results: list[dict]) -> bool:
    """Every tuning setting saw only flat groups: the reward never told one response from another."""
    return all(r["flat_group_frac"] >= 1 for r in results)


def read_tuned(out: Path, method: str, budget: Budget) -> tuple[GRPOSettings | None, str]:
    """The settings `opsd compare --tune METHOD` chose into ``out``, and where they came from."""
    tuned = out / tune_file(method)
    if not tuned.is_file():
        return None, ""
    tune = json.loads(tuned.read_text())
    chosen = GRPOSettings(**tune["chosen"])
    check_group_size(chosen.n, budget)
    verdict = "" if tune["improves_on_first_step"] else "; no setting raised its training reward"
    if no_signal(tune["results"]):
        verdict += (
            "; every group's reward was flat at every setting (no signal): the tie went to the lowest lr"
        )
    return chosen, f"chosen by `opsd compare --tune {method}` on seeds {tune['seeds']} ({tuned}){verdict}"


def claim_dir(out: Path) -> None:
    """Only an `opsd compare` directory (or an empty one) is written into; the marker goes in first."""
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise UserError(f"{out} exists and is not an `opsd compare` directory; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        (out / MARKER).write_text("{}")


# ----------------------------------------------------------------------------------------------
# Choosing GRPO's settings on seeds that are not reported


def tune_grid(cfg, budget: Budget, lr: float | None = None) -> list[GRPOSettings]:
    """At most 8 settings: a learning rate (``lr``, default the config's) times 1/3, 1, 3 and 10, with
    4 and 8 samples per problem where they divide the responses per step; the config's temperature and
    std scaling."""
    ns = [n for n in (4, 8) if n <= budget.responses_per_step and budget.responses_per_step % n == 0]
    ns = ns or [budget.responses_per_step]
    lrs = [(lr or cfg.optim.lr) * f for f in (1 / 3, 1, 3, 10)]
    t, scale = cfg.rollout.temperature, cfg.grpo.scale_rewards
    return [GRPOSettings(lr, t, n, scale) for n in ns for lr in lrs][:8]


def run_tune(
    config: Path | None,
    overrides: list[str] | Callable[[int], list[str]],
    out: Path,
    *,
    tune_seeds: list[int],
    reported: list[int],
    steps: int,
    lr: float | None = None,
    progress: bool = True,
    method: str = "grpo",
    distill_coef: float | None = None,
) -> dict:
    """Train ``method`` (GRPO, or GRPO + distillation at ``distill_coef``) at each setting of
    :func:`tune_grid` (around ``lr``) for ``steps`` on each tuning seed, without any held-out
    evaluation, and choose the setting with the highest mean training reward over the last half of
    the steps. Writes ``OUT/tune/METHOD.json``, which `opsd compare` then uses; a setting already
    tried (``OUT/tune/METHOD_tried.jsonl``) is not trained again."""
    from opsd.trainer import Trainer

    clash = sorted(set(tune_seeds) & set(reported))
    if clash:
        raise UserError(f"--tune-seeds {clash} are also reported (--seeds): tune on seeds that are not")
    per_seed = overrides if callable(overrides) else (lambda seed: overrides)
    if method not in TUNED:
        raise UserError(f"--tune {method}: choose from {list(TUNED)}")
    cfg = _arm_config(config, per_seed(tune_seeds[0]), [])
    budget = Budget(steps, cfg.rollout.prompts_per_step * cfg.rollout.n, steps)
    coef = distill_coefficient(cfg, distill_coef)
    distill = [f"grpo.distill_coef={coef}"] if method == "mixed" else []
    out = Path(out)
    claim_dir(out)
    (out / "tune").mkdir(exist_ok=True)
    tried_path = out / "tune" / f"{method}_tried.jsonl"
    tried = [json.loads(x) for x in tried_path.read_text().splitlines()] if tried_path.is_file() else []
    results = []
    for i, setting in enumerate(tune_grid(cfg, budget, lr)):
        key = (asdict(setting), tune_seeds, steps, distill)
        done = [t for t in tried if (t["setting"], t["seeds"], t["steps"], t.get("distill", [])) == key]
        if done:
            results.append(done[0])
            continue
        rewards = []
        flat = []
        for seed in tune_seeds:
            run_dir = out / "tune" / f"{method}_setting{i}_seed{seed}"
            extra = [
                *setting.overrides(budget),
                *distill,
                f"seed={seed}",
                f"logging.run_dir={run_dir}",
                f"optim.max_steps={steps}",
                # The held-out set is never read while tuning: it decides nothing here.
                "eval.path=null",
                "eval.every=0",
                "eval.divergence=false",
                "checkpoint.enabled=false",
                f"logging.progress={str(progress).lower()}",
                "logging.step_lines=false",
            ]
            trainer = Trainer(_arm_config(config, per_seed(seed), extra), overwrite=True)
            try:
                history = trainer.train()
            finally:
                trainer.close()
            if trainer.stopped or len(history) < steps:
                raise UserError(f"tuning stopped at setting {i}, seed {seed}; run it again to continue")
            rewards.append([rec["reward_mean"] for rec in history])
            flat.append(sum(rec["flat_group_frac"] for rec in history) / len(history))
        late = [sum(r[len(r) // 2 :]) / len(r[len(r) // 2 :]) for r in rewards]
        first = [r[0] for r in rewards]
        results.append(
            {
                "setting": asdict(setting),
                "seeds": tune_seeds,
                "steps": steps,
                "distill": distill,
                "late_reward": sum(late) / len(late),
                "first_reward": sum(first) / len(first),
                "rewards": rewards,
                "flat_group_frac": sum(flat) / len(flat),
            }
        )
        with tried_path.open("a") as f:
            f.write(json.dumps(results[-1]) + "\n")
        _say(progress, f"tune {method} {i}: {asdict(setting)} late reward {results[-1]['late_reward']:.3f}")
    best = max(results, key=lambda r: (r["late_reward"], -r["setting"]["lr"]))
    improves = best["late_reward"] > best["first_reward"]
    tune = {
        "seeds": tune_seeds,
        "steps": steps,
        "results": results,
        "chosen": best["setting"],
        "improves_on_first_step": improves,
    }
    path = out / tune_file(method)
    path.write_text(json.dumps(tune, indent=2))
    verdict = "improves" if improves else "does NOT improve"
    if no_signal(results):
        verdict += " (every group's reward was flat at every setting: no signal to choose by)"
    _say(True, f"chosen {best['setting']}: its training reward {verdict} on its first step's; {path}")
    return tune


# ----------------------------------------------------------------------------------------------
# Reading, the table, the plot


def _write_points(path: Path, points: list[EvalPoint]) -> None:
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in points))


def _read_points(path: Path) -> list[EvalPoint]:
    if not path.is_file():
        return []
    return [EvalPoint(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _read_run(path: Path) -> MethodRun:
    d = json.loads(path.read_text())
    points = [EvalPoint(**p) for p in d.pop("points")]
    return MethodRun(points=points, **d)


def _point_text(p: EvalPoint) -> str:
    div = f", held-out divergence {p.divergence:.4f}" if p.divergence is not None else ""
    return f"held-out accuracy {100 * p.accuracy:.1f}%{div}"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _runs(result: dict, method: str) -> list[dict]:
    return [r for r in result["runs"] if r["method"] == method]


def _spread(xs: list[float]) -> str:
    mean = sum(xs) / len(xs)
    half = (max(xs) - min(xs)) / 2
    return f"{100 * mean:.1f}%" + (f" ± {100 * half:.1f}" if len(xs) > 1 else "")


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``p`` observed over ``n`` trials (here problems)."""
    if n <= 0:
        return (0.0, 1.0)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_interval(a: list[float], b: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean of ``a - b`` over the same problems with its normal 95% interval: the paired difference of
    two accuracies, whose variance is that of the per-problem differences (two methods that fail and
    succeed on the same problems differ with a far narrower interval than two Wilson intervals show)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired interval needs two equal, non-empty lists, got {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(n - 1, 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def _per_problem(points: list[dict]) -> list[float] | None:
    """Per problem, the mean over seeds of its share correct; None where a point did not record it."""
    lists = [p.get("correct") for p in points]
    if not lists or any(x is None for x in lists) or len({len(x) for x in lists}) != 1:
        return None
    return [sum(xs) / len(xs) for xs in zip(*lists)]


def _difference(a: list[dict], b: list[dict]) -> str:
    """``a - b`` in points with its paired 95% interval, or "-" without per-problem records."""
    pa, pb = _per_problem(a), _per_problem(b)
    if pa is None or pb is None or len(pa) != len(pb):
        return "-"
    mean, lo, hi = paired_interval(pa, pb)
    return f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _acc(ps: list[dict]) -> str:
    """Mean strict accuracy over seeds (± half the range), with the 95% Wilson interval over the
    held-out problems at that mean."""
    text = _spread([p["accuracy"] for p in ps])
    n = ps[0].get("problems", 0)
    if n:
        lo, hi = wilson(sum(p["accuracy"] for p in ps) / len(ps), n)
        text += f" [{100 * lo:.1f}, {100 * hi:.1f}]"
    return text


def _avg(ps: list[dict], key: str, fmt: str, scale: float = 1.0) -> str:
    xs = [p[key] for p in ps if p.get(key) is not None]
    return format(scale * sum(xs) / len(xs), fmt) if xs else "-"


def _best(points: list[dict]) -> dict:
    """The first evaluation at the run's highest strict accuracy: what reaching its best cost."""
    return max(points, key=lambda p: (p["accuracy"], -p["step"]))


def format_table(result: dict) -> str:
    """Per method (the base model first): strict accuracy with its 95% Wilson interval over problems,
    lenient accuracy, gain over the base model, mean response length, truncation and repetition,
    held-out divergence, and the cost of reaching its best evaluation (step, generated tokens, tokens
    the teacher scored, training wall time); means over seeds. The teacher's ceiling and the budget
    underneath."""
    lines = [
        "| method | accuracy [95% CI] | lenient | gain [paired 95% CI] | gap closed | length | truncated "
        "| repetition | divergence | best at step | generated tokens | teacher tokens | train time | lr |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lr = result["lr"]
    firsts = [r["points"][0] for r in result["runs"]]
    seen_seeds, base = set(), []
    for r, p in zip(result["runs"], firsts, strict=True):
        if r["seed"] not in seen_seeds:
            seen_seeds.add(r["seed"])
            base.append(p)
    cells = lambda ps: [  # noqa: E731
        _acc(ps),
        _avg(ps, "lenient", ".1f", 100),
        None,
        _avg(ps, "resp_len", ".0f"),
        _avg(ps, "truncated", ".1%"),
        _avg(ps, "repetition", ".1%"),
        _avg(ps, "divergence", ".4f"),
    ]
    top = (result.get("ceiling") or {}).get("accuracy")  # the teacher's ceiling
    row = cells(base)
    lines.append(
        f"| base model | {row[0]} | {row[1]} | - | - | {' | '.join(row[3:])} | 0 | 0 | 0 | 0 s | - |"
    )
    for m in result["methods"]:
        runs = _runs(result, m)
        final = [r["points"][-1] for r in runs]
        best = [_best(r["points"]) for r in runs]
        gains = [r["points"][-1]["accuracy"] - r["points"][0]["accuracy"] for r in runs]
        row = cells(final)
        gain = sum(gains) / len(gains)
        paired = _difference(final, [r["points"][0] for r in runs])
        row[2] = paired if paired != "-" else f"{100 * gain:+.1f}"
        start = sum(r["points"][0]["accuracy"] for r in runs) / len(runs)
        closed = f"{gain / (top - start):.1%}" if top is not None and top > start else "-"
        row.insert(3, closed)
        rate = runs[0].get("lr") or lr.get(m, lr["grpo"] if m == "mixed" else lr["opsd"])
        cost = [
            _avg(best, "step", ".0f"),
            _avg(best, "generated_tokens", ",.0f"),
            _avg(best, "teacher_tokens", ",.0f"),
            _avg(best, "train_seconds", ".0f") + " s",
        ]
        lines.append(f"| {label(result, m)} | {' | '.join(row)} | {' | '.join(cost)} | {rate:.3g} |")
    lines += _paired_block(result)
    b = result["budget"]
    lines += [
        "",
        f"Base model: {_spread([p['accuracy'] for p in base])} held-out accuracy. Seeds {result['seeds']}; "
        f"{b['steps']} steps, {b['responses_per_step']} responses per step; GRPO {result['grpo']} "
        f"({result['grpo_source']}); GRPO + distillation {result.get('mixed', result['grpo'])} "
        f"({result.get('mixed_source', 'GRPO')}) with grpo.distill_coef={result['distill_coef']}.",
    ]
    for r in result["runs"]:
        if r.get("stopped_by"):
            lines.append(f"{label(result, r['method'])}, seed {r['seed']}: stopped by {r['stopped_by']}.")
    ceiling = result.get("ceiling")
    if ceiling and ceiling.get("accuracy") is not None:
        lenient = "" if ceiling.get("lenient") is None else f", lenient {100 * ceiling['lenient']:.1f}%"
        lo, hi = wilson(ceiling["accuracy"], ceiling["problems"])
        lines.append(
            f"Teacher's ceiling (the base model with each held-out solution in its prompt): "
            f"{100 * ceiling['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]{lenient}."
        )
    elif ceiling:
        lines.append(f"Teacher's ceiling: not measured ({ceiling.get('why')}).")
    lines.append(
        "accuracy: eval.grader over problems x eval.k, [95% Wilson interval over the problems]; lenient: "
        "eval.lenient_grader; gain: final minus step 0 in points, [paired 95% interval over the same "
        "problems]; gap closed: gain / (teacher's ceiling - step 0); length: mean response tokens; "
        "truncated: share cut at eval.max_new_tokens; repetition: mean share of repeated word 4-grams per "
        "response; best at step: the first evaluation at the run's highest accuracy, and what reaching it "
        "cost (teacher tokens: response tokens the teacher scored; 0 for GRPO and SFT)."
    )
    return "\n".join(lines)


def _kind(result: dict, method: str) -> str:
    variant = result.get("variants", {}).get(method)
    return variant["method"] if variant else method


def _paired_block(result: dict) -> list[str]:
    """Each OPSD method's final accuracy against every other kind of method's, on the same problems
    (mean over seeds per problem): the difference in points with its paired 95% interval."""
    finals = {m: [r["points"][-1] for r in _runs(result, m)] for m in result["methods"]}
    opsd = [m for m in result["methods"] if _kind(result, m) == "opsd"]
    others = [m for m in result["methods"] if _kind(result, m) != "opsd"]
    rows = [
        f"| {label(result, a)} | {label(result, b)} | {_difference(finals[a], finals[b])} |"
        for a in opsd
        for b in others
        if _difference(finals[a], finals[b]) != "-"
    ]
    if not rows:
        return []
    return ["", "| method | against | difference in points [paired 95% CI] |", "|---|---|---|", *rows, ""]


def plot_compare(path: Path, result: dict) -> Path:
    """Mean held-out accuracy against optimizer steps and against generated tokens, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for m in result["methods"]:
        runs = _runs(result, m)
        n = min(len(r["points"]) for r in runs)
        mean = [sum(r["points"][i]["accuracy"] for r in runs) / len(runs) for i in range(n)]
        steps = [runs[0]["points"][i]["step"] for i in range(n)]
        tokens = [sum(r["points"][i]["generated_tokens"] for r in runs) / len(runs) for i in range(n)]
        by_step.plot(steps, mean, marker="o", label=label(result, m))
        if m != "sft":
            by_tokens.plot(tokens, mean, marker="o", label=label(result, m))
    by_step.set(xlabel="optimizer step", ylabel="held-out accuracy", title="accuracy vs steps")
    by_tokens.set(xlabel="generated tokens", ylabel="held-out accuracy", title="accuracy vs generated tokens")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# The command


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "OPSD against GRPO, GRPO + distillation, SFT and controls on your model and data, at one budget, "
        "over seeds: `opsd compare --config run.yaml --methods opsd,grpo,sft,mixed --steps 100 --seeds 0,1`."
    )
    p.add_argument("--config", type=Path, help="the `opsd train` YAML config (with eval.path)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as for opsd train")
    p.add_argument("--methods", default="opsd,grpo,sft,mixed,control_b", help=f"from {','.join(METHODS)}")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=METHOD:KEY=VALUE[,KEY=VALUE]",
        help="one more method: METHOD with these keys changed, named NAME in --methods (repeatable)",
    )
    p.add_argument("--seeds", type=_ints, default=[0], help="reported seeds, e.g. 0,1,2")
    p.add_argument("--steps", type=int, help="optimizer steps per method (default: optim.max_steps)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation every K steps (default: steps/4)")
    p.add_argument("--out", type=Path, default=Path("runs/compare"), help="the comparison's directory")
    p.add_argument("--grpo-n", type=int, default=8, help="GRPO samples per problem (untuned)")
    p.add_argument("--sft-lr", type=float, help="SFT's learning rate (default: optim.lr)")
    p.add_argument(
        "--distill-coef", type=float, help="mixed: grpo.distill_coef (default: the config's, or 1)"
    )
    p.add_argument(
        "--tune",
        choices=list(TUNED),
        help="choose GRPO's (grpo) or GRPO + distillation's (mixed) settings on --tune-seeds, then stop",
    )
    p.add_argument("--tune-seeds", type=_ints, default=[1000, 1001], help="seeds for --tune (not reported)")
    p.add_argument("--tune-steps", type=int, default=100, help="steps per tuning run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip the teacher's ceiling: one evaluation of the base model with the held-out solutions",
    )


def run_compare_command(args: argparse.Namespace) -> int:
    from opsd.distributed import launched_by_torchrun

    if launched_by_torchrun():
        raise UserError(
            "opsd compare runs its methods one after another in one process; launch it without torchrun"
        )
    if args.config is None:
        raise UserError("--config is required (the `opsd train` config of the comparison)")
    for name in ("steps", "eval_every", "tune_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if args.tune:
        run_tune(
            args.config,
            args.overrides,
            args.out,
            tune_seeds=args.tune_seeds,
            reported=args.seeds,
            steps=args.tune_steps,
            progress=not args.no_progress,
            method=args.tune,
            distill_coef=args.distill_coef,
        )
        return 0
    result = run_compare(
        args.config,
        args.overrides,
        args.out,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        seeds=args.seeds,
        steps=args.steps,
        eval_every=args.eval_every,
        grpo_n=args.grpo_n,
        sft_lr=args.sft_lr,
        distill_coef=args.distill_coef,
        progress=not args.no_progress,
        ceiling=not args.no_ceiling,
        variants=[Variant.parse(v) for v in args.variant],
    )
    finals = [r["points"][-1]["accuracy"] for r in result["runs"]]
    if any(math.isnan(a) for a in finals):
        raise UserError("a method's held-out accuracy is NaN: check eval.path and eval.answer_key")
    print(f"comparison: {args.out} (compare.md, compare.png, compare.json)", file=sys.stderr)
    return 0
