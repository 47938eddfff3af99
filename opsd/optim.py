"""The optimizer and the learning-rate schedule, shared by `opsd train` and `opsd sft`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from opsd.devices import on_cuda

if TYPE_CHECKING:
    from opsd.config import OptimConfig


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR at ``step`` (0-based): linear warmup over ``warmup`` steps, then
    ``constant`` or a ``cosine`` decay from 1 to ``min_ratio`` over the remaining ``total - warmup``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(
    params: list[nn.Parameter], optim: OptimConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its schedule (:func:`lr_factor`) from the ``optim`` section, stepped
    once per optimizer step (``optim.max_steps`` of them).

    Where every parameter is on a CUDA device (FSDP2's DTensors included) AdamW runs fused: one kernel
    per step and dtype instead of the default foreach path's several passes over the parameters,
    moments and gradients. Elsewhere it keeps PyTorch's default (foreach on CPU), whose numbers the
    CPU tests pin."""
    o = optim
    fused = on_cuda(params)
    opt = torch.optim.AdamW(
        params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True if fused else None
    )
    sched = torch.optim.lr_scheduler.LambdaLR(  # a plain function: its state_dict stores nothing of it
        opt,
        lambda s: lr_factor(
            s, warmup=o.warmup_steps, total=o.max_steps, schedule=o.scheduler, min_ratio=o.min_lr_ratio
        ),
    )
    return opt, sched
