"""Choosing GRPO's (or GRPO + distillation's) settings on seeds that are not reported
(`opsd compare --tune`), and reading that choice back."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from opsd.compare.methods import arm_config
from opsd.compare.plan import (
    TUNED,
    Budget,
    GRPOSettings,
    TunePlan,
    check_group_size,
    claim_dir,
    distill_coefficient,
    tune_file,
)
from opsd.errors import UserError
from opsd.metrics import say


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
    plan: TunePlan,
) -> dict:
    """Train ``plan.method`` (GRPO, or GRPO + distillation at ``plan.distill_coef``) at each setting of
    :func:`tune_grid` (around ``plan.lr``) for ``plan.steps`` on each tuning seed, without any held-out
    evaluation, and choose the setting with the highest mean training reward over the last half of
    the steps. Writes ``OUT/tune/METHOD.json``, which `opsd compare` then uses; a setting already
    tried (``OUT/tune/METHOD_tried.jsonl``) is not trained again."""
    clash = sorted(set(plan.tune_seeds) & set(plan.reported))
    if clash:
        raise UserError(f"--tune-seeds {clash} are also reported (--seeds): tune on seeds that are not")
    per_seed = overrides if callable(overrides) else (lambda seed: overrides)
    method = plan.method
    if method not in TUNED:
        raise UserError(f"--tune {method}: choose from {list(TUNED)}")
    cfg = arm_config(config, per_seed(plan.tune_seeds[0]), [])
    budget = Budget(plan.steps, cfg.rollout.prompts_per_step * cfg.rollout.n, plan.steps)
    coef = distill_coefficient(cfg, plan.distill_coef)
    distill = [f"grpo.distill_coef={coef}"] if method == "mixed" else []
    out = Path(out)
    claim_dir(out)
    (out / "tune").mkdir(exist_ok=True)
    tried_path = out / "tune" / f"{method}_tried.jsonl"
    tried = [json.loads(x) for x in tried_path.read_text().splitlines()] if tried_path.is_file() else []
    results = []
    for i, setting in enumerate(tune_grid(cfg, budget, plan.lr)):
        key = (asdict(setting), plan.tune_seeds, plan.steps, distill)
        done = [t for t in tried if (t["setting"], t["seeds"], t["steps"], t.get("distill", [])) == key]
        if done:
            results.append(done[0])
            continue
        keys = [*setting.overrides(budget), *distill]
        rewards = _tune_setting(config, per_seed, keys, out, i, plan)
        results.append(
            {
                "setting": asdict(setting),
                "seeds": plan.tune_seeds,
                "steps": plan.steps,
                "distill": distill,
                **rewards,
            }
        )
        with tried_path.open("a") as f:
            f.write(json.dumps(results[-1]) + "\n")
        say(
            plan.progress,
            f"tune {method} {i}: {asdict(setting)} late reward {results[-1]['late_reward']:.3f}",
        )
    best = max(results, key=lambda r: (r["late_reward"], -r["setting"]["lr"]))
    improves = best["late_reward"] > best["first_reward"]
    tune = {
        "seeds": plan.tune_seeds,
        "steps": plan.steps,
        "results": results,
        "chosen": best["setting"],
        "improves_on_first_step": improves,
    }
    path = out / tune_file(method)
    path.write_text(json.dumps(tune, indent=2))
    verdict = "improves" if improves else "does NOT improve"
    if no_signal(results):
        verdict += " (every group's reward was flat at every setting: no signal to choose by)"
    say(True, f"chosen {best['setting']}: its training reward {verdict} on its first step's; {path}")
    return tune


def _tune_setting(
    config: Path | None,
    per_seed: Callable[[int], list[str]],
    keys: list[str],
    out: Path,
    i: int,
    plan: TunePlan,
) -> dict:
    """Setting ``i`` (its config ``keys``) trained on every tuning seed: its training rewards, per seed
    and step, their means over the first step and the last half, and its share of flat groups."""
    rewards = []
    flat = []
    for seed in plan.tune_seeds:
        run_dir = out / "tune" / f"{plan.method}_setting{i}_seed{seed}"
        history, stopped = _tune_run(config, per_seed(seed), keys, run_dir, seed, plan.steps, plan.progress)
        if stopped or len(history) < plan.steps:
            raise UserError(f"tuning stopped at setting {i}, seed {seed}; run it again to continue")
        rewards.append([rec["reward_mean"] for rec in history])
        flat.append(sum(rec["flat_group_frac"] for rec in history) / len(history))
    late = [sum(r[len(r) // 2 :]) / len(r[len(r) // 2 :]) for r in rewards]
    first = [r[0] for r in rewards]
    return {
        "late_reward": sum(late) / len(late),
        "first_reward": sum(first) / len(first),
        "rewards": rewards,
        "flat_group_frac": sum(flat) / len(flat),
    }


def _tune_run(
    config: Path | None,
    overrides: list[str],
    keys: list[str],
    run_dir: Path,
    seed: int,
    steps: int,
    progress: bool,
) -> tuple[list[dict], bool]:
    """One tuning run: the Trainer at one setting (``keys``) on one seed, with no held-out set, and
    whether it was stopped before its steps."""
    from opsd.trainer import Trainer

    extra = [
        *keys,
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
    trainer = Trainer(arm_config(config, overrides, extra), overwrite=True)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return history, trainer.stopped
