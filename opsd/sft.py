"""Supervised fine-tuning on (prompt, response) token pairs: the SFT baseline and the demo's base model.

Cross-entropy on response tokens only. Logits are made a chunk of rows at a time under activation
checkpointing, so no ``[tokens, vocab]`` tensor for a whole batch is ever held. The optimizer and the
learning-rate schedule are `opsd train`'s (:mod:`opsd.optim`).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from opsd.config import CpuTuning, DeviceSetting
from opsd.cpu import CpuPlan, default_plan
from opsd.data import DEFAULT_INSTRUCTION
from opsd.data.batching import pad_right, response_positions
from opsd.data.solutions import sft_pairs_from_examples
from opsd.models import final_hidden, head_weight
from opsd.optim import make_optimizer


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = 1024) -> Tensor:
    """Summed CE of ``hidden @ weight.T`` against ``targets``, in fp32, one chunk of logits at a time."""

    def piece(h: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy((h @ weight.t()).float(), y, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(piece, hidden[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
    return total


def sft(
    model: nn.Module,
    pairs: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
    pad_id: int = 0,
    warmup: int = 20,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
    grad_clip: float = 1.0,
    weight_decay: float = 0.0,
    progress: bool = True,
    desc: str = "sft",
    callback: Callable[[int, float], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
    plan: CpuPlan | None = None,
) -> list[float]:
    """Train ``model`` in place on random batches of ``pairs``; returns the per-step mean token loss.

    One call is one schedule (:func:`opsd.optim.lr_factor`: ``warmup`` linear steps, then ``schedule``
    down to ``min_lr_ratio * lr`` at ``steps``). To look at the model part way, pass
    ``callback(step, loss)`` (called after every step) rather than calling ``sft`` in pieces: each call
    restarts the warmup and the decay. ``grad_clip``: max global grad norm, 0 disables clipping.
    ``autocast_dtype``: compute the forward in this dtype over the model's (float32 master) weights.
    ``plan``: the CPU plan (default: the ``cpu`` section's defaults for this device), whose width
    buckets pad each batch.
    """
    if not pairs:
        raise ValueError("sft: no (prompt, response) pairs to train on")
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = make_optimizer(
        params,
        lr=lr,
        weight_decay=weight_decay,
        warmup=warmup,
        total=steps,
        schedule=schedule,
        min_ratio=min_lr_ratio,
    )
    # Widths in buckets where the CPU's bf16 attention keeps a kernel per length (the CPU plan's).
    plan = plan or default_plan(device, autocast_dtype or next(model.parameters()).dtype)
    bucket = plan.row_widths().bucket
    rng = random.Random(seed)
    model.train()
    losses = []
    bar = tqdm(
        range(steps), desc=desc, disable=None if progress else True, leave=False, file=sys.stderr, unit="step"
    )
    for step in bar:
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        seqs = [p + r for p, r in batch]
        ids, mask = pad_right(seqs, pad_id, device, bucket)
        resp = [len(r) for _, r in batch]
        pos = response_positions([len(s) for s in seqs], resp, ids.shape[1])
        targets = torch.tensor([t for _, r in batch for t in r], device=device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            hidden = final_hidden(model, ids, mask, pos)
            loss = chunked_cross_entropy(hidden, head_weight(model), targets) / len(targets)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        if callback is not None:
            callback(step + 1, losses[-1])
            model.train()
    return losses


# ----------------------------------------------------------------------------------------------
# `opsd sft`: problem -> solution with the training chat template, full fine-tuning. The same YAML +
# section.key=value dialect as `opsd train`, with the same names for the same things.


class SFTModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str  # HF name, local dir, or a short name from `opsd fetch-model`
    # The compute dtype, resolved as `opsd train` does (auto: bf16 where the device has bf16 matrix units);
    # bf16 trains float32 master weights under autocast (pure_bf16: true stores bf16 weights instead).
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    pure_bf16: bool = False


class SFTDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str  # JSONL/JSON/Parquet/CSV file, save_to_disk dir or hub name with problem and solution fields
    problem_key: str = "problem"
    solution_key: str = "solution"  # the response trained on, unless target_key names another field
    target_key: str | None = None  # the field trained on in place of solution_key (as training's key)
    split: str = "train"
    instruction: str = DEFAULT_INSTRUCTION  # appended to each problem, as in training
    student_thinking: bool | None = None  # enable_thinking in the chat template; None = template default
    max_len: int = Field(2048, ge=2)  # prompt + response tokens; longer responses are cut


class SFTOptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-5, gt=0)
    batch_size: int = Field(8, ge=1)  # rows per optimizer step, drawn at random with replacement
    max_steps: int = Field(100, ge=1)
    warmup_steps: int = Field(20, ge=0)
    scheduler: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    weight_decay: float = Field(0.0, ge=0)


class SFTConfig(BaseModel):
    """Everything `opsd sft` reads."""

    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    device: DeviceSetting = "auto"  # auto | cpu | cuda | cuda:N (opsd.devices)
    out: str  # where to save the fine-tuned model (HF format)
    model: SFTModelConfig
    data: SFTDataConfig
    optim: SFTOptimConfig = SFTOptimConfig()
    cpu: CpuTuning = CpuTuning()  # the CPU mechanisms, as `opsd train`'s cpu section (docs/cpu.md)

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, tree: Any) -> Any:
        """An absent section reports its missing keys (model.path), not just the section's name."""
        return {**{k: {} for k in ("model", "data")}, **tree} if isinstance(tree, dict) else tree


# argparse dest -> SFTConfig key: the flags are shorthands for these keys.
SFT_FLAGS = {
    "model": "model.path",
    "dtype": "model.dtype",
    "data": "data.path",
    "problem_key": "data.problem_key",
    "solution_key": "data.solution_key",
    "target_key": "data.target_key",
    "max_len": "data.max_len",
    "steps": "optim.max_steps",
    "lr": "optim.lr",
    "batch_size": "optim.batch_size",
    "seed": "seed",
    "out": "out",
}


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Supervised fine-tuning on problem -> solution. Config from YAML (--config) and/or section.key=value "
        "overrides, as for `opsd train`; the flags are shorthands, e.g. `--steps 50` = `optim.max_steps=50`."
    )
    p.add_argument("--config", type=Path, help="YAML with the keys of opsd.sft.SFTConfig")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-5")
    p.add_argument("--model", help="model.path: HF name, local dir, or a short name from `opsd fetch-model`")
    p.add_argument("--data", help="data.path: JSONL/JSON/Parquet/CSV with problem and solution fields")
    p.add_argument("--out", type=Path, help="out: where to save the fine-tuned model (HF format)")
    p.add_argument("--steps", type=int, help="optim.max_steps (default 100)")
    p.add_argument("--lr", type=float, help="optim.lr (default 1e-5)")
    p.add_argument("--batch-size", type=int, help="optim.batch_size (default 8)")
    p.add_argument("--problem-key", help="data.problem_key (default problem)")
    p.add_argument("--solution-key", help="data.solution_key (default solution)")
    p.add_argument("--target-key", help="data.target_key: the field trained on instead (default: none)")
    p.add_argument("--max-len", type=int, help="data.max_len: prompt + response tokens; longer rows are cut")
    p.add_argument(
        "--dtype",
        help="model.dtype: auto (default: bfloat16 where the device has bf16 units), float32, bfloat16",
    )
    p.add_argument("--seed", type=int, help="seed (default 0)")


def run_sft(args: argparse.Namespace) -> int:
    from opsd.config import load_config
    from opsd.cpu import resolve_plan
    from opsd.data import load_examples
    from opsd.devices import resolve_device
    from opsd.eval.cli import flag_overrides
    from opsd.models import load_model, load_tokenizer
    from opsd.precision import resolve

    cfg = load_config(args.config, [*flag_overrides(args, SFT_FLAGS), *args.overrides], schema=SFTConfig)
    d, o = cfg.data, cfg.optim
    rep = load_examples(
        d.path, problem_key=d.problem_key, solution_key=d.solution_key, split=d.split, target_key=d.target_key
    )
    examples = [replace(ex, solution=ex.target) if ex.target is not None else ex for ex in rep.examples]
    tok = load_tokenizer(cfg.model.path)
    device = resolve_device(cfg.device)
    prec = resolve(cfg.model.dtype, device, full_finetune=True, pure_bf16=cfg.model.pure_bf16)
    print(f"precision: {prec.describe()}", file=sys.stderr)
    model = load_model(cfg.model.path, dtype=prec.storage, device=str(device))
    pairs = sft_pairs_from_examples(
        tok, examples, instruction=d.instruction, enable_thinking=d.student_thinking, max_len=d.max_len
    )
    torch.manual_seed(cfg.seed)
    losses = sft(
        model,
        pairs,
        steps=o.max_steps,
        lr=o.lr,
        batch_size=o.batch_size,
        seed=cfg.seed,
        pad_id=tok.pad_token_id or 0,
        warmup=o.warmup_steps,
        schedule=o.scheduler,
        min_lr_ratio=o.min_lr_ratio,
        grad_clip=o.grad_clip,
        weight_decay=o.weight_decay,
        autocast_dtype=prec.compute if prec.mixed else None,
        plan=resolve_plan(cfg.cpu, device, prec.compute),
    )
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(
        f"sft: {len(pairs)} rows, {o.max_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved {out}"
    )
    return 0
