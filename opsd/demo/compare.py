"""`opsd demo --compare`: OPSD against GRPO and SFT on the demo task, at equal optimizer steps, with
two controls. Same base model, same training problems, same held-out problems, same schedule.

Every arm is `opsd train`'s Trainer with a few overrides on the demo's configuration, so the
arms differ only where the overrides say. GRPO draws ``prompts_per_step // grpo_n`` problems a step and
samples ``grpo_n`` responses to each: as many responses a step (64 by default) as OPSD, which samples
one for each of its ``prompts_per_step`` problems. A step therefore trains on about as many tokens in
either, and the difference between them is what one response per problem can teach against what a
group of eight can. GRPO has its own learning rate (``grpo_lr``): at OPSD's, its reward collapses to
zero within a few steps and it never learns again (docs/demo.md). SFT is the trainer with
``objective: sft`` on the worked solutions of the same problems (off-policy: nothing is generated),
``prompts_per_step`` rows a step.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from opsd.demo.base import DemoSettings
from opsd.demo.run import Prepared, heldout_overrides, prepare
from opsd.errors import UserError
from opsd.metrics import mean

if TYPE_CHECKING:
    from opsd.compare import ComparePlan

# Arm -> what the table and the plot call it.
ARMS: dict[str, str] = {
    "opsd": "OPSD",
    "grpo": "GRPO",
    "mixed": "GRPO + distillation",
    "sft": "SFT on worked solutions",
    "control_a": "control A: teacher without the solution",
    "control_b": "control B: teacher with another problem's solution",
}


def grpo_prompts(s: DemoSettings) -> int:
    """Problems per GRPO step: as many responses a step as OPSD (prompts_per_step x 1 = this x grpo_n)."""
    return max(1, s.prompts_per_step // s.grpo_n)


# Torch CPU threads while a comparison runs (restored after): 1, as in `opsd demo` (see run_opsd).
THREADS = 1
# The seeds `tune_steps` tunes GRPO on: never reported.
TUNE_SEEDS = (1000, 1001)


def run_demo_compare(
    s: DemoSettings,
    seeds: list[int],
    out: Path,
    *,
    arms: tuple[str, ...] = tuple(ARMS),
    cache: Path | None = None,
    progress: bool = True,
    tune_steps: int | None = None,
) -> dict:
    """`opsd compare` on the demo's configuration: every arm on every seed, into OUT/seedN/ARM/; writes
    compare_result.json (the demo's summary, with the ceiling of each seed's base model reading the
    worked solution) beside `opsd compare`'s compare.json, compare.md and compare.png.

    Torch runs on :data:`THREADS` CPU threads meanwhile (restored after).
    GRPO's settings: ``s.grpo_n`` and ``s.grpo_lr``, or those `opsd compare --tune grpo` chose into
    OUT/tune/grpo.json. ``tune_steps``: run that choice first (`opsd compare --tune grpo`: up to 8
    settings around ``s.grpo_lr`` on :data:`TUNE_SEEDS`, which are never reported), unless it is there.
    """
    from opsd import compare as general
    from opsd.fetch import opsd_home

    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise UserError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    out = Path(out)
    general.claim_dir(out)
    prev = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    t0 = time.time()
    try:
        where = Path(cache or opsd_home() / "demo")
        tune = tune_steps and not (out / general.tune_file("grpo")).is_file()
        runs = [*seeds, *(TUNE_SEEDS if tune else ())]
        prepared = {seed: prepare(replace(s, seed=seed), where, progress) for seed in runs}

        def per_seed(seed: int) -> list[str]:
            return heldout_overrides(replace(s, seed=seed), prepared[seed], progress)

        if tune:
            plan = general.TunePlan(list(TUNE_SEEDS), seeds, tune_steps, lr=s.grpo_lr, progress=progress)
            general.run_tune(None, per_seed, out, plan)
        r = general.run_compare(None, per_seed, out, _compare_plan(s, seeds, arms, progress))
    finally:
        torch.set_num_threads(prev)
    result = {
        "settings": asdict(s),
        "grpo": r["grpo"],
        "grpo_source": r["grpo_source"],
        "grpo_prompts_per_step": r["budget"]["responses_per_step"] // r["grpo"]["n"],
        "seeds": [_seed_summary(r, seed, prepared[seed]) for seed in seeds],
        "seconds": time.time() - t0,
    }
    result["plot"] = r["plot"]  # `opsd compare`'s compare.png
    (out / "compare_result.json").write_text(json.dumps(result, indent=2))
    return result


def _compare_plan(s: DemoSettings, seeds: list[int], arms: tuple[str, ...], progress: bool) -> ComparePlan:
    """The demo's settings as `opsd compare`'s plan: its steps, evaluations, GRPO's group and lr, and
    SFT at OPSD's lr."""
    from opsd.compare import ComparePlan

    return ComparePlan(
        methods=list(arms),
        seeds=seeds,
        steps=s.opsd_steps,
        eval_every=s.eval_every,
        grpo_n=s.grpo_n,
        grpo_lr=s.grpo_lr,
        sft_lr=s.opsd_lr,
        progress=progress,
    )


def _seed_summary(r: dict, seed: int, p: Prepared) -> dict:
    """One seed in compare_result.json: its base model before training and with the worked solution
    (``p``: what :func:`opsd.demo.run.prepare` measured), and each arm's evaluations."""
    runs = [x for x in r["runs"] if x["seed"] == seed]
    arms_out = [
        {
            "arm": x["method"],
            "seed": seed,
            "points": x["points"],
            "seconds": x["points"][-1]["train_seconds"],
        }
        for x in runs
    ]
    return {
        "seed": seed,
        "student_before": runs[0]["points"][0]["accuracy"],
        "teacher_with_solution": p.teacher_with_solution,
        "seconds_base_model": p.seconds_base_model,
        "arms": arms_out,
    }


# ----------------------------------------------------------------------------------------------
# Reading a result: means over seeds and the table


def arm_runs(result: dict, arm: str) -> list[dict]:
    """One arm's ArmResult dicts, one per seed."""
    return [a for sd in result["seeds"] for a in sd["arms"] if a["arm"] == arm]


def mean_curve(result: dict, arm: str, key: str) -> list[float]:
    """``key`` of each evaluation, averaged over seeds (every seed evaluates at the same steps)."""
    runs = arm_runs(result, arm)
    return [sum(r["points"][i][key] for r in runs) / len(runs) for i in range(len(runs[0]["points"]))]


def tokens_to_reach(points: list[dict], target: float) -> int | None:
    """Generated tokens at the first evaluation after step 0 whose accuracy is at least ``target``
    (None: never)."""
    return next((e["generated_tokens"] for e in points[1:] if e["accuracy"] >= target), None)


def _pct(xs: list[float]) -> str:
    text = f"{100 * sum(xs) / len(xs):.1f}%"
    return text if len(xs) == 1 else f"{text} ({' / '.join(f'{100 * x:.1f}' for x in xs)})"


def format_compare_table(result: dict) -> str:
    """Markdown: per arm, held-out accuracy after N steps, its gain, generated tokens and training time."""
    s, seeds = result["settings"], result["seeds"]
    before = [sd["student_before"] for sd in seeds]
    arms = list(dict.fromkeys(a["arm"] for sd in seeds for a in sd["arms"]))
    per_seed = " (mean, then per seed)" if len(seeds) > 1 else ""
    lines = [
        f"| method | held-out accuracy after {s['opsd_steps']} steps{per_seed} "
        "| gain (points) | generated tokens | training wall time |",
        "|---|---|---|---|---|",
        f"| base model, before training | {_pct(before)} | | | |",
    ]
    for arm in arms:
        runs = arm_runs(result, arm)
        after = [r["points"][-1]["accuracy"] for r in runs]
        gain = mean([a - b for a, b in zip(after, before)])
        lines.append(
            f"| {ARMS[arm]} | {_pct(after)} | {100 * gain:+.1f} | "
            f"{mean([r['points'][-1]['generated_tokens'] for r in runs]):,.0f} | "
            f"{mean([r['points'][-1]['train_seconds'] for r in runs]):.0f} s |"
        )
    teacher = [sd["teacher_with_solution"] for sd in seeds]
    lines.append(f"| (ceiling) base model with the worked solution in context | {_pct(teacher)} | | | |")
    lines += ["", *token_efficiency_lines(result)]
    return "\n".join(lines)


def token_efficiency_lines(result: dict) -> list[str]:
    """Per seed: when OPSD first reached GRPO's final accuracy, and the generated tokens each spent."""
    out = []
    for sd in result["seeds"]:
        by = {a["arm"]: a for a in sd["arms"]}
        if "opsd" not in by or "grpo" not in by:
            return []
        g = by["grpo"]["points"][-1]
        reached = tokens_to_reach(by["opsd"]["points"], g["accuracy"])
        if g["accuracy"] <= sd["student_before"]:
            what = f"that is no better than the base model ({100 * sd['student_before']:.1f}%)"
        elif reached is None:
            what = "OPSD did not reach it"
        else:
            what = f"OPSD reached it after {reached:,} ({g['generated_tokens'] / reached:.1f}x fewer)"
        out.append(
            f"- seed {sd['seed']}: GRPO ended at {100 * g['accuracy']:.1f}% after {g['generated_tokens']:,} "
            f"generated tokens; {what}."
        )
    return out


def gain(result: dict, arm: str) -> list[float]:
    """Held-out accuracy after training minus before, per seed."""
    return [
        a["points"][-1]["accuracy"] - sd["student_before"]
        for sd in result["seeds"]
        for a in sd["arms"]
        if a["arm"] == arm
    ]
