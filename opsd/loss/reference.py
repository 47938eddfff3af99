"""The oracle: the loss by autograd over full ``[N, V]`` logits, written to be read.

The fused and vocab-parallel losses are tested against it; it holds every logit at once, so
training does not use it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from opsd.loss.spec import DistillSpec

F = TypeVar("F", bound=Callable)


def kernel_precision(fn: F) -> F:
    """Run a loss kernel in the precision it chooses itself, on its first argument's device: autocast
    off (one process's bf16 mixed precision must not turn its products into bf16 ones), and on CUDA
    bf16 products accumulated in float32 rather than with reduced-precision reductions."""

    @functools.wraps(fn)
    def wrapper(first: Tensor, *args, **kwargs):
        # The flag governs CUDA's products only: set and restored on every device, it changes
        # nothing on a CPU.
        matmul = torch.backends.cuda.matmul
        prev = matmul.allow_bf16_reduced_precision_reduction
        try:
            matmul.allow_bf16_reduced_precision_reduction = False
            with torch.autocast(first.device.type, enabled=False):
                return fn(first, *args, **kwargs)
        finally:
            matmul.allow_bf16_reduced_precision_reduction = prev

    return wrapper  # type: ignore[return-value]


def working_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (fp32, bf16, fp16) is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def pointwise(log_s: Tensor, log_p: Tensor, beta: float) -> Tensor:
    """Per-entry terms whose vocabulary sum is ``JSD_beta`` (autograd friendly)."""
    if beta == 0.0:
        return log_p.exp() * (log_p - log_s)
    if beta == 1.0:
        return log_s.exp() * (log_s - log_p)
    log_m = torch.logaddexp(log_s + math.log(1 - beta), log_p + math.log(beta))
    return beta * log_p.exp() * (log_p - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)


def clip_rows(ell: Tensor, clip_mode: str, clip: float) -> Tensor:
    """Vocabulary-summed, clipped divergence per row.

    ``scale`` keeps the value and scales the row's gradient by ``min(1, clip / D)``: the row is
    ``c D + stopgrad((1 - c) D)`` with ``c`` a constant, whose value is ``D`` and whose gradient is
    ``c dD``."""
    if clip_mode == "entry":
        return ell.clamp(max=clip).sum(-1)
    rows = ell.sum(-1)
    if clip_mode == "token":
        return rows.clamp(max=clip)
    if clip_mode == "scale":
        c = token_scale(rows.detach(), clip)
        return c * rows + ((1 - c) * rows).detach()
    return rows


def token_scale(rows: Tensor, clip: float) -> Tensor:
    """``min(1, clip / D)`` per row: the factor ``clip_mode="scale"`` puts on a token's gradient, so
    its step along its own divergence's gradient is at most what a divergence of ``clip`` takes."""
    return torch.where(rows > clip, clip / rows, torch.ones_like(rows))


def check_logits(zs: Tensor, zt: Tensor, targets: Tensor | None, mode: str) -> None:
    if zs.dim() != 2 or zt.dim() != 2:
        raise ValueError(
            f"logits must be [N, V], got student {tuple(zs.shape)} and teacher {tuple(zt.shape)}"
        )
    if zs.shape[0] != zt.shape[0]:
        raise ValueError(f"student has {zs.shape[0]} rows but teacher has {zt.shape[0]}")
    if zs.shape[1] != zt.shape[1]:
        raise ValueError(f"vocab size mismatch: student V={zs.shape[1]}, teacher V={zt.shape[1]}")
    if mode == "sampled" and (targets is None or targets.shape != zs.shape[:1]):
        raise ValueError(f"mode='sampled' needs targets of shape [{zs.shape[0]}] (the sampled token ids)")


def per_token_loss_dense(
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor | None = None,
    spec: DistillSpec = DistillSpec(),
) -> Tensor:
    """``[N]`` per-token losses from ``[N, V]`` logits, by autograd."""
    check_logits(student_logits, teacher_logits, targets, spec.mode)
    spec.check_vocab(student_logits.shape[-1])
    dtype = working_dtype(student_logits)
    a = student_logits.to(dtype) / spec.temperature
    b = teacher_logits.detach().to(dtype) / spec.temperature
    return DENSE[spec.mode](a, b, targets, spec)


def floor_end(log_s: Tensor, log_p: Tensor, end_ids: tuple[int, ...]) -> Tensor:
    """The teacher's log-probabilities with each end token's probability raised to the student's where
    it is lower, every other entry scaled by one factor so that it stays a distribution
    (``loss.end_token=floor``).

    Why: a teacher that reads the solution and sees the student's answer is wrong would rather go on
    and correct it; the student, without the solution, can only learn that as not stopping. With the
    floor the loss never pushes an end logit of the student down (its gradient is <= 0 on every token
    for every beta and every clip but entry, tests/loss/test_loss_descent.py); where the teacher would
    end more, it still pulls. The student's probabilities are a constant of the target: no gradient
    flows through them. Written in probabilities; the kernel's, in log space:
    :func:`opsd.loss.kernels._floor_end`.
    """
    if not end_ids:
        return log_p
    ends = list(end_ids)
    s, p = log_s.detach().exp(), log_p.exp()
    end = torch.maximum(s[:, ends], p[:, ends])
    floored = p * ((1 - end.sum(-1)) / (1 - p[:, ends].sum(-1)))[:, None]
    floored[:, ends] = end
    return floored.log()


def _dense_divergence(a: Tensor, b: Tensor, targets: Tensor | None, spec: DistillSpec) -> Tensor:
    log_s = a.log_softmax(-1)
    log_p = floor_end(log_s, b.log_softmax(-1), spec.end_ids)
    return clip_rows(pointwise(log_s, log_p, spec.beta), spec.clip_mode, spec.clip)


def _dense_topk(a: Tensor, b: Tensor, targets: Tensor | None, spec: DistillSpec) -> Tensor:
    idx = b.topk(spec.topk, dim=-1).indices
    return _dense_divergence(a.gather(-1, idx), b.gather(-1, idx), targets, spec)


def _dense_sampled(a: Tensor, b: Tensor, targets: Tensor, spec: DistillSpec) -> Tensor:
    ls_y = a.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    lp_y = b.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return -(lp_y - ls_y).detach() * ls_y


# The loss modes' references, one per entry of opsd.loss.kernels.KERNELS: ``(a, b, targets, spec) -> [N]``
# per-token losses from tempered logits, by autograd.
DENSE = {"jsd": _dense_divergence, "topk": _dense_topk, "sampled": _dense_sampled}


def distill_loss_dense(
    student_logits: Tensor,
    teacher_logits: Tensor,
    weights: Tensor | None = None,
    targets: Tensor | None = None,
    spec: DistillSpec = DistillSpec(),
) -> Tensor:
    """Weighted sum of :func:`per_token_loss_dense`; a plain mean when ``weights`` is None."""
    rows = per_token_loss_dense(student_logits, teacher_logits, targets, spec)
    if weights is None:
        return rows.mean()
    keep = weights != 0  # masked rows can hold anything, even non-finite logits
    return torch.where(keep, rows, torch.zeros_like(rows)).mul(weights.to(rows.dtype)).sum()
