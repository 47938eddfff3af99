"""Distillation losses between a student and a teacher next-token distribution.

Conventions (shared with the seed PR, the reference code and TRL):

* ``S = softmax(z_s / T)``, ``P = softmax(z_t / T)``; the teacher is always a constant.
* ``mode="jsd"`` with ``beta`` in [0, 1]: ``M = (1-beta) S + beta P`` and
  ``JSD_beta = beta KL(P||M) + (1-beta) KL(S||M)``. The endpoints are special cases:
  ``beta=0`` is forward ``KL(P||S)``, ``beta=1`` is reverse ``KL(S||P)``.
* ``mode="topk"``: the same divergence over the teacher's top-k entries, both distributions
  renormalized over them. Entries outside the top-k get no gradient.
* ``mode="sampled"``: the sampled-token estimator. With ``A = log P(y) - log S(y)`` detached,
  ``loss = -A log S(y)``; its gradient is ``-A (onehot(y) - S) / T``.

Clipping (``clip_mode`` with value ``clip = tau``), and what it does to the gradient:

* ``"entry"`` (reference code): every vocabulary entry's pointwise term ``l_i`` is clamped at
  ``tau`` before the vocabulary sum. An entry with ``l_i > tau`` contributes ``tau`` and no
  gradient; the others keep theirs. Because forward-KL terms ``P_i log(P_i/S_i)`` can be
  negative, the clipped per-token loss can be negative.
* ``"token"`` (seed PR): the vocabulary-summed divergence is clamped at ``tau``. A token whose
  divergence exceeds ``tau`` contributes ``tau`` and exactly zero gradient.
* ``"none"``.

Reduction is expressed by per-token ``weights``: ``loss = sum_n w_n L_n``. Use
:func:`token_weights` so that gradient accumulation and data parallelism give the gradient
of one big batch (weights normalized by the *global* token or sequence count).

Three implementations:

* :func:`distill_loss_dense` -- autograd over ``[N, V]`` logits, the readable reference.
* :func:`fused_linear_distill` -- what training uses: takes final hidden states and lm_head
  weights, walks rows in chunks, never holds more than one chunk of logits per model, and
  computes analytic gradients (no autograd graph over ``[N, V]``).
* :func:`vocab_parallel_distill` -- logits sharded over a tensor-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

MODES = ("jsd", "topk", "sampled")
CLIP_MODES = ("none", "entry", "token")


def check_loss_args(
    *,
    mode: str = "jsd",
    beta: float = 0.0,
    temperature: float = 1.0,
    clip_mode: str = "none",
    clip: float = 0.0,
    topk: int = 0,
    vocab_size: int | None = None,
) -> None:
    """Reject settings that make no sense before any compute is spent on them."""
    if mode not in MODES:
        raise ValueError(f"loss mode must be one of {MODES}, got {mode!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    if clip_mode != "none" and not clip >= 0:
        raise ValueError(f"clip must be >= 0 when clip_mode={clip_mode!r}, got {clip}")
    if mode == "sampled" and clip_mode != "none":
        raise ValueError("clip_mode must be 'none' for mode='sampled' (there is no per-entry divergence)")
    if mode == "topk":
        if topk < 1:
            raise ValueError(f"topk must be >= 1 for mode='topk', got {topk}")
        if vocab_size is not None and topk > vocab_size:
            raise ValueError(f"topk={topk} exceeds the vocabulary size V={vocab_size}")


def token_weights(
    mask: Tensor,
    *,
    reduction: str = "token",
    global_tokens: float | None = None,
    global_sequences: float | None = None,
) -> Tensor:
    """Per-token weights for ``mask [B, L]`` so that summed micro-batch losses give a global mean.

    ``token``: every response token in the optimizer step weighs ``1 / global_tokens``.
    ``sequence``: each sequence's tokens average first, then sequences weigh ``1 / global_sequences``.
    Without global counts the micro-batch's own counts are used.
    """
    mask = mask.float()
    if reduction == "token":
        denom = global_tokens if global_tokens is not None else mask.sum().clamp_min(1).item()
        return mask / denom
    if reduction == "sequence":
        per_seq = mask.sum(-1, keepdim=True).clamp_min(1)
        denom = global_sequences if global_sequences is not None else float((mask.sum(-1) > 0).sum().clamp_min(1))
        return mask / per_seq / denom
    raise ValueError(f"reduction must be 'token' or 'sequence', got {reduction!r}")


@dataclass
class LossStats:
    """Sums over tokens, so micro-batches and ranks can be added before dividing."""

    tokens: float = 0.0
    divergence: float = 0.0  # unclipped per-token divergence (sampled: log S(y) - log P(y))
    clipped: float = 0.0  # clipped tokens (token mode) or entries (entry mode)
    clip_total: float = 0.0  # what ``clipped`` is a fraction of
    entropy_student: float = 0.0
    entropy_teacher: float = 0.0
    agree: float = 0.0  # teacher and student top-1 agree

    def add(self, other: LossStats) -> LossStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_tensor(self) -> Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: Tensor) -> LossStats:
        return cls(*[float(x) for x in t.tolist()])

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "divergence": self.divergence / n,
            "clip_frac": self.clipped / max(self.clip_total, 1.0),
            "entropy_student": self.entropy_student / n,
            "entropy_teacher": self.entropy_teacher / n,
            "agreement": self.agree / n,
        }


# ---------------------------------------------------------------------------------------------
# Pointwise terms, shared by the dense and vocab-parallel paths (autograd friendly).


def _pointwise(log_s: Tensor, log_p: Tensor, beta: float) -> Tensor:
    """Per-entry terms whose vocabulary sum is the divergence."""
    if beta == 0.0:
        return log_p.exp() * (log_p - log_s)
    if beta == 1.0:
        return log_s.exp() * (log_s - log_p)
    log_m = torch.logaddexp(log_s + math.log(1 - beta), log_p + math.log(beta))
    return beta * log_p.exp() * (log_p - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)


def _clip_rows(ell: Tensor, clip_mode: str, clip: float) -> Tensor:
    """Vocabulary-summed, clipped divergence per row."""
    if clip_mode == "entry":
        return ell.clamp(max=clip).sum(-1)
    rows = ell.sum(-1)
    return rows.clamp(max=clip) if clip_mode == "token" else rows


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def per_token_loss_dense(
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor | None = None,
    *,
    mode: str = "jsd",
    beta: float = 0.0,
    temperature: float = 1.0,
    clip_mode: str = "none",
    clip: float = 0.0,
    topk: int = 0,
) -> Tensor:
    """``[N]`` per-token losses from ``[N, V]`` logits, by autograd. The readable reference."""
    _check_logits(student_logits, teacher_logits, targets, mode)
    check_loss_args(
        mode=mode, beta=beta, temperature=temperature, clip_mode=clip_mode, clip=clip, topk=topk,
        vocab_size=student_logits.shape[-1],
    )
    dtype = _compute_dtype(student_logits)
    a = student_logits.to(dtype) / temperature
    b = teacher_logits.detach().to(dtype) / temperature
    if mode == "topk":
        idx = b.topk(topk, dim=-1).indices
        a, b = a.gather(-1, idx), b.gather(-1, idx)
    log_s, log_p = a.log_softmax(-1), b.log_softmax(-1)
    if mode == "sampled":
        ls_y = log_s.gather(-1, targets[:, None]).squeeze(-1)
        lp_y = log_p.gather(-1, targets[:, None]).squeeze(-1)
        return -(lp_y - ls_y).detach() * ls_y
    return _clip_rows(_pointwise(log_s, log_p, beta), clip_mode, clip)


def distill_loss_dense(
    student_logits: Tensor,
    teacher_logits: Tensor,
    weights: Tensor | None = None,
    targets: Tensor | None = None,
    **loss_kw,
) -> Tensor:
    """Weighted sum of :func:`per_token_loss_dense`; a plain mean when ``weights`` is None."""
    rows = per_token_loss_dense(student_logits, teacher_logits, targets, **loss_kw)
    if weights is None:
        return rows.mean()
    keep = weights != 0  # masked rows can hold anything, even non-finite logits
    return torch.where(keep, rows, torch.zeros_like(rows)).mul(weights.to(rows.dtype)).sum()


def _check_logits(zs: Tensor, zt: Tensor, targets: Tensor | None, mode: str) -> None:
    if zs.dim() != 2 or zt.dim() != 2:
        raise ValueError(f"logits must be [N, V], got student {tuple(zs.shape)} and teacher {tuple(zt.shape)}")
    if zs.shape[0] != zt.shape[0]:
        raise ValueError(f"student has {zs.shape[0]} rows but teacher has {zt.shape[0]}")
    if zs.shape[1] != zt.shape[1]:
        raise ValueError(f"vocab size mismatch: student V={zs.shape[1]}, teacher V={zt.shape[1]}")
    if mode == "sampled" and (targets is None or targets.shape != zs.shape[:1]):
        raise ValueError(f"mode='sampled' needs targets of shape [{zs.shape[0]}] (the sampled token ids)")


# ---------------------------------------------------------------------------------------------
# Fused linear + chunked loss with analytic gradients: what training uses.


def _chunk_loss_and_grad(
    a: Tensor,
    b: Tensor,
    targets: Tensor | None,
    w: Tensor,
    *,
    mode: str,
    beta: float,
    temperature: float,
    clip_mode: str,
    clip: float,
    topk: int,
    need_grad: bool,
    with_stats: bool,
) -> tuple[Tensor, Tensor | None, LossStats]:
    """Loss, d(sum_n w_n L_n)/d z_s and stats for one chunk of tempered logits ``a = z_s/T``, ``b = z_t/T``.

    The gradient is analytic. With ``g_i = dL/dS_i`` it is ``S (g - <S, g>) / T``: forward KL
    gives ``S - P`` (``S <q> - q`` with ``q = P`` masked by the entry clip), reverse KL
    ``S (d - <S, d>)`` with ``d = log S - log P`` (+1 per kept entry when clipping), and the
    mixture ``g = (1-beta)(log S - log M)``. Clipped entries have ``g_i = 0``; clipped tokens
    have no gradient at all. Written to touch each ``[c, V]`` buffer as few times as possible.
    """
    inv_t = 1.0 / temperature
    stats = LossStats(tokens=float(a.shape[0]))
    idx = None
    if mode == "topk":
        idx = b.topk(topk, dim=-1).indices
    log_s_full, log_p_full = a.log_softmax(-1), b.log_softmax(-1)
    if with_stats:
        stats.entropy_student = float(-torch.linalg.vecdot(log_s_full.exp(), log_s_full).sum())
        stats.entropy_teacher = float(-torch.linalg.vecdot(log_p_full.exp(), log_p_full).sum())
        stats.agree = float((a.argmax(-1) == b.argmax(-1)).sum())
    if idx is not None:
        log_s = a.gather(-1, idx).log_softmax(-1)
        log_p = b.gather(-1, idx).log_softmax(-1)
    else:
        log_s, log_p = log_s_full, log_p_full
    del log_s_full, log_p_full
    s = log_s.exp()
    w_col = w[:, None]

    if mode == "sampled":
        y = targets[:, None]
        ls_y = log_s.gather(-1, y)
        adv = log_p.gather(-1, y) - ls_y
        rows = (-adv * ls_y).squeeze(-1)
        stats.divergence = float(-adv.sum())
        grad = None
        if need_grad:
            grad = s.mul_(adv * w_col * inv_t)
            grad.scatter_add_(-1, y, -adv * w_col * inv_t)
        return (rows * w).sum(), grad, stats

    # Per-entry terms ell = f * d summed over the vocabulary; g is dL/dS before the softmax Jacobian.
    if beta == 0.0:
        p = log_p.exp()
        f, d = p, log_p - log_s  # ell = P (log P - log S)
    elif beta == 1.0:
        f, d = s, log_s - log_p  # ell = S (log S - log P)
    else:
        p = log_p.exp()
        log_m = torch.lerp(s, p, beta).clamp_min_(torch.finfo(s.dtype).tiny).log_()
        d_p = log_p.sub_(log_m)  # log_p is not needed any more
        d_s = log_s.sub_(log_m)
        del log_m
    if 0.0 < beta < 1.0 and clip_mode != "entry":
        raw_rows = beta * torch.linalg.vecdot(p, d_p) + (1 - beta) * torch.linalg.vecdot(s, d_s)
        ell = None
    elif 0.0 < beta < 1.0:
        ell = (p * d_p).mul_(beta).add_(s * d_s, alpha=1 - beta)
        raw_rows = ell.sum(-1)
    elif clip_mode == "entry":
        ell = f * d
        raw_rows = ell.sum(-1)
    else:
        ell = None
        raw_rows = torch.linalg.vecdot(f, d)
    stats.divergence = float(raw_rows.sum())

    keep = None  # entry mask
    token_keep = None
    if clip_mode == "entry":
        keep = ell <= clip
        rows = torch.where(keep, ell, ell.new_tensor(clip)).sum(-1)
        stats.clipped = float(ell.numel() - keep.sum())
        stats.clip_total = float(ell.numel())
    elif clip_mode == "token":
        token_keep = raw_rows <= clip
        rows = raw_rows.clamp(max=clip)
        stats.clipped = float((~token_keep).sum())
        stats.clip_total = float(rows.numel())
    else:
        rows = raw_rows
    del ell

    grad = None
    if need_grad:
        scale = w_col * inv_t
        if token_keep is not None:
            scale = scale * token_keep[:, None]
        if beta == 0.0:
            if keep is None:  # S - P
                grad = s.sub_(p)
            else:  # S <q> - q with q = P on kept entries
                q = p.mul_(keep)
                grad = s.mul_(q.sum(-1, keepdim=True)).sub_(q)
        elif beta == 1.0:
            if keep is None:  # S (d - <S, d>): the +1 of dL/dS cancels because sum S = 1
                grad = d.sub_(raw_rows[:, None]).mul_(s)
            else:
                g = d.add_(1.0).mul_(keep)
                grad = g.sub_(torch.linalg.vecdot(s, g)[:, None]).mul_(s)
        else:
            g = d_s if keep is None else d_s.mul_(keep)
            grad = g.sub_(torch.linalg.vecdot(s, g)[:, None]).mul_(s).mul_(1 - beta)
        grad.mul_(scale)
        if idx is not None:
            grad = torch.zeros_like(a).scatter_(-1, idx, grad)
    return (rows * w).sum(), grad, stats


class _PrecomputedGrad(torch.autograd.Function):
    """Attach gradients computed in the forward pass, so no graph over [N, V] is kept."""

    @staticmethod
    def forward(ctx, loss: Tensor, h: Tensor, weight: Tensor, grad_h: Tensor, grad_w: Tensor | None):
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.has_grad_w = grad_w is not None
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if bool(grad_out == 1):  # the usual loss.backward(): hand over the saved buffers, no [V, H] copy
            return None, grad_h, grad_w if ctx.has_grad_w else None, None, None
        gw = grad_w * grad_out.to(grad_w.dtype) if ctx.has_grad_w else None
        return None, grad_h * grad_out.to(grad_h.dtype), gw, None, None


def auto_chunk_size(vocab_size: int, max_elems: int = 1 << 26) -> int:
    """256 rows per chunk (at most 256 MB per fp32 [rows, V] block); flat in N by construction.

    Each chunk streams the whole ``[V, H]`` head through the matmuls (and reads and writes its
    gradient), so fewer than ~256 rows makes a large-vocabulary loss memory-bound: at the
    Qwen3 shape 32-row chunks ran 2.5x slower than 256-row ones on a 2-core CPU.
    """
    return max(16, min(256, max_elems // vocab_size))


def fused_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    weights: Tensor | None = None,
    targets: Tensor | None = None,
    *,
    mode: str = "jsd",
    beta: float = 0.0,
    temperature: float = 1.0,
    clip_mode: str = "none",
    clip: float = 0.0,
    topk: int = 0,
    chunk_size: int | None = None,
    with_stats: bool = True,
) -> tuple[Tensor, LossStats]:
    """Distillation loss from final hidden states ``[N, H]`` and lm_head weights ``[V, H]``.

    Logits are computed a chunk of rows at a time in float32 (float64 for float64 inputs), so
    peak memory is one ``[chunk, V]`` block per model whatever N is. Gradients for the student
    hidden states (and the student weight, only if it requires grad) are computed analytically
    while walking the chunks; backward just scales them. ``teacher_weight`` may be the very same
    tensor as ``student_weight`` (LoRA teacher with the adapter off). Rows with weight 0 are
    skipped entirely. Returns ``(sum_n w_n L_n, stats)``.
    """
    n, h = student_hidden.shape if student_hidden.dim() == 2 else (None, None)
    if student_hidden.dim() != 2 or teacher_hidden.dim() != 2:
        raise ValueError(
            f"hidden states must be [N, H], got student {tuple(student_hidden.shape)} "
            f"and teacher {tuple(teacher_hidden.shape)}"
        )
    if teacher_hidden.shape[0] != n:
        raise ValueError(f"student has {n} rows but teacher has {teacher_hidden.shape[0]}")
    if student_weight.shape[1] != h or teacher_weight.shape[1] != teacher_hidden.shape[1]:
        raise ValueError(
            f"lm_head weight must be [V, H]: student weight {tuple(student_weight.shape)} vs hidden H={h}, "
            f"teacher weight {tuple(teacher_weight.shape)} vs hidden H={teacher_hidden.shape[1]}"
        )
    vocab = student_weight.shape[0]
    if teacher_weight.shape[0] != vocab:
        raise ValueError(f"vocab size mismatch: student V={vocab}, teacher V={teacher_weight.shape[0]}")
    check_loss_args(
        mode=mode, beta=beta, temperature=temperature, clip_mode=clip_mode, clip=clip, topk=topk, vocab_size=vocab
    )
    if mode == "sampled" and (targets is None or targets.shape != (n,)):
        raise ValueError(f"mode='sampled' needs targets of shape [{n}] (the sampled token ids)")
    if weights is None:
        weights = student_hidden.new_full((n,), 1.0 / max(n, 1), dtype=torch.float32)
    if weights.shape != (n,):
        raise ValueError(f"weights must have shape [{n}], got {tuple(weights.shape)}")

    dtype = _compute_dtype(student_hidden)
    rows = (weights != 0).nonzero().squeeze(-1)
    need_grad_h = torch.is_grad_enabled() and student_hidden.requires_grad
    need_grad_w = torch.is_grad_enabled() and student_weight.requires_grad
    ws = student_weight.detach().to(dtype)
    wt = ws if teacher_weight is student_weight else teacher_weight.detach().to(dtype)
    hs_all = student_hidden.detach()
    ht_all = teacher_hidden.detach()
    w_all = weights.detach().to(dtype)
    grad_h = torch.zeros(n, h, dtype=dtype, device=student_hidden.device) if need_grad_h else None
    grad_w = torch.zeros_like(ws) if need_grad_w else None
    total = torch.zeros((), dtype=dtype, device=student_hidden.device)
    stats = LossStats()
    step = chunk_size or auto_chunk_size(vocab)
    inv_t = 1.0 / temperature
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        hs = hs_all.index_select(0, idx).to(dtype)
        a = (hs * inv_t) @ ws.t()  # tempered logits, one chunk
        b = (ht_all.index_select(0, idx).to(dtype) * inv_t) @ wt.t()
        y = targets.index_select(0, idx) if targets is not None else None
        loss, gz, st = _chunk_loss_and_grad(
            a, b, y, w_all.index_select(0, idx),
            mode=mode, beta=beta, temperature=temperature, clip_mode=clip_mode, clip=clip, topk=topk,
            need_grad=need_grad_h or need_grad_w, with_stats=with_stats,
        )
        del a, b
        total += loss
        stats.add(st)
        if gz is not None:
            if grad_h is not None:
                grad_h.index_copy_(0, idx, gz @ ws)
            if grad_w is not None:
                grad_w.addmm_(gz.t(), hs)
    if not (need_grad_h or need_grad_w):
        return total, stats
    out = _PrecomputedGrad.apply(
        total,
        student_hidden,
        student_weight,
        grad_h.to(student_hidden.dtype) if grad_h is not None else torch.zeros_like(student_hidden),
        grad_w.to(student_weight.dtype) if grad_w is not None else None,
    )
    return out, stats


# ---------------------------------------------------------------------------------------------
# Vocab-parallel: logits sharded over a tensor-parallel group.


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


def _vp_log_softmax(x: Tensor, group) -> Tensor:
    """log_softmax over a vocabulary split across the group; differentiable through all shards."""
    m = x.detach().max(-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    local = (x - m).exp().sum(-1, keepdim=True)
    total = _AllReduceSum.apply(local, group) if x.requires_grad else _plain_all_reduce(local, group)
    return x - m - total.log()


def _plain_all_reduce(x: Tensor, group) -> Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def vocab_parallel_distill(
    student_logits: Tensor,
    teacher_logits: Tensor,
    weights: Tensor | None = None,
    *,
    group=None,
    beta: float = 0.0,
    temperature: float = 1.0,
    clip_mode: str = "none",
    clip: float = 0.0,
) -> Tensor:
    """JSD_beta over logits ``[N, V/TP]`` sharded by vocabulary; every rank returns the full loss.

    Entry clipping is local to each shard; token clipping is applied to the all-reduced sum.
    """
    _check_logits(student_logits, teacher_logits, None, "jsd")
    check_loss_args(mode="jsd", beta=beta, temperature=temperature, clip_mode=clip_mode, clip=clip)
    dtype = _compute_dtype(student_logits)
    log_s = _vp_log_softmax(student_logits.to(dtype) / temperature, group)
    with torch.no_grad():
        log_p = _vp_log_softmax(teacher_logits.to(dtype) / temperature, group)
    ell = _pointwise(log_s, log_p, beta)
    local = ell.clamp(max=clip).sum(-1) if clip_mode == "entry" else ell.sum(-1)
    rows = _AllReduceReplicated.apply(local, group)
    if clip_mode == "token":
        rows = rows.clamp(max=clip)
    if weights is None:
        return rows.mean()
    return (rows * weights.to(dtype)).sum()
