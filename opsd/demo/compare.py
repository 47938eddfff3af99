"""`opsd demo --compare`: OPSD against GRPO and SFT on the demo task, at equal optimizer steps, with
two controls. Same base model, same training problems, same held-out problems, same schedule.

Every arm but SFT is `opsd train`'s Trainer with a few overrides on the demo's configuration, so the
arms differ only where the overrides say. GRPO draws ``prompts_per_step // grpo_n`` problems a step and
samples ``grpo_n`` responses to each: as many responses a step (64 by default) as OPSD, which samples
one for each of its ``prompts_per_step`` problems. A step therefore trains on about as many tokens in
either, and the difference between them is what one response per problem can teach against what a
group of eight can. GRPO has its own learning rate (``grpo_lr``): at OPSD's, its reward collapses to
zero within a few steps and it never learns again (docs/demo.md). SFT is `opsd sft`'s loop on the
worked solutions of the same problems (off-policy: nothing is generated), ``prompts_per_step`` rows a
step.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from opsd.demo.base import DemoSettings, sft_pairs
from opsd.demo.run import (
    EvalPoint,
    Prepared,
    _say,
    heldout_accuracy,
    prepare,
    train_overrides,
    train_with_evals,
)
from opsd.errors import UserError

# Arm -> what the table and the plot call it.
ARMS: dict[str, str] = {
    "opsd": "OPSD",
    "grpo": "GRPO",
    "sft": "SFT on worked solutions",
    "control_a": "control A: teacher without the solution",
    "control_b": "control B: teacher with another problem's solution",
}
MARKER = "compare.json"  # written first into a compare directory: only such a directory is overwritten


def grpo_prompts(s: DemoSettings) -> int:
    """Problems per GRPO step: as many responses a step as OPSD (prompts_per_step x 1 = this x grpo_n)."""
    return max(1, s.prompts_per_step // s.grpo_n)


def arm_overrides(arm: str, s: DemoSettings) -> list[str]:
    """What an arm changes in the demo's `opsd train` configuration (train_overrides)."""
    return {
        "opsd": [],
        "control_a": ["teacher.privileged=false"],
        "control_b": ["teacher.solution_source=other"],
        "grpo": [
            "objective=grpo",
            "grpo.grader=opsd.demo.task:grade",
            f"rollout.n={s.grpo_n}",
            f"rollout.prompts_per_step={grpo_prompts(s)}",
            f"optim.lr={s.grpo_lr}",
        ],
    }[arm]


@dataclass
class ArmResult:
    arm: str
    seed: int
    points: list[EvalPoint]  # held-out evaluations, step 0 (the base model) first
    seconds: float  # the whole arm, evaluations included

    @property
    def final(self) -> EvalPoint:
        return self.points[-1]


def run_trainer_arm(arm: str, s: DemoSettings, p: Prepared, run_dir: Path, progress: bool) -> ArmResult:
    """OPSD, a control or GRPO: the demo's Trainer with the arm's overrides."""
    from opsd.config import load_config
    from opsd.models import load_tokenizer
    from opsd.trainer import Trainer

    t0 = time.time()
    overrides = train_overrides(
        s, p.base, p.data_dir / "train.jsonl", run_dir, control=False, progress=progress
    )
    overrides += ["checkpoint.enabled=false", *arm_overrides(arm, s)]
    trainer = Trainer(load_config(None, overrides), overwrite=True)
    try:
        points = train_with_evals(
            trainer, load_tokenizer(str(p.base)), p, s, run_dir, progress, label=ARMS[arm]
        )
    finally:
        trainer.close()
    return ArmResult(arm, s.seed, points, time.time() - t0)


def run_sft_arm(s: DemoSettings, p: Prepared, run_dir: Path, progress: bool) -> ArmResult:
    """`opsd sft`'s loop on the worked solutions of OPSD's problems, with OPSD's batch, lr and schedule."""
    from opsd.models import load_model, load_tokenizer
    from opsd.sft import sft

    t0 = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    tok, model = load_tokenizer(str(p.base)), load_model(str(p.base))
    points = [EvalPoint(0, p.student_before, 0, 0.0)]
    clock = {"train": 0.0, "since": time.time()}

    def evaluate(step: int, loss: float) -> None:
        if step % s.eval_every and step != s.opsd_steps:
            return
        clock["train"] += time.time() - clock["since"]
        acc = heldout_accuracy(model, tok, p.heldout, s.digits, with_solution=False)
        points.append(EvalPoint(step, acc, 0, clock["train"]))
        _say(progress, f"{ARMS['sft']} step {step}: held-out accuracy {100 * acc:.1f}%")
        clock["since"] = time.time()

    torch.manual_seed(s.seed)
    sft(
        model,
        sft_pairs(tok, p.train, teacher_frac=0.0, seed=s.seed),
        steps=s.opsd_steps,
        lr=s.opsd_lr,
        batch_size=s.prompts_per_step,
        seed=s.seed,
        pad_id=tok.pad_token_id,
        warmup=s.opsd_warmup,
        schedule="cosine",
        grad_clip=1.0,
        progress=progress,
        desc=ARMS["sft"],
        callback=evaluate,
    )
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(asdict(e)) + "\n" for e in points))
    return ArmResult("sft", s.seed, points, time.time() - t0)


def _check_out_dir(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise UserError(f"{out} exists and is not an `opsd demo --compare` directory; pass another --run-dir")


def run_compare(
    s: DemoSettings,
    seeds: list[int],
    out: Path,
    *,
    arms: tuple[str, ...] = tuple(ARMS),
    cache: Path | None = None,
    progress: bool = True,
    threads: int | None = 1,
) -> dict:
    """Every arm on every seed; writes OUT/seedN/ARM/ run directories, compare.png and compare_result.json.

    ``threads``: torch CPU threads while it runs (restored after), 1 as in `opsd demo` (see run_opsd).
    """
    from opsd.fetch import opsd_home

    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise UserError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    out = Path(out)
    _check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(
        json.dumps({"settings": asdict(s), "seeds": seeds, "arms": list(arms)}, indent=2)
    )
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.time()
    seeds_out = []
    try:
        for seed in seeds:
            ss = replace(s, seed=seed)
            p = prepare(ss, Path(cache or opsd_home() / "demo"), progress)
            results = []
            for arm in arms:
                _say(progress, f"seed {seed}: {ARMS[arm]}")
                run_dir = out / f"seed{seed}" / arm
                if arm == "sft":
                    r = run_sft_arm(ss, p, run_dir, progress)
                else:
                    r = run_trainer_arm(arm, ss, p, run_dir, progress)
                results.append(asdict(r))
            seeds_out.append(
                {
                    "seed": seed,
                    "student_before": p.student_before,
                    "teacher_with_solution": p.teacher_with_solution,
                    "seconds_base_model": p.seconds_base_model,
                    "arms": results,
                }
            )
    finally:
        torch.set_num_threads(prev)
    result = {
        "settings": asdict(s),
        "grpo_prompts_per_step": grpo_prompts(s),
        "seeds": seeds_out,
        "seconds": time.time() - t0,
    }
    result["plot"] = str(plot_compare(out / "compare.png", result))
    (out / "compare_result.json").write_text(json.dumps(result, indent=2))
    return result


# ----------------------------------------------------------------------------------------------
# Reading a result: means over seeds, the table, the plot


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
    mean = f"{100 * sum(xs) / len(xs):.1f}%"
    return mean if len(xs) == 1 else f"{mean} ({' / '.join(f'{100 * x:.1f}' for x in xs)})"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


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
        gain = _mean([a - b for a, b in zip(after, before)])
        lines.append(
            f"| {ARMS[arm]} | {_pct(after)} | {100 * gain:+.1f} | "
            f"{_mean([r['points'][-1]['generated_tokens'] for r in runs]):,.0f} | "
            f"{_mean([r['points'][-1]['train_seconds'] for r in runs]):.0f} s |"
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


def plot_compare(path: Path, result: dict) -> Path:
    """compare.png: held-out accuracy against optimizer steps (above) and generated tokens (below).

    SFT generates nothing: below, its final accuracy is a level across the axis, in its own colour."""
    from opsd.report import Panel, plot_panels

    arms = list(dict.fromkeys(a["arm"] for sd in result["seeds"] for a in sd["arms"]))
    teacher = _mean([sd["teacher_with_solution"] for sd in result["seeds"]])
    acc = {arm: [100 * a for a in mean_curve(result, arm, "accuracy")] for arm in arms}
    tokens = {arm: mean_curve(result, arm, "generated_tokens") for arm in arms}
    most = max(max(t) for t in tokens.values())
    steps = result["settings"]["opsd_steps"]
    by_tokens = {}
    for arm in arms:  # the same order, so each method keeps its colour in both panels
        if arm == "sft":
            by_tokens[f"{ARMS[arm]} after {steps} steps (0 generated)"] = ([0, most], [acc[arm][-1]] * 2)
        else:
            by_tokens[ARMS[arm]] = (tokens[arm], acc[arm])
    n = len(result["seeds"])
    return plot_panels(
        path,
        f"opsd demo --compare: {n} seed{'s, mean' if n > 1 else ''}",
        [
            Panel(
                {ARMS[arm]: (mean_curve(result, arm, "step"), acc[arm]) for arm in arms},
                ylabel="held-out accuracy (%)",
                xlabel="optimizer step",
                ylim=(-2, 102),
                hlines={"base model with the worked solution": 100 * teacher},
            ),
            Panel(by_tokens, ylabel="held-out accuracy (%)", xlabel="generated tokens", ylim=(-2, 102)),
        ],
        sharex=False,
    )


def gain(result: dict, arm: str) -> list[float]:
    """Held-out accuracy after training minus before, per seed."""
    return [
        a["points"][-1]["accuracy"] - sd["student_before"]
        for sd in result["seeds"]
        for a in sd["arms"]
        if a["arm"] == arm
    ]
