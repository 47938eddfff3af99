"""The chunk kernels: a chunk of tempered logits ``a = z_s / T``, ``b = z_t / T`` to its loss, its
gradient ``d(sum_n w_n L_n) / da`` and its statistics, one kernel per loss mode (:data:`KERNELS`).

:func:`opsd.loss.fused.fused_linear_distill` makes the logits a chunk at a time and calls these; the
precision notes are in ``opsd/loss/fused.py``'s docstring.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from opsd.loss.overlap import topk_overlap_mass
from opsd.loss.reference import token_scale
from opsd.loss.spec import DistillSpec, LossStats


def chunk_log_probs(
    a: Tensor,
    b: Tensor,
    spec: DistillSpec,
    with_stats: bool,
    y: Tensor | None = None,
    lp: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, LossStats]:
    """``log S``, ``log P`` and the chunk's stats so far (its top-1 agreement and top-16 overlap mass,
    :func:`opsd.loss.overlap.topk_overlap_mass`); ``lp``, if given, is
    filled with ``log S(y)`` over the full vocabulary (the rollout log-prob check's tokens ``y``).

    Over the full vocabulary they are written into ``a`` and ``b``, which the caller does not read
    again: two ``[c, V]`` blocks fewer, the same values as ``log_softmax``; the entropies are left to
    the kernel, which has ``S`` and ``P`` at hand (:func:`chunk_entropies`). For ``mode="topk"`` they are
    over the teacher's top-k (with its indices), and the entropies, over the full vocabulary, are
    taken here.

    The agreement reads ``max(-1).indices`` rather than ``argmax``: the same first maximal index, and
    2.5x faster on a ``[256, 49152]`` float32 block on a CPU (3.3 against 8.4 ms when this was written).
    """
    stats = LossStats(tokens=float(a.shape[0]))
    if with_stats:
        stats.agree = (a.max(-1).indices == b.max(-1).indices).sum()
    if spec.mode == "topk":
        if lp is not None:
            lp.copy_(a.gather(-1, y[:, None]).squeeze(-1) - a.logsumexp(-1))
        idx = b.topk(spec.topk, dim=-1).indices
        if with_stats:
            full_s, full_p = a.log_softmax(-1), b.log_softmax(-1)
            chunk_entropies(stats, full_s, full_p)
            stats.overlap = topk_overlap_mass(full_s, full_p).sum()
        return a.gather(-1, idx).log_softmax(-1), b.gather(-1, idx).log_softmax(-1), idx, stats
    log_s = torch.log_softmax(a, -1, out=a)
    if lp is not None:  # read off log S: no logsumexp pass of its own
        lp.copy_(log_s.gather(-1, y[:, None]).squeeze(-1))
    log_p = torch.log_softmax(b, -1, out=b)
    if with_stats:
        stats.overlap = topk_overlap_mass(log_s, log_p).sum()
    return log_s, log_p, None, stats


def chunk_entropies(
    stats: LossStats, log_s: Tensor, log_p: Tensor, s: Tensor | None = None, p: Tensor | None = None
) -> None:
    """The chunk's summed entropies, from ``S`` and ``P`` when the kernel has them (no second ``exp``)."""
    s = log_s.exp() if s is None else s
    p = log_p.exp() if p is None else p
    stats.entropy_student = -torch.linalg.vecdot(s, log_s).sum()  # on the device: no sync
    stats.entropy_teacher = -torch.linalg.vecdot(p, log_p).sum()


def _floor_end(log_s: Tensor, log_p: Tensor, end_ids: tuple[int, ...]) -> None:
    """:func:`opsd.loss.reference.floor_end` in log space, in place on ``log_p``: each end entry the
    larger of the two, the others gaining ``log(1 - m_f) - log(1 - m_p)`` (``m_p`` the teacher's end
    mass, ``m_f`` the floored one). ``m_f`` is held below ``1 - eps`` (the end entries scaled down to
    it) so that the others keep a finite log-probability, and rows whose teacher already ends with
    probability ``1 - eps`` are left as they are: a student that sure of ending has nothing to lose."""
    ends = torch.tensor(end_ids, device=log_p.device)
    end_p = log_p.index_select(-1, ends)
    end_f = torch.maximum(log_s.index_select(-1, ends), end_p)
    near_one = math.log1p(-torch.finfo(log_p.dtype).eps)
    m_p = end_p.logsumexp(-1)
    m_raw = end_f.logsumexp(-1)
    m_f = m_raw.clamp_max(near_one)
    change = (m_raw > m_p) & (m_p < near_one)
    rest = torch.where(change, torch.log(-torch.expm1(m_f)) - torch.log(-torch.expm1(m_p)), 0.0)
    log_p.add_(rest[:, None])
    log_p[:, ends] = torch.where(change[:, None], end_f + (m_f - m_raw)[:, None], end_p)


# ---------------------------------------------------------------------------------------------
# Divergence kernel (mode "jsd" and "topk").
#
# With per-entry terms ell_i summed into L and g_i = dL/dS_i, the softmax Jacobian gives
#     dL/da = S * (g - <S, g>),
# so each divergence needs only its g. Clipped entries have g_i = 0 (their term is the constant
# tau); a clipped token has no gradient at all. Each helper below works in place on buffers the
# kernel no longer needs, to touch each [c, V] block as few times as possible.


def _grad_forward_kl(s: Tensor, p: Tensor, drop: Tensor | None) -> Tensor:
    """``dL/da`` for ``L = sum_i P_i (log P_i - log S_i)`` (beta = 0); overwrites ``s`` and ``p``.

    ``g_i = -P_i / S_i`` on kept entries (``drop`` marks the clipped ones), so
    ``S (g - <S, g>) = S <q> - q`` with ``q = P`` zeroed where dropped; without entry clipping
    ``<q> = sum P = 1`` and it is ``S - P``.
    """
    if drop is None:
        return s.sub_(p)
    q = p.masked_fill_(drop, 0.0)
    return s.mul_(q.sum(-1, keepdim=True)).sub_(q)


def _grad_reverse_kl(s: Tensor, d: Tensor, rows: Tensor, drop: Tensor | None) -> Tensor:
    """``dL/da`` for ``L = sum_i S_i d_i`` with ``d = log S - log P`` (beta = 1); overwrites ``d``.

    ``g_i = d_i + 1`` on kept entries. Without entry clipping the ``+1`` cancels (``sum S = 1``)
    and ``<S, d>`` is the row's divergence ``rows``: ``S (d - rows)``.
    """
    if drop is None:
        return d.sub_(rows[:, None]).mul_(s)
    g = d.add_(1.0).masked_fill_(drop, 0.0)
    return g.sub_(torch.linalg.vecdot(s, g)[:, None]).mul_(s)


def _grad_mixture(s: Tensor, d_s: Tensor, drop: Tensor | None, beta: float) -> Tensor:
    """``dL/da`` for ``JSD_beta``, ``M = (1-beta) S + beta P``, ``d_s = log S - log M``; overwrites ``d_s``.

    ``L = beta KL(P||M) + (1-beta) KL(S||M)``, so ``dL/dS_j = (1-beta) (d_s,j + 1)`` from the
    ``S log S`` term minus ``(1-beta) (beta P_j + (1-beta) S_j) / M_j = (1-beta)`` through ``M``:
    ``g = (1-beta) d_s`` (zero on entries ``drop`` marks clipped), and
    ``dL/da = (1-beta) S (g' - <S, g'>)`` with ``g' = d_s`` zeroed where dropped.
    """
    g = d_s if drop is None else d_s.masked_fill_(drop, 0.0)
    return g.sub_(torch.linalg.vecdot(s, g)[:, None]).mul_(s).mul_(1 - beta)


def _terms(f: Tensor, d: Tensor, entry: bool, *, overwrite_d: bool = False) -> tuple[Tensor | None, Tensor]:
    """Per-entry terms ``f * d`` (only kept when entry clipping needs them) and their row sums.
    ``overwrite_d``: the terms are written into ``d`` (one ``[c, V]`` block fewer)."""
    if entry:
        ell = d.mul_(f) if overwrite_d else f * d
        return ell, ell.sum(-1)
    return None, torch.linalg.vecdot(f, d)


def _clip(
    ell: Tensor | None, raw: Tensor, spec: DistillSpec, stats: LossStats
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Clipped per-row losses, the clipped-entry mask (entry clipping), each row's gradient factor
    (token clipping: 1 kept, 0 clipped; scale: ``min(1, clip / D)``, the loss left unclipped).

    The entry mask marks what is dropped (``not ell <= clip``: a NaN term counts as clipped), so the
    gradient zeroes those entries in place with it; multiplying by a kept-entry mask made a float
    ``[c, V]`` copy of the mask first."""
    if spec.clip_mode == "entry":
        drop = (ell <= spec.clip).logical_not_()
        stats.clipped = drop.sum()
        stats.clip_total = float(ell.numel())
        return ell.masked_fill_(drop, spec.clip).sum(-1), drop, None  # ell is not needed any more
    if spec.clip_mode == "token":
        token_keep = raw <= spec.clip
        stats.clipped = (~token_keep).sum()
        stats.clip_total = float(raw.numel())
        return raw.clamp(max=spec.clip), None, token_keep
    if spec.clip_mode == "scale":
        stats.clipped = (raw > spec.clip).sum()
        stats.clip_total = float(raw.numel())
        return raw, None, token_scale(raw, spec.clip)
    return raw, None, None


def _divergence_chunk(
    a: Tensor,
    b: Tensor,
    y: Tensor | None,
    w: Tensor,
    spec: DistillSpec,
    *,
    need_grad: bool,
    with_stats: bool,
    lp: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, LossStats]:
    """Loss ``sum_n w_n L_n``, its gradient with respect to the student logits, and stats for one chunk.

    ``L_n = JSD_beta`` between ``S = softmax(a)`` and ``P = softmax(b)`` (over the teacher's top-k
    for ``mode="topk"``; the other entries get no gradient), clipped per ``spec.clip_mode``. The
    sampled tokens ``y`` are read only to fill ``lp`` (:func:`chunk_log_probs`).
    """
    log_s, log_p, idx, stats = chunk_log_probs(a, b, spec, with_stats, y, lp)
    if spec.end_ids:
        _floor_end(log_s, log_p, spec.end_ids)
    beta, entry = spec.beta, spec.clip_mode == "entry"
    s = log_s.exp()
    p = log_p.exp() if beta != 1.0 else None
    if with_stats and idx is None:
        chunk_entropies(stats, log_s, log_p, s, p)
    # In place where a block is not read again: the chunk's peak memory is its count of [c, V] blocks.
    if beta == 0.0:  # ell = P (log P - log S)
        d = log_p.sub_(log_s)
        ell, raw = _terms(p, d, entry, overwrite_d=True)
    elif beta == 1.0:  # ell = S (log S - log P)
        d = log_s.sub_(log_p)
        ell, raw = _terms(s, d, entry)
    else:  # ell = beta P (log P - log M) + (1-beta) S (log S - log M)
        log_m = torch.lerp(s, p, beta).clamp_min_(torch.finfo(s.dtype).tiny).log_()
        d_p = log_p.sub_(log_m)  # log_p is not needed any more
        d_s = log_s.sub_(log_m)
        del log_m
        if entry:
            ell = (p * d_p).mul_(beta).add_(s * d_s, alpha=1 - beta)
            raw = ell.sum(-1)
        else:
            ell, raw = None, beta * torch.linalg.vecdot(p, d_p) + (1 - beta) * torch.linalg.vecdot(s, d_s)
    stats.divergence = raw.sum()
    rows, drop, row_factor = _clip(ell, raw, spec, stats)
    del ell
    loss = (rows * w).sum()
    if not need_grad:
        return loss, None, stats

    if beta == 0.0:
        grad = _grad_forward_kl(s, p, drop)
    elif beta == 1.0:
        grad = _grad_reverse_kl(s, d, raw, drop)
    else:
        grad = _grad_mixture(s, d_s, drop, beta)
    scale = w[:, None] * (1.0 / spec.temperature)
    if row_factor is not None:
        scale = scale * row_factor[:, None]
    grad.mul_(scale)
    if idx is not None:
        grad = torch.zeros_like(a).scatter_(-1, idx, grad)
    return loss, grad, stats


# ---------------------------------------------------------------------------------------------
# Sampled-token kernel (mode "sampled").


def grad_sampled(s: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """``dL/da`` for the surrogate ``L = -A log S(y)`` with the advantage ``A`` a constant; overwrites ``s``.

    ``d log S(y) / da = onehot(y) - S``, so ``dL/da = A (S - onehot(y))``; ``c = A w / T`` per row
    already carries the weight and the temperature.
    """
    return s.mul_(c).scatter_add_(-1, y, -c)


def _sampled_chunk(
    a: Tensor,
    b: Tensor,
    y: Tensor,
    w: Tensor,
    spec: DistillSpec,
    *,
    need_grad: bool,
    with_stats: bool,
    lp: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, LossStats]:
    """Loss, gradient and stats of the sampled-token estimator for one chunk.

    With ``A = log P(y) - log S(y)`` held constant, ``L = -A log S(y)``; its expectation over
    ``y ~ S`` has the reverse-KL gradient. ``stats.divergence`` sums ``log S(y) - log P(y)``.
    """
    log_s, log_p, _, stats = chunk_log_probs(a, b, spec, with_stats, y, lp)
    if with_stats:
        chunk_entropies(stats, log_s, log_p)
    y = y[:, None]
    ls_y = log_s.gather(-1, y)
    adv = log_p.gather(-1, y) - ls_y
    rows = (-adv * ls_y).squeeze(-1)
    stats.divergence = -adv.sum()
    loss = (rows * w).sum()
    if not need_grad:
        return loss, None, stats
    return loss, grad_sampled(log_s.exp_(), y, adv * w[:, None] * (1.0 / spec.temperature)), stats


# ---------------------------------------------------------------------------------------------
# The loss modes, one chunk kernel each: ``(a, b, y, w, spec, *, need_grad, with_stats, lp) -> (sum_n w_n
# L_n, dL/da or None, stats)`` for tempered logits ``a``, ``b`` and sampled tokens ``y``; ``lp``, when
# given, gets ``log S(y)`` over the full vocabulary. A new mode is a kernel and an entry here, a dense
# reference in ``reference.DENSE`` and its name and option checks in ``spec.py`` (docs/architecture.md).

KERNELS = {"jsd": _divergence_chunk, "topk": _divergence_chunk, "sampled": _sampled_chunk}
