"""Every method on every seed: the comparison itself, resumable, and its compare.json, compare.md
and compare.png."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from opsd.compare.methods import arm_config, ceiling_context, run_trainer_method
from opsd.compare.plan import (
    MARKER,
    METHODS,
    NOTES,
    Budget,
    ComparePlan,
    GRPOSettings,
    MethodJob,
    Variant,
    claim_dir,
    default_grpo,
    distill_coefficient,
    method_overrides,
)
from opsd.compare.records import EvalPoint, MethodRun, read_run
from opsd.compare.report import format_comparison_table, plot_compare, plot_frontier
from opsd.compare.tuning import read_tuned
from opsd.errors import UserError
from opsd.metrics import say


def run_compare(
    config: Path | None,
    overrides: list[str] | Callable[[int], list[str]],
    out: Path,
    plan: ComparePlan,
) -> dict:
    """Every method of ``plan`` on every seed into ``out``; writes compare.json, compare.md and
    compare.png.

    ``overrides``: dotted overrides on ``config``, or a function of the seed giving them (the demo's
    data and base model differ per seed)."""
    per_seed = overrides if callable(overrides) else (lambda seed: overrides)
    cfg = arm_config(config, per_seed(plan.seeds[0]), [])
    named = {v.name: v for v in plan.variants}
    _check_methods(cfg, plan.methods, named)
    steps = plan.steps or cfg.optim.max_steps
    budget = Budget(
        steps, cfg.rollout.prompts_per_step * cfg.rollout.n, plan.eval_every or max(1, steps // 4)
    )
    out = Path(out)
    claim_dir(out)
    grpo, grpo_source, mixed, mixed_source = _grpo_settings(cfg, out, budget, plan.grpo_n, plan.grpo_lr)
    coef = distill_coefficient(cfg, plan.distill_coef)
    sft_lr = plan.sft_lr or cfg.optim.lr
    say(True, budget.describe())
    say(True, f"GRPO settings {asdict(grpo)}, {grpo_source}")
    say(True, f"mixed settings {asdict(mixed)}, {mixed_source}; with grpo.distill_coef={coef}")
    for m in plan.methods:
        if m in NOTES:
            say(True, f"{METHODS[m]}: {NOTES[m]}")
    ceiling_path = out / "ceiling.json"
    context = ceiling_context(cfg) if plan.ceiling else []
    extras = {m: _method_extra(m, named, grpo, coef, budget, mixed, sft_lr) for m in plan.methods}
    checked = {  # every method's config is checked before any trains
        m: _check_method_config(config, [*per_seed(plan.seeds[0]), *context], m, extras[m])
        for m in plan.methods
    }
    reads_other = [c for c in checked.values() if c.teacher.solution_source == "other"]
    if reads_other:
        _note_shared_solutions(reads_other[0])
    runs: list[MethodRun] = []
    for seed in plan.seeds:
        base = None
        seed_overrides = [*per_seed(seed), *context]
        for method in plan.methods:
            job = MethodJob(
                method, seed, config, [*seed_overrides, *extras[method]], out / f"seed{seed}" / method
            )
            run = _run_or_read(job, plan, budget, base, ceiling_path)
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
        "methods": plan.methods,
        "variants": {v.name: {"method": v.method, "overrides": list(v.overrides)} for v in plan.variants},
        "seeds": plan.seeds,
        "runs": [asdict(r) for r in runs],
        "ceiling": json.loads(ceiling_path.read_text()) if ceiling_path.is_file() else None,
    }
    return _write_report(out, result)


def _run_or_read(
    job: MethodJob, plan: ComparePlan, budget: Budget, base: EvalPoint | None, ceiling_path: Path
) -> MethodRun:
    """One method on one seed: read back where it finished earlier, else trained (resuming); the
    teacher's ceiling measured on the first trained one that finds it missing."""
    done = job.run_dir / "compare_method.json"
    if done.is_file():  # finished earlier: read back, not rerun
        run = read_run(done)
    else:
        want = ceiling_path if plan.ceiling and not ceiling_path.is_file() else None
        run = run_trainer_method(job, budget, base, plan.progress, want)
    done.write_text(json.dumps(asdict(run), indent=2))
    return run


def _method_extra(
    method: str,
    named: dict[str, Variant],
    grpo: GRPOSettings,
    coef: float,
    budget: Budget,
    mixed: GRPOSettings,
    sft_lr: float,
) -> list[str]:
    """The keys ``method`` changes in the user's config: its kind's, then a variant's own."""
    variant = named.get(method)
    kind = variant.method if variant else method
    return [
        *method_overrides(kind, grpo, coef, budget, mixed, sft_lr),
        *(variant.overrides if variant else ()),
    ]


def _check_method_config(config: Path | None, overrides: list[str], method: str, extra: list[str]):
    """One method's config as it will train, refused in one line naming the method before any trains
    (not hours in, when its turn comes)."""
    try:
        return arm_config(config, overrides, extra)
    except UserError as err:
        raise UserError(f"--methods {method}: {err}") from None


def _note_shared_solutions(cfg) -> None:
    """For a method whose teacher reads another row's solution (control B): how many training rows share
    theirs with another row, on stderr; every row with the same one is refused before any method trains."""
    from opsd.data.controls import require_other_solution, shared_text_note
    from opsd.data.sources import RowKeys, load_examples, take_rows

    d = cfg.data
    loaded = load_examples(
        d.path,
        RowKeys(problem=d.problem_key, solution=d.solution_key),
        split=d.split,
        skip_bad_rows=d.skip_bad_rows,
        drop_empty_solution=d.drop_empty_solution,
    )
    rows = take_rows(loaded.examples, d.rows, "data.rows", d.path)
    require_other_solution(rows, d.path)
    say(True, shared_text_note(rows, d.path))


def _check_methods(cfg, methods: list[str], named: dict[str, Variant]) -> None:
    """A comparison needs a held-out set, and every method named must be known before any trains."""
    if not cfg.eval.path:
        raise UserError(
            "opsd compare needs eval.path: a held-out file with answers, the same for every method"
        )
    unknown = [m for m in methods if m not in METHODS and m not in named]
    if unknown:
        raise UserError(f"--methods: unknown {unknown}; choose from {list(METHODS)} or a --variant's name")


def _grpo_settings(
    cfg, out: Path, budget: Budget, grpo_n: int, grpo_lr: float | None
) -> tuple[GRPOSettings, str, GRPOSettings, str]:
    """GRPO's and GRPO + distillation's settings with where each came from: `--tune`'s choice in
    ``out`` when there is one, else the config's (GRPO's, for mixed)."""
    grpo, grpo_source = read_tuned(out, "grpo", budget)
    if grpo is None:
        grpo = default_grpo(cfg, budget, min(grpo_n, budget.responses_per_step))
        grpo = replace(grpo, lr=grpo_lr or grpo.lr)
        grpo_source = "from the config (run `opsd compare --tune grpo` to choose them)"
    mixed, mixed_source = read_tuned(out, "mixed", budget)
    if mixed is None:
        mixed = grpo
        mixed_source = "GRPO's (run `opsd compare --tune mixed` to choose its own)"
    return grpo, grpo_source, mixed, mixed_source


def _write_report(out: Path, result: dict) -> dict:
    """compare.json (the marker, now holding the result), compare.md and compare.png; prints the table."""
    (out / MARKER).write_text(json.dumps(result, indent=2))
    table = format_comparison_table(result)
    (out / "compare.md").write_text(table + "\n")
    result["plot"] = str(plot_compare(out / "compare.png", result))
    frontier = plot_frontier(out / "frontier.png", result)
    if frontier is not None:
        result["frontier_plot"] = str(frontier)
    print(table)
    return result
