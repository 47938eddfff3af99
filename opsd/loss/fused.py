"""The fused linear + chunked loss with analytic gradients: what training uses.

It takes final hidden states and lm_head weights, walks the rows in chunks, never holds more than
one ``[chunk, V]`` block of logits per model, and computes the gradient of each chunk as it goes,
so no autograd graph over ``[N, V]`` exists. Two kernels turn a chunk of tempered logits
``a = z_s / T``, ``b = z_t / T`` into its loss and ``d(sum_n w_n L_n) / da``:
:func:`_divergence_chunk` (``jsd`` and ``topk``) and :func:`_sampled_chunk` (``sampled``).
The gradient with respect to the student logits ``z_s = T a`` is that divided by ``T``.

Precision against the float64 oracle on the same input values (the bounds ``tests/loss/test_loss.py``
holds, each with its error model; measured figures: docs/studies/precision.md, "Loss precision
against the float64 oracle"):

* float32 products (the default): where student and teacher nearly agree, ``S - P`` subtracts two
  nearly equal numbers, so a kept token's gradient carries the float32 rounding of its logits
  divided by ``|log S - log P|``: its error relative to its own size grows like
  ``1/sqrt(divergence)``. Exact logits rounded once to float32 already show it, so it is the floor
  of any kernel fed float32 logits. Taking the logit difference from a matmul of its own
  (``(h_s - h_t) @ W.T``) and the gradient as ``(S + P) tanh(x / 2)`` avoids the cancellation but
  needs one head tensor for student and teacher and slows the elementwise work; it is not done.
* float64 inputs are computed in float64 throughout.
* ``matmul_dtype=torch.bfloat16`` (opt-in): see :func:`fused_linear_distill`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from opsd.loss.overlap import topk_overlap_mass
from opsd.loss.reference import kernel_precision, token_scale, working_dtype
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

# ---------------------------------------------------------------------------------------------


class PrecomputedGrad(torch.autograd.Function):
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


def _check_shapes(
    hs: Tensor,
    ws: Tensor,
    ht: Tensor,
    wt: Tensor,
    weights: Tensor | None,
    targets: Tensor | None,
    spec: DistillSpec,
) -> None:
    if hs.dim() != 2 or ht.dim() != 2:
        raise ValueError(
            f"hidden states must be [N, H], got student {tuple(hs.shape)} and teacher {tuple(ht.shape)}"
        )
    n, h = hs.shape
    if ht.shape[0] != n:
        raise ValueError(f"student has {n} rows but teacher has {ht.shape[0]}")
    if ws.shape[1] != h or wt.shape[1] != ht.shape[1]:
        raise ValueError(
            f"lm_head weight must be [V, H]: student weight {tuple(ws.shape)} vs hidden H={h}, "
            f"teacher weight {tuple(wt.shape)} vs hidden H={ht.shape[1]}"
        )
    if wt.shape[0] != ws.shape[0]:
        raise ValueError(f"vocab size mismatch: student V={ws.shape[0]}, teacher V={wt.shape[0]}")
    spec.check_vocab(ws.shape[0])
    if spec.mode == "sampled" and (targets is None or targets.shape != (n,)):
        raise ValueError(f"mode='sampled' needs targets of shape [{n}] (the sampled token ids)")
    if weights is not None and weights.shape != (n,):
        raise ValueError(f"weights must have shape [{n}], got {tuple(weights.shape)}")


def _same_tensor(x: Tensor, y: Tensor) -> bool:
    """The same values in the same memory (``head.weight.data`` is a new object over the same storage)."""
    if x is y:
        return True
    same_layout = x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
    return same_layout and x.device == y.device and x.data_ptr() == y.data_ptr()


def _logits_bf16(h: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """``h @ w.T`` as two bfloat16 blocks ``hi + lo``, accurate to about 2^-17 of each logit.

    A bf16 product accumulates in float32 but rounds its output to bf16 (2^-9 relative: 0.06 at
    a logit of 30, which swamps a divergence of 1e-4). The second product takes the rounded one as
    its accumulator, ``h @ w.T - hi``: the rounding error, itself rounded only to bf16 of its own
    small size. This relies on the accumulator being added in float32 before the output is
    rounded, which oneDNN and cuBLAS do (the bf16 tests would show it otherwise). The float32 sum
    is taken a slab of rows at a time (:func:`_slab`).
    """
    hi = h @ w.t()
    lo = torch.addmm(hi, h, w.t(), beta=-1)
    return hi, lo


def _head_products(
    h: Tensor, w: Tensor, inv_t: float, matmul_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor | None]:
    """A chunk's logit products: ``((h @ w.T) / T, None)`` in the compute dtype, or bf16 ``(hi, lo)``.

    Student and teacher rows that share a head go through it together: a product's time on a CPU
    grows far less than its rows (bf16 at SmolLM2's head: 512 rows 14.6 ms against 9.7 for 256, the
    second product of :func:`_logits_bf16` 16.6 against 13.8; float32 90 against 51), because each
    product streams the whole ``[V, H]`` head (timed when this was written).
    """
    if matmul_dtype is None:
        return (h * inv_t) @ w.t(), None
    return _logits_bf16(h, w)


def _slab(hi: Tensor, lo: Tensor | None, rows: slice, inv_t: float) -> Tensor:
    """Some rows of :func:`_head_products`' output as tempered logits in the compute dtype.

    The float32 view itself, or for bf16 products the new float32 block ``(hi + lo) / T``."""
    if lo is None:
        return hi[rows]
    return hi[rows].float().add_(lo[rows]).mul_(inv_t)


def _chunk_loss(
    zs: Tensor,
    lo_s: Tensor | None,
    zt: Tensor,
    lo_t: Tensor | None,
    y: Tensor | None,
    w: Tensor,
    lp: Tensor | None,
    spec: DistillSpec,
    inv_t: float,
    *,
    need_grad: bool,
    with_stats: bool,
    slab_elements: int | None,
) -> tuple[Tensor, LossStats, Tensor]:
    """The mode's kernel over one chunk's products (:func:`_head_products`), a slab of rows at a time.

    Returns the chunk's ``sum_n w_n L_n``, its stats and ``dL/dz`` (with ``need_grad``; else ``zs``).
    Several slabs write their gradients over the student's products ``zs``, whose logits each slab has
    spent by then (on the bf16 path rounded to bf16, the dtype of the gradient's product), so the
    gradient takes no block of its own; a single slab in the compute dtype hands over its own block.
    ``slab_elements``: :func:`fused_linear_distill`'s.
    """
    slab = max(1, slab_elements // zs.shape[1]) if slab_elements else zs.shape[0]
    kernel = KERNELS[spec.mode]
    total = zs.new_zeros((), dtype=w.dtype)
    stats = LossStats()
    gz = zs
    for r in range(0, zs.shape[0], slab):
        rows = slice(r, r + slab)
        a = _slab(zs, lo_s, rows, inv_t)
        b = _slab(zt, lo_t, rows, inv_t)
        y_r = y[rows] if y is not None else None
        lp_r = lp[rows] if lp is not None else None
        loss, grad, st = kernel(a, b, y_r, w[rows], spec, need_grad=need_grad, with_stats=with_stats, lp=lp_r)
        total += loss
        stats.add(st)
        if grad is None:
            continue
        if grad.shape == zs.shape and grad.dtype == zs.dtype:
            gz = grad  # one slab (a GPU's, or a short chunk): no copy
        else:
            zs[rows].copy_(grad)
    return total, stats, gz


@kernel_precision
def fused_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    weights: Tensor | None = None,
    targets: Tensor | None = None,
    spec: DistillSpec = DistillSpec(),
    *,
    chunk_size: int | None = None,
    slab_elements: int | None = None,
    with_stats: bool = True,
    matmul_dtype: torch.dtype | None = None,
    target_logprobs: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """Distillation loss from final hidden states ``[N, H]`` and lm_head weights ``[V, H]``.

    Logits are computed a chunk of rows at a time in float32 (float64 for float64 inputs), so
    peak memory is one ``[chunk, V]`` block per model whatever N is. Gradients for the student
    hidden states (and the student weight, only if it requires grad) are computed analytically
    while walking the chunks; backward just scales them. ``teacher_weight`` may be the very same
    tensor as ``student_weight`` (LoRA teacher with the adapter off). Rows with weight 0 are
    skipped entirely; ``weights=None`` means a plain mean. Returns ``(sum_n w_n L_n, stats)``.

    ``matmul_dtype=torch.bfloat16`` computes the matrix products in bf16 (hidden states and
    weights are cast to bf16, exactly when they already are), for bf16 models on hardware with
    bf16 matrix units: each logit block from two bf16 products (:func:`_logits_bf16`, logits to
    about 2^-17 relative), the gradient products ``dL/dz @ W`` and ``(dL/dz)^T @ h`` from one
    each (``dL/dz`` rounded to bf16), accumulated in float32. Softmax, divergence and gradient
    arithmetic stay in float32. Six bf16 products per chunk replace four float32 ones. The loss
    stays within 1e-3 relative for ``jsd`` and ``topk``; ``sampled``'s loss value is a small
    difference of two log-probabilities and loses more. ``tests/loss/test_loss.py`` holds the bounds;
    docs/studies/precision.md has the measured errors.
    None (the default) keeps every product in the compute dtype.

    ``slab_elements``: the kernels take a chunk's products this many elements (a few rows) at a time,
    so their ~20 passes over each block touch a few MB instead of the whole ``[chunk, V]`` block (a
    CPU's caches; the CPU plan sets it, docs/cpu.md "Loss slabs"); None: one slab per chunk (a GPU
    streams the blocks fast, and slabs would multiply its kernel launches).

    ``target_logprobs``: an ``[N]`` tensor to fill with ``log softmax(z_s / T)[targets]`` (the full
    vocabulary, whatever ``spec.mode``) for every row with a non-zero weight, from the student logits
    the loss computes anyway: the rollout log-prob check without a second head product.
    """
    _check_shapes(student_hidden, student_weight, teacher_hidden, teacher_weight, weights, targets, spec)
    if matmul_dtype not in (None, torch.bfloat16):
        raise ValueError(f"matmul_dtype must be None or torch.bfloat16, got {matmul_dtype}")
    n, h = student_hidden.shape
    dtype = working_dtype(student_hidden)
    if matmul_dtype is not None and dtype != torch.float32:
        raise ValueError(
            f"matmul_dtype=torch.bfloat16 needs float32 or bfloat16 inputs, got {student_hidden.dtype}"
        )
    if weights is None:
        weights = student_hidden.new_full((n,), 1.0 / max(n, 1), dtype=dtype)

    rows = (weights != 0).nonzero().squeeze(-1)
    need_grad_h = torch.is_grad_enabled() and student_hidden.requires_grad
    need_grad_w = torch.is_grad_enabled() and student_weight.requires_grad
    mm = matmul_dtype or dtype  # the dtype of the matrix products
    ws = student_weight.detach().to(mm)
    wt = ws if _same_tensor(teacher_weight, student_weight) else teacher_weight.detach().to(mm)
    hs_all = student_hidden.detach()
    ht_all = teacher_hidden.detach()
    w_all = weights.detach().to(dtype)
    grad_h = torch.zeros(n, h, dtype=dtype, device=student_hidden.device) if need_grad_h else None
    grad_w = torch.zeros_like(ws, dtype=dtype) if need_grad_w else None
    total = torch.zeros((), dtype=dtype, device=student_hidden.device)
    stats = LossStats()
    step = chunk_size or auto_chunk_size(ws.shape[0])
    inv_t = 1.0 / spec.temperature
    need_grad = need_grad_h or need_grad_w
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        c = idx.numel()
        hs = hs_all.index_select(0, idx).to(mm)
        ht = ht_all.index_select(0, idx).to(mm)
        if wt is ws:  # one head (LoRA's): both blocks from one product, which reads the [V, H] head once
            z, lo = _head_products(torch.cat([hs, ht]), ws, inv_t, matmul_dtype)
            zs, zt = z.split(c)
            lo_s, lo_t = lo.split(c) if lo is not None else (None, None)
            del z, lo  # the views hold them: lo goes when lo_s and lo_t do, below
        else:
            zs, lo_s = _head_products(hs, ws, inv_t, matmul_dtype)
            zt, lo_t = _head_products(ht, wt, inv_t, matmul_dtype)
        del ht
        w = w_all.index_select(0, idx)
        y = targets.index_select(0, idx) if targets is not None else None
        lp = zs.new_empty(c, dtype=dtype) if target_logprobs is not None else None
        kw = dict(need_grad=need_grad, with_stats=with_stats, slab_elements=slab_elements)
        loss, st, gz = _chunk_loss(zs, lo_s, zt, lo_t, y, w, lp, spec, inv_t, **kw)
        del zs, zt, lo_s, lo_t
        if lp is not None:
            target_logprobs.index_copy_(0, idx, lp.to(target_logprobs.dtype))
        total += loss
        stats.add(st)
        if not need_grad:
            continue
        if grad_h is not None:
            grad_h.index_copy_(0, idx, (gz @ ws).to(dtype))
        if grad_w is None:
            continue
        if matmul_dtype is None:
            grad_w.addmm_(gz.t(), hs)
        else:
            grad_w += gz.t() @ hs
    stats.materialize()  # the chunks' statistics, read back once
    if not need_grad:
        return total, stats
    out = PrecomputedGrad.apply(
        total,
        student_hidden,
        student_weight,
        grad_h.to(student_hidden.dtype) if grad_h is not None else torch.zeros_like(student_hidden),
        grad_w.to(student_weight.dtype) if grad_w is not None else None,
    )
    return out, stats
