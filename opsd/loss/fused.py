"""The fused linear + chunked loss with analytic gradients: what training uses.

It takes final hidden states and lm_head weights, walks the rows in chunks, never holds more than
one ``[chunk, V]`` block of logits per model, and computes the gradient of each chunk as it goes,
so no autograd graph over ``[N, V]`` exists. The kernels of ``opsd/loss/kernels.py`` turn a chunk
of tempered logits ``a = z_s / T``, ``b = z_t / T`` into its loss and ``d(sum_n w_n L_n) / da``:
one for ``jsd`` and ``topk``, one for ``sampled``.
The gradient with respect to the student logits ``z_s = T a`` is that divided by ``T``.

Precision against the float64 oracle on the same input values (the bounds
``tests/loss/test_loss_precision.py`` holds, each with its error model; measured figures:
docs/studies/precision.md, "Loss precision against the float64 oracle"):

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

from dataclasses import dataclass
from typing import TypedDict, Unpack

import torch
from torch import Tensor

from opsd.loss.kernels import KERNELS
from opsd.loss.reference import kernel_precision, working_dtype
from opsd.loss.spec import DistillSpec, LossStats


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


def logits_bf16(h: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
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
    second product of :func:`logits_bf16` 16.6 against 13.8; float32 90 against 51), because each
    product streams the whole ``[V, H]`` head (timed when this was written).
    """
    if matmul_dtype is None:
        return (h * inv_t) @ w.t(), None
    return logits_bf16(h, w)


def _slab(hi: Tensor, lo: Tensor | None, rows: slice, inv_t: float) -> Tensor:
    """Some rows of :func:`_head_products`' output as tempered logits in the compute dtype.

    The float32 view itself, or for bf16 products the new float32 block ``(hi + lo) / T``."""
    if lo is None:
        return hi[rows]
    return hi[rows].float().add_(lo[rows]).mul_(inv_t)


class FusedOptions(TypedDict, total=False):
    """:func:`fused_linear_distill`'s keyword options (its docstring says what each does)."""

    chunk_size: int | None
    slab_elements: int | None
    with_stats: bool
    matmul_dtype: torch.dtype | None
    target_logprobs: Tensor | None


@dataclass(frozen=True)
class ChunkSettings:
    """What every chunk of one :func:`fused_linear_distill` call is computed with: its options, resolved.

    ``dtype`` is the compute dtype (:func:`opsd.loss.reference.working_dtype`), ``matmul_dtype`` that
    of the products (None: the compute dtype), ``need_grad`` whether any gradient is wanted."""

    spec: DistillSpec
    dtype: torch.dtype
    matmul_dtype: torch.dtype | None
    need_grad: bool
    with_stats: bool
    slab_elements: int | None

    @property
    def inv_t(self) -> float:
        """``1 / T``, the factor that tempers the logits."""
        return 1.0 / self.spec.temperature


def _chunk_loss(
    zs: Tensor,
    lo_s: Tensor | None,
    zt: Tensor,
    lo_t: Tensor | None,
    y: Tensor | None,
    w: Tensor,
    lp: Tensor | None,
    settings: ChunkSettings,
) -> tuple[Tensor, LossStats, Tensor]:
    """The mode's kernel over one chunk's products (:func:`_head_products`), a slab of rows at a time.

    Returns the chunk's ``sum_n w_n L_n``, its stats and ``dL/dz`` (with ``need_grad``; else ``zs``).
    Several slabs write their gradients over the student's products ``zs``, whose logits each slab has
    spent by then (on the bf16 path rounded to bf16, the dtype of the gradient's product), so the
    gradient takes no block of its own; a single slab in the compute dtype hands over its own block.
    ``settings.slab_elements``: :func:`fused_linear_distill`'s.
    """
    slab_elements = settings.slab_elements
    slab = max(1, slab_elements // zs.shape[1]) if slab_elements else zs.shape[0]
    kernel = KERNELS[settings.spec.mode]
    kw = dict(need_grad=settings.need_grad, with_stats=settings.with_stats)
    total = zs.new_zeros((), dtype=w.dtype)
    stats = LossStats()
    gz = zs
    for r in range(0, zs.shape[0], slab):
        rows = slice(r, r + slab)
        a = _slab(zs, lo_s, rows, settings.inv_t)
        b = _slab(zt, lo_t, rows, settings.inv_t)
        y_r = y[rows] if y is not None else None
        lp_r = lp[rows] if lp is not None else None
        loss, grad, st = kernel(a, b, y_r, w[rows], settings.spec, lp=lp_r, **kw)
        total += loss
        stats.add(st)
        if grad is None:
            continue
        if grad.shape == zs.shape and grad.dtype == zs.dtype:
            gz = grad  # one slab (a GPU's, or a short chunk): no copy
        else:
            zs[rows].copy_(grad)
    return total, stats, gz


def _chunk_products(
    hs: Tensor, ht: Tensor, ws: Tensor, wt: Tensor, settings: ChunkSettings
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """One chunk's student and teacher products ``(zs, lo_s, zt, lo_t)`` (:func:`_head_products`).

    One head (LoRA's, ``wt is ws``): both blocks from one product, which reads the ``[V, H]`` head once;
    the returned views hold that product, which goes when they do."""
    if wt is ws:
        z, lo = _head_products(torch.cat([hs, ht]), ws, settings.inv_t, settings.matmul_dtype)
        c = hs.shape[0]
        zs, zt = z.split(c)
        lo_s, lo_t = lo.split(c) if lo is not None else (None, None)
        return zs, lo_s, zt, lo_t
    zs, lo_s = _head_products(hs, ws, settings.inv_t, settings.matmul_dtype)
    zt, lo_t = _head_products(ht, wt, settings.inv_t, settings.matmul_dtype)
    return zs, lo_s, zt, lo_t


def _add_chunk_grads(
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    gz: Tensor,
    hs: Tensor,
    ws: Tensor,
    idx: Tensor,
    settings: ChunkSettings,
) -> None:
    """Add one chunk's ``dL/dz @ W`` into its rows of ``grad_h`` and ``(dL/dz)^T @ h`` into ``grad_w``."""
    if grad_h is not None:
        grad_h.index_copy_(0, idx, (gz @ ws).to(settings.dtype))
    if grad_w is None:
        return
    if settings.matmul_dtype is None:
        grad_w.addmm_(gz.t(), hs)
    else:
        grad_w += gz.t() @ hs


def _settings(
    student_hidden: Tensor, student_weight: Tensor, spec: DistillSpec, options: FusedOptions
) -> ChunkSettings:
    """The call's :class:`ChunkSettings`, its options checked."""
    unknown = sorted(set(options) - set(FusedOptions.__annotations__))
    if unknown:
        raise TypeError(f"fused_linear_distill() got unexpected keyword arguments {unknown}")
    matmul_dtype = options.get("matmul_dtype")
    if matmul_dtype not in (None, torch.bfloat16):
        raise ValueError(f"matmul_dtype must be None or torch.bfloat16, got {matmul_dtype}")
    dtype = working_dtype(student_hidden)
    if matmul_dtype is not None and dtype != torch.float32:
        raise ValueError(
            f"matmul_dtype=torch.bfloat16 needs float32 or bfloat16 inputs, got {student_hidden.dtype}"
        )
    grad_on = torch.is_grad_enabled()
    return ChunkSettings(
        spec=spec,
        dtype=dtype,
        matmul_dtype=matmul_dtype,
        need_grad=grad_on and (student_hidden.requires_grad or student_weight.requires_grad),
        with_stats=options.get("with_stats", True),
        slab_elements=options.get("slab_elements"),
    )


@kernel_precision
def fused_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    weights: Tensor | None = None,
    targets: Tensor | None = None,
    spec: DistillSpec = DistillSpec(),
    **options: Unpack[FusedOptions],
) -> tuple[Tensor, LossStats]:
    """Distillation loss from final hidden states ``[N, H]`` and lm_head weights ``[V, H]``.

    Logits are computed a chunk of rows at a time in float32 (float64 for float64 inputs), so
    peak memory is one ``[chunk, V]`` block per model whatever N is. Gradients for the student
    hidden states (and the student weight, only if it requires grad) are computed analytically
    while walking the chunks; backward just scales them. ``teacher_weight`` may be the very same
    tensor as ``student_weight`` (LoRA teacher with the adapter off). Rows with weight 0 are
    skipped entirely; ``weights=None`` means a plain mean. Returns ``(sum_n w_n L_n, stats)``.

    Keyword options (:class:`FusedOptions`): ``chunk_size`` (rows per chunk; None:
    :func:`auto_chunk_size`), ``with_stats`` (default True), and the three below.

    ``matmul_dtype=torch.bfloat16`` computes the matrix products in bf16 (hidden states and
    weights are cast to bf16, exactly when they already are), for bf16 models on hardware with
    bf16 matrix units: each logit block from two bf16 products (:func:`logits_bf16`, logits to
    about 2^-17 relative), the gradient products ``dL/dz @ W`` and ``(dL/dz)^T @ h`` from one
    each (``dL/dz`` rounded to bf16), accumulated in float32. Softmax, divergence and gradient
    arithmetic stay in float32. Six bf16 products per chunk replace four float32 ones. The loss
    stays within 1e-3 relative for ``jsd`` and ``topk``; ``sampled``'s loss value is a small
    difference of two log-probabilities and loses more. ``tests/loss/test_loss_precision.py`` holds the
    bounds; docs/studies/precision.md has the measured errors.
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
    settings = _settings(student_hidden, student_weight, spec, options)
    target_logprobs = options.get("target_logprobs")
    n, h = student_hidden.shape
    dtype = settings.dtype
    if weights is None:
        weights = student_hidden.new_full((n,), 1.0 / max(n, 1), dtype=dtype)

    rows = (weights != 0).nonzero().squeeze(-1)
    mm = settings.matmul_dtype or dtype  # the dtype of the matrix products
    ws = student_weight.detach().to(mm)
    wt = ws if _same_tensor(teacher_weight, student_weight) else teacher_weight.detach().to(mm)
    hs_all = student_hidden.detach()
    ht_all = teacher_hidden.detach()
    w_all = weights.detach().to(dtype)
    grad_on = settings.need_grad
    need_grad_h = grad_on and student_hidden.requires_grad
    grad_h = torch.zeros(n, h, dtype=dtype, device=student_hidden.device) if need_grad_h else None
    grad_w = torch.zeros_like(ws, dtype=dtype) if grad_on and student_weight.requires_grad else None
    total = torch.zeros((), dtype=dtype, device=student_hidden.device)
    stats = LossStats()
    step = options.get("chunk_size") or auto_chunk_size(ws.shape[0])
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        hs = hs_all.index_select(0, idx).to(mm)
        zs, lo_s, zt, lo_t = _chunk_products(hs, ht_all.index_select(0, idx).to(mm), ws, wt, settings)
        y = targets.index_select(0, idx) if targets is not None else None
        lp = zs.new_empty(idx.numel(), dtype=dtype) if target_logprobs is not None else None
        loss, st, gz = _chunk_loss(zs, lo_s, zt, lo_t, y, w_all.index_select(0, idx), lp, settings)
        del zs, zt, lo_s, lo_t
        if lp is not None:
            target_logprobs.index_copy_(0, idx, lp.to(target_logprobs.dtype))
        total += loss
        stats.add(st)
        if grad_on:
            _add_chunk_grads(grad_h, grad_w, gz, hs, ws, idx, settings)
    stats.materialize()  # the chunks' statistics, read back once
    if not grad_on:
        return total, stats
    out = PrecomputedGrad.apply(
        total,
        student_hidden,
        student_weight,
        grad_h.to(student_hidden.dtype) if grad_h is not None else torch.zeros_like(student_hidden),
        grad_w.to(student_weight.dtype) if grad_w is not None else None,
    )
    return out, stats
