"""Supervised fine-tuning on (prompt, response) token pairs: the SFT baseline and the demo's base model.

Cross-entropy on response tokens only. Logits are made a chunk of rows at a time under activation
checkpointing, so no ``[tokens, vocab]`` tensor for a whole batch is ever held.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from opsd.teacher import final_hidden, head_weight, pad_right, response_positions


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
    min_lr_ratio: float = 0.0,
    progress: bool = True,
    desc: str = "sft",
    callback: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place on random batches of ``pairs``; returns the per-step mean token loss.

    One call is one schedule (warmup, then cosine to ``min_lr_ratio * lr`` over ``steps``). To look at
    the model part way, pass ``callback(step, loss)`` (called after every step) rather than calling
    ``sft`` in pieces: each call restarts the warmup and the decay.
    """
    if not pairs:
        raise ValueError("sft: no (prompt, response) pairs to train on")
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
        ),
    )
    rng = random.Random(seed)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False, file=sys.stderr, unit="step")
    for step in bar:
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        seqs = [p + r for p, r in batch]
        ids, mask = pad_right(seqs, pad_id, device)
        resp = [len(r) for _, r in batch]
        pos = response_positions([len(s) for s in seqs], resp, ids.shape[1])
        targets = torch.tensor([t for _, r in batch for t in r], device=device)
        hidden = final_hidden(model, ids, mask, pos)
        loss = chunked_cross_entropy(hidden, head_weight(model), targets) / len(targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
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
# `opsd sft`: problem -> solution with the training chat template, full fine-tuning.


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="HF name, local dir, or a short name from `opsd fetch-model`"
    )
    p.add_argument("--data", required=True, help="JSONL/JSON/Parquet/CSV with problem and solution fields")
    p.add_argument("--out", required=True, type=Path, help="where to save the fine-tuned model (HF format)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--problem-key", default="problem")
    p.add_argument("--solution-key", default="solution")
    p.add_argument("--max-len", type=int, default=2048, help="prompt + response tokens; longer rows are cut")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)


def run_sft(args: argparse.Namespace) -> int:
    from opsd.data import DEFAULT_INSTRUCTION, load_examples, student_prompt_ids
    from opsd.models import load_model, load_tokenizer

    if args.steps < 1:
        print(f"opsd sft: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    try:
        rep = load_examples(args.data, problem_key=args.problem_key, solution_key=args.solution_key)
        tok = load_tokenizer(args.model)
        model = load_model(
            args.model, dtype=args.dtype, device="cuda" if torch.cuda.is_available() else "cpu"
        )
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"opsd sft: {e}", file=sys.stderr)
        return 1
    pairs = []
    for ex in rep.examples:
        prompt, _ = student_prompt_ids(tok, ex.problem, instruction=DEFAULT_INSTRUCTION)
        resp = tok.encode(ex.solution, add_special_tokens=False) + [tok.eos_token_id]
        pairs.append(
            (prompt, resp)
            if len(prompt) + len(resp) <= args.max_len
            else (prompt, resp[: max(1, args.max_len - len(prompt))])
        )
    losses = sft(
        model,
        pairs,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        pad_id=tok.pad_token_id or 0,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(
        f"sft: {len(pairs)} rows, {args.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved {args.out}"
    )
    return 0
