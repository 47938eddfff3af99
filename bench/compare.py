"""`opsd demo --compare` over seeds 0, 1, 2 with the demo's default settings; writes docs/results.md.

OPSD, GRPO (8 samples per problem), SFT on the worked solutions, control A (teacher without the
solution) and control B (teacher with another problem's solution), the same number of optimizer steps
each, in this process, one after the other. The figures are recorded whatever they show. The load
average before and after is printed and recorded: other jobs on the cores slow every arm down.

    python bench/compare.py                          # seeds 0 1 2, 100 steps: about 3 x 4 minutes on 2 cores
    python bench/compare.py --seeds 0 --steps 50 --no-write
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import _common
from _md import write_section
from demo import machine

from opsd.demo.base import DemoSettings
from opsd.demo.compare import ARMS, format_compare_table, gain, mean_curve, run_demo_compare
from opsd.demo.run import COMPARE_STEPS

ROOT = _common.ROOT
HEADING = "Demo comparison: OPSD, GRPO, SFT, controls (bench/compare.py)"


def render(r: dict, started: str, load_before: str, load_after: str, plot: str) -> str:
    s = r["settings"]
    seeds = [sd["seed"] for sd in r["seeds"]]
    lines = [
        f"Run {started}, `python bench/compare.py --seeds {','.join(map(str, seeds))} --steps "
        f"{s['opsd_steps']}`. Machine: {machine()}. Load average (1/5/15 min) before {load_before}, after "
        f"{load_after} ({os.cpu_count()} cores: above that, other jobs shared them, and the times are upper "
        f"bounds). Whole comparison: {r['seconds'] / 60:.1f} min for {len(seeds)} seed(s), base-model builds "
        "included unless cached.",
        "",
        f"Settings (docs/demo.md): {s['digits']}-digit addition, Llama {s['layers']}x{s['hidden']} after "
        f"{s['sft_steps']} SFT steps ({s['sft_schedule']} lr); every method then takes {s['opsd_steps']} "
        f"optimizer steps with AdamW lr {s['opsd_lr']} (GRPO: {s['grpo_lr']}), {s['opsd_warmup']} warmup "
        "steps then cosine, gradient clip 1, from the same base model, on the same training problems; "
        "held-out accuracy on "
        f"{s['n_heldout']} problems (greedy, exact final answer) every {s['eval_every']} steps. OPSD and the "
        f"controls: {s['prompts_per_step']} problems x 1 sample a step, fixed teacher, forward KL. GRPO: "
        f"{r['grpo_prompts_per_step']} problems x {s['grpo_n']} samples a step (as many responses a step as "
        f"OPSD), reward 1 for an exact final answer, mean baseline. SFT: {s['prompts_per_step']} worked "
        "solutions a step, cross-entropy, nothing generated. Training wall time excludes the held-out "
        "evaluations.",
        "",
        format_compare_table(r),
        "",
        f"![held-out accuracy against optimizer steps and generated tokens]({plot})",
        "",
        "Held-out accuracy (%) by optimizer step, mean over seeds:",
        "",
    ]
    for arm in dict.fromkeys(a["arm"] for sd in r["seeds"] for a in sd["arms"]):
        steps, acc = mean_curve(r, arm, "step"), mean_curve(r, arm, "accuracy")
        lines.append(f"- {ARMS[arm]}: " + " ".join(f"{int(x)}:{100 * y:.0f}" for x, y in zip(steps, acc)))
    checks, ran = [], {a["arm"] for a in r["seeds"][0]["arms"]}
    if "control_a" in ran:
        g = gain(r, "control_a")
        checks.append(
            (
                "control A gains exactly 0 on every seed",
                all(x == 0 for x in g),
                ", ".join(f"{100 * x:+.1f}" for x in g),
            )
        )
    if {"opsd", "control_b"} <= ran:
        o, b = gain(r, "opsd"), gain(r, "control_b")
        checks.append(
            (
                "control B gains less than OPSD on every seed",
                all(x < y for x, y in zip(b, o)),
                "control B "
                + ", ".join(f"{100 * x:+.1f}" for x in b)
                + "; OPSD "
                + ", ".join(f"{100 * y:+.1f}" for y in o),
            )
        )
    if checks:
        lines += ["", "Checks:", ""]
        lines += [f"- {name}: {'yes' if ok else 'NO'} ({detail})" for name, ok, detail in checks]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated, e.g. 0,1,2")
    ap.add_argument("--steps", type=int, default=COMPARE_STEPS, help="optimizer steps per method")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-compare", help="run directories")
    ap.add_argument("--cache", type=Path, default=None, help="base models (default: a fresh OUT/cache)")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    if args.out.exists():
        shutil.rmtree(args.out)
    started, load_before = time.strftime("%Y-%m-%d %H:%M"), _common.load_avgs()
    print(f"load average before: {load_before}", flush=True)
    r = run_demo_compare(
        DemoSettings(opsd_steps=args.steps),
        seeds,
        args.out / "runs",
        cache=args.cache or args.out / "cache",
        progress=True,
    )
    load_after = _common.load_avgs()
    print(f"load average after: {load_after}", flush=True)
    plot = Path(r["plot"])
    if not args.no_write:  # the figure beside the page that shows it
        shutil.copyfile(plot, args.md.parent / "demo_compare.png")
        plot = Path("demo_compare.png")
    body = render(r, started, load_before, load_after, str(plot))
    print(body)
    if not args.no_write:
        write_section(args.md, HEADING, body)
        print(f"wrote {args.md} and {args.md.parent / 'demo_compare.png'}")


if __name__ == "__main__":
    main()
