"""The `opsd compare` command: its arguments, and the run or the tuning they ask for."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from opsd.compare.plan import METHODS, TUNED, ComparePlan, TunePlan, Variant
from opsd.compare.run import run_compare
from opsd.compare.tuning import run_tune
from opsd.errors import UserError


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
        tune = TunePlan(
            tune_seeds=args.tune_seeds,
            reported=args.seeds,
            steps=args.tune_steps,
            progress=not args.no_progress,
            method=args.tune,
            distill_coef=args.distill_coef,
        )
        run_tune(args.config, args.overrides, args.out, tune)
        return 0
    plan = ComparePlan(
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        seeds=args.seeds,
        steps=args.steps,
        eval_every=args.eval_every,
        grpo_n=args.grpo_n,
        sft_lr=args.sft_lr,
        distill_coef=args.distill_coef,
        progress=not args.no_progress,
        ceiling=not args.no_ceiling,
        variants=tuple(Variant.parse(v) for v in args.variant),
    )
    result = run_compare(args.config, args.overrides, args.out, plan)
    finals = [r["points"][-1]["accuracy"] for r in result["runs"]]
    if any(math.isnan(a) for a in finals):
        raise UserError("a method's held-out accuracy is NaN: check eval.path and eval.answer_key")
    print(f"comparison: {args.out} (compare.md, compare.png, compare.json)", file=sys.stderr)
    return 0
