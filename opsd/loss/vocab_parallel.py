"""The loss over logits sharded by vocabulary across a tensor-parallel group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from opsd.errors import UserError
from opsd.loss.reference import check_logits, compute_dtype, pointwise
from opsd.loss.spec import DistillSpec


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group whose backward all-reduces the cotangent.

    The softmax normalizer of every shard depends on every other shard, so each rank's
    input receives gradient from all ranks' losses. An identity backward here drops the
    other ranks' share and undercounts the normalizer's gradient by about 1/TP.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _AllReduceReplicated(torch.autograd.Function):
    """Sum over the group whose output every rank holds as its own copy of the loss.

    Each rank backpropagates its own replica, so the cotangent already covers the local
    shard's share: the backward is the identity (an all-reduce would count it TP times).
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


def _plain_all_reduce(x: Tensor, group) -> Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _vp_log_softmax(x: Tensor, group) -> Tensor:
    """log_softmax over a vocabulary split across the group; differentiable through all shards."""
    m = x.detach().max(-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    local = (x - m).exp().sum(-1, keepdim=True)
    total = _AllReduceSum.apply(local, group) if x.requires_grad else _plain_all_reduce(local, group)
    return x - m - total.log()


def vocab_parallel_distill(
    student_logits: Tensor,
    teacher_logits: Tensor,
    weights: Tensor | None = None,
    spec: DistillSpec = DistillSpec(),
    *,
    group=None,
) -> Tensor:
    """JSD_beta over logits ``[N, V/TP]`` sharded by vocabulary; every rank returns the full loss.

    Only ``mode="jsd"``. Entry clipping is local to each shard; token clipping is applied to the
    all-reduced sum.
    """
    if spec.mode != "jsd":
        raise UserError(f"vocab_parallel_distill supports mode='jsd' only, got {spec.mode!r}")
    check_logits(student_logits, teacher_logits, None, spec.mode)
    dtype = compute_dtype(student_logits)
    log_s = _vp_log_softmax(student_logits.to(dtype) / spec.temperature, group)
    with torch.no_grad():
        log_p = _vp_log_softmax(teacher_logits.to(dtype) / spec.temperature, group)
    ell = pointwise(log_s, log_p, spec.beta)
    local = ell.clamp(max=spec.clip).sum(-1) if spec.clip_mode == "entry" else ell.sum(-1)
    rows = _AllReduceReplicated.apply(local, group)
    if spec.clip_mode == "token":
        rows = rows.clamp(max=spec.clip)
    if weights is None:
        return rows.mean()
    return (rows * weights.to(dtype)).sum()
