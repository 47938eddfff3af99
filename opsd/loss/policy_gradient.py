"""The policy-gradient loss of the GRPO objective, on the same fused-linear path as the sampled-token
distillation estimator.

``L = -sum_n c_n log S(y_n)`` with ``c_n = w_n A_n`` a constant per token (``A`` the group-relative
advantage of the response the token belongs to, ``w`` the reduction weight). It is the sampled-token
kernel with the advantage given instead of ``log P(y) - log S(y)``: the gradient with respect to the
tempered logits is ``c (S - onehot(y))`` (:func:`opsd.loss.fused._grad_sampled`). Rollouts are
fully on-policy (one optimizer step per rollout batch), so no importance ratio is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opsd.loss.fused import _grad_sampled, _PrecomputedGrad, auto_chunk_size
from opsd.loss.reference import compute_dtype, kernel_precision
from opsd.loss.spec import LossStats


@kernel_precision
def fused_linear_policy_gradient(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    coef: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, LossStats]:
    """``-sum_n coef_n log S(y_n)`` from hidden states ``[N, H]`` and the lm_head ``[V, H]``, a chunk
    of rows at a time (never ``[N, V]`` logits), with analytic gradients. Rows with ``coef == 0``
    (e.g. a group whose rewards are all equal) are skipped: they contribute exactly nothing."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    n = hidden.shape[0]
    if targets.shape != (n,) or coef.shape != (n,):
        raise ValueError(
            f"targets and coef must have shape [{n}], got {tuple(targets.shape)}, {tuple(coef.shape)}"
        )
    dtype = compute_dtype(hidden)
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    need_w = torch.is_grad_enabled() and weight.requires_grad
    w_all = weight.detach().to(dtype)
    h_all, c_all = hidden.detach(), coef.detach().to(dtype)
    grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
    grad_w = torch.zeros_like(w_all) if need_w else None
    total = torch.zeros((), dtype=dtype, device=hidden.device)
    stats = LossStats(tokens=float(n))
    rows = (c_all != 0).nonzero().squeeze(-1)
    step, inv_t = chunk_size or auto_chunk_size(weight.shape[0]), 1.0 / temperature
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        hs = h_all.index_select(0, idx).to(dtype)
        log_s = torch.log_softmax((hs * inv_t) @ w_all.t(), dim=-1)
        y, c = targets.index_select(0, idx)[:, None], c_all.index_select(0, idx)[:, None]
        total -= (c * log_s.gather(-1, y)).sum()
        stats.entropy_student = stats.entropy_student - (log_s.exp() * log_s).sum()  # no sync per chunk
        if need_h or need_w:
            gz = _grad_sampled(log_s.exp_(), y, c * inv_t)
            if grad_h is not None:
                grad_h.index_copy_(0, idx, gz @ w_all)
            if grad_w is not None:
                grad_w.addmm_(gz.t(), hs)
    stats.materialize()
    if not (need_h or need_w):
        return total, stats
    out = _PrecomputedGrad.apply(
        total,
        hidden,
        weight,
        grad_h.to(hidden.dtype) if grad_h is not None else torch.zeros_like(hidden),
        grad_w.to(weight.dtype) if grad_w is not None else None,
    )
    return out, stats


@torch.no_grad()
@kernel_precision
def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """``log softmax(h W^T / T)[y]`` per row, in fp32 (float64 for float64 input), a chunk at a time.

    The trainer's log-prob of each sampled token, to compare with what the rollout engine reported
    for the same token (``rollout.logprob_check``): the train/inference mismatch.
    """
    dtype = compute_dtype(hidden)
    w, out = weight.detach().to(dtype), torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
    step = chunk_size or auto_chunk_size(weight.shape[0])
    for start in range(0, hidden.shape[0], step):
        z = (hidden[start : start + step].detach().to(dtype) / temperature) @ w.t()
        y = targets[start : start + step, None]
        out[start : start + step] = (z.gather(-1, y) - z.logsumexp(-1, keepdim=True)).squeeze(-1)
    return out
