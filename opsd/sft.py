"""`opsd sft`: supervised fine-tuning on problem -> solution, the SFT baseline.

One SFT loop: this command runs the trainer's ``objective: sft`` (:class:`opsd.objectives.SFT`, the
token-mean cross-entropy of each drawn row's solution and end token, fed by
:class:`opsd.rollout.queue.SolutionQueue`) on the configuration :class:`opsd.config.SFTCommand`
builds from the sections `opsd train` reads (``model``, ``data``, ``optim``, ``rollout``'s rows per
step and length, ``cpu``). The flags are shorthands for those keys; the model is written to ``out``
(an HF directory, beside the run's config.yaml and metrics.jsonl).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# argparse dest -> SFTCommand key: the flags are shorthands for these keys.
SFT_FLAGS = {
    "model": "model.path",
    "dtype": "model.dtype",
    "data": "data.path",
    "problem_key": "data.problem_key",
    "solution_key": "data.solution_key",
    "target_key": "data.target_key",
    "max_len": "rollout.max_new_tokens",
    "steps": "optim.max_steps",
    "lr": "optim.lr",
    "batch_size": "rollout.prompts_per_step",
    "seed": "seed",
    "out": "out",
}


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Supervised fine-tuning on problem -> solution, trained as `opsd train objective=sft`. Config from "
        "YAML (--config) and/or section.key=value overrides, as for `opsd train`; the flags are shorthands, "
        "e.g. `--steps 50` = `optim.max_steps=50`."
    )
    p.add_argument("--config", type=Path, help="YAML with the keys of opsd.config.SFTCommand")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-5")
    p.add_argument("--model", help="model.path: HF name, local dir, or a short name from `opsd fetch-model`")
    p.add_argument("--data", help="data.path: JSONL/JSON/Parquet/CSV with problem and solution fields")
    p.add_argument("--out", type=Path, help="out: where to save the fine-tuned model (HF format)")
    p.add_argument("--steps", type=int, help="optim.max_steps (default 100)")
    p.add_argument("--lr", type=float, help="optim.lr (default 1e-5)")
    p.add_argument("--batch-size", type=int, help="rollout.prompts_per_step: rows per step (default 8)")
    p.add_argument("--problem-key", help="data.problem_key (default problem)")
    p.add_argument("--solution-key", help="data.solution_key (default solution)")
    p.add_argument("--target-key", help="data.target_key: the field trained on instead (default: none)")
    p.add_argument(
        "--max-len",
        type=int,
        help="rollout.max_new_tokens: a row's prompt + target are cut to data.max_prompt_len + this "
        "(default 2048)",
    )
    p.add_argument(
        "--dtype",
        help="model.dtype: auto (default: bfloat16 where the device has bf16 units), float32, bfloat16",
    )
    p.add_argument("--seed", type=int, help="seed (default 0)")
    p.add_argument(
        "--overwrite", action="store_true", help="delete an existing --out directory and start over"
    )


def run_sft(args: argparse.Namespace) -> int:
    """`opsd sft`: flags and overrides -> :class:`opsd.config.SFTCommand` -> `objective: sft`'s training
    -> the model written to ``out``."""
    from opsd.checkpoint import write_merged
    from opsd.config import SFTCommand, flag_overrides, load_config
    from opsd.cpu import command_defaults
    from opsd.trainer import Trainer

    cfg = load_config(args.config, [*flag_overrides(args, SFT_FLAGS), *args.overrides], schema=SFTCommand)
    trainer = Trainer(command_defaults(cfg.training_config()), overwrite=args.overwrite)
    try:
        history = trainer.train()
        out = Path(cfg.out)
        write_merged(trainer.run.model, trainer.run.tokenizer, out)
    finally:
        trainer.close()
    losses = [rec["loss"] for rec in history]
    span = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; " if losses else ""
    ended = f"stopped by a signal after step {trainer.step_num}; " if trainer.stopped else ""
    print(f"sft: {len(trainer.run.data.examples)} rows, {len(history)} steps, {span}{ended}saved {out}")
    return 0
