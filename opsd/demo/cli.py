"""`opsd demo` on the command line: the plain demo (:mod:`opsd.demo.run`) or `--compare`
(:mod:`opsd.demo.compare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opsd.demo import compare, run
from opsd.demo.base import DemoSettings
from opsd.errors import UserError


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control",
        action="store_true",
        help="the scientific control: no solution in the teacher's context (it should teach nothing)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="OPSD against GRPO, SFT and two controls at equal optimizer steps (docs/demo.md)",
    )
    p.add_argument(
        "--tune-grpo",
        type=int,
        metavar="STEPS",
        help="--compare: first choose GRPO's settings by training reward over STEPS steps on seeds "
        "1000,1001 (never reported); reused from RUN_DIR/tune/grpo.json when present",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds", type=_seed_list, default=None, help="--compare: seeds, e.g. 0,1,2 (default: --seed)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps (default {DemoSettings.opsd_steps}; "
        f"--compare: {run.COMPARE_STEPS} for each method)",
    )
    p.add_argument(
        "--run-dir", type=Path, default=None, help="default: runs/demo[-control]-seedN, runs/demo-compare"
    )
    p.add_argument(
        "--cache", type=Path, default=None, help="where base models are cached (default $OPSD_HOME/demo)"
    )


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds {text!r}: expected integers separated by commas, e.g. 0,1,2"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds: give at least one seed, e.g. 0,1,2")
    return seeds


def run_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-checkpoint "writing shards" bars would bury the demo's own
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.compare and args.control:
        raise UserError("--control and --compare: the comparison runs the controls itself; drop --control")
    if args.seeds is not None and not args.compare:
        raise UserError("--seeds is for --compare; the plain demo takes one --seed")
    try:
        return _run_compare(args) if args.compare else _run_one(args)
    except KeyboardInterrupt as e:
        print(f"opsd demo: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 130


def _run_one(args: argparse.Namespace) -> int:
    s = DemoSettings(seed=args.seed, opsd_steps=args.steps or DemoSettings.opsd_steps)
    run_dir = args.run_dir or Path("runs") / f"demo{'-control' if args.control else ''}-seed{args.seed}"
    what = "WITHOUT the worked solution (control)" if args.control else "reading the worked solution"
    print(
        f"opsd demo: {s.digits}-digit addition, tiny Llama ({s.layers}x{s.hidden}), seed {s.seed}; "
        f"fixed teacher {what}",
        file=sys.stderr,
    )
    r = run.run_opsd(s, run_dir, control=args.control, cache=args.cache)
    print()
    print(run.format_before_after(r))
    print(f"plot: {r['plot']}")
    seconds, base_seconds = r["seconds"], r["seconds_base_model"]
    print(f"run directory: {run_dir} ({seconds:.0f} s, of which base model {base_seconds:.0f} s)")
    again = f"opsd train --config {run_dir / 'config.yaml'} logging.run_dir=runs/opsd-demo-again"
    print(f"training alone again: {again}")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    s = DemoSettings(opsd_steps=args.steps or run.COMPARE_STEPS)
    seeds = args.seeds or [args.seed]
    out = args.run_dir or Path("runs") / "demo-compare"
    n = s.prompts_per_step
    print(
        f"opsd demo --compare: {s.digits}-digit addition, tiny Llama ({s.layers}x{s.hidden}), seeds "
        f"{','.join(map(str, seeds))}; {s.opsd_steps} optimizer steps each: OPSD ({n} problems x 1 "
        f"sample), GRPO ({compare.grpo_prompts(s)} problems x {s.grpo_n} samples, lr {s.grpo_lr}), "
        f"SFT ({n} worked solutions), control A (teacher without the solution), "
        "control B (another problem's solution)",
        file=sys.stderr,
    )
    r = compare.run_demo_compare(s, seeds, out, cache=args.cache, tune_steps=args.tune_grpo)
    print()
    print(compare.format_compare_table(r))
    print(f"plot: {r['plot']}")
    print(f"run directories: {out}/seedN/METHOD ({r['seconds']:.0f} s in all)")
    return 0
