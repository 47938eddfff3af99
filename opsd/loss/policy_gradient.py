"""The policy-gradient loss of the GRPO objective, on the same fused-linear path as the sampled-token
distillation estimator.

``L = -sum_n c_n log S(y_n)`` with ``c_n = w_n A_n`` a constant per token (``A`` the group-relative
advantage of the response the token belongs to, ``w`` the reduction weight). It is the sampled-token
kernel with the advantage given instead of ``log P(y) - log S(y)``: the gradient with respect to the
tempered logits is ``c (S - onehot(y))`` (:func:`opsd.loss.kernels.grad_sampled`). Rollouts are
fully on-policy (one optimizer step per rollout batch), so no importance ratio is needed.

Both kernels compute in float32 (float64 for float64 input). A head stored in another dtype (a bf16
model's) is cast a block of rows at a time as each product reads it (:func:`_head_rows`), never as
a whole: a float32 copy of Qwen3-1.7B's ``[151936, 2048]`` head is 1.2 GB, and was made at every
call. A head already in the compute dtype is read as it is, in one block.

:func:`paired_token_logprobs` reads the student's and the teacher's log-probabilities of the sampled
tokens a chunk at a time: the per-token credit of ``objective: rlsd``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opsd.loss.fused import PrecomputedGrad, auto_chunk_size
from opsd.loss.kernels import chunk_entropies, chunk_log_probs, grad_sampled
from opsd.loss.reference import kernel_precision, working_dtype
from opsd.loss.spec import DistillSpec, LossStats


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
    dtype = working_dtype(hidden)
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    need_w = torch.is_grad_enabled() and weight.requires_grad
    w_all, blocks = weight.detach(), _head_rows(weight, dtype)
    h_all, c_all = hidden.detach(), coef.detach().to(dtype)
    grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
    total = torch.zeros((), dtype=dtype, device=hidden.device)
    stats = LossStats(tokens=float(n))
    rows = (c_all != 0).nonzero().squeeze(-1)
    step, inv_t = chunk_size or auto_chunk_size(weight.shape[0]), 1.0 / temperature
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        hs = h_all.index_select(0, idx).to(dtype)
        log_s = torch.log_softmax(_logits(hs * inv_t, w_all, blocks, dtype), dim=-1)
        y, c = targets.index_select(0, idx)[:, None], c_all.index_select(0, idx)[:, None]
        total -= (c * log_s.gather(-1, y)).sum()
        stats.entropy_student = stats.entropy_student - (log_s.exp() * log_s).sum()  # no sync per chunk
        if need_h or need_w:
            gz = grad_sampled(log_s.exp_(), y, c * inv_t)
            if grad_h is not None:
                grad_h.index_copy_(0, idx, _times_head(gz, w_all, blocks, dtype))
            if grad_w is not None:
                for r in blocks:
                    grad_w[r].addmm_(gz[:, r].t(), hs)
    stats.materialize()
    if not (need_h or need_w):
        return total, stats
    out = PrecomputedGrad.apply(
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
    dtype = working_dtype(hidden)
    w, blocks = weight.detach(), _head_rows(weight, dtype)
    out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
    step = chunk_size or auto_chunk_size(weight.shape[0])
    for start in range(0, hidden.shape[0], step):
        z = _logits(hidden[start : start + step].detach().to(dtype) / temperature, w, blocks, dtype)
        y = targets[start : start + step, None]
        out[start : start + step] = (z.gather(-1, y) - z.logsumexp(-1, keepdim=True)).squeeze(-1)
    return out


@torch.no_grad()
@kernel_precision
def paired_token_logprobs(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    weights: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, LossStats]:
    """``log S(y)`` and ``log P(y)`` per row at ``temperature``, and the loss statistics of the rows with
    a non-zero weight (the sampled estimate ``log S(y) - log P(y)`` as divergence, entropies, top-1
    agreement, top-16 overlap mass), a chunk of both models' logits at a time, in fp32 (float64 for
    float64 input), without gradients.

    What a reward-signed objective needs from the teacher (``objective: rlsd``): how much more or less
    likely the teacher finds each sampled token. Rows with weight 0 are not computed and stay NaN.
    """
    dtype = working_dtype(student_hidden)
    ws, s_blocks = student_weight.detach(), _head_rows(student_weight, dtype)
    wt, t_blocks = teacher_weight.detach(), _head_rows(teacher_weight, dtype)
    log_s = torch.full((student_hidden.shape[0],), float("nan"), dtype=dtype, device=student_hidden.device)
    log_p = torch.full_like(log_s, float("nan"))
    stats = LossStats()
    rows = (weights != 0).nonzero().squeeze(-1)
    step, inv_t = chunk_size or auto_chunk_size(ws.shape[0]), 1.0 / temperature
    spec = DistillSpec(temperature=temperature)
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        a = _logits(student_hidden.detach().index_select(0, idx).to(dtype) * inv_t, ws, s_blocks, dtype)
        b = _logits(teacher_hidden.detach().index_select(0, idx).to(dtype) * inv_t, wt, t_blocks, dtype)
        y = targets.index_select(0, idx)[:, None]
        ls, lp, _, st = chunk_log_probs(a, b, spec, True)
        chunk_entropies(st, ls, lp)
        ls_y, lp_y = ls.gather(-1, y).squeeze(-1), lp.gather(-1, y).squeeze(-1)
        st.divergence = (ls_y - lp_y).sum()
        log_s.index_copy_(0, idx, ls_y)
        log_p.index_copy_(0, idx, lp_y)
        stats.add(st)
    return log_s, log_p, stats.materialize()


# The most elements of one block of the head cast to the compute dtype: 64 MB in float32 (8192 of
# Qwen3's 151936 rows of 2048).
HEAD_BLOCK_ELEMENTS = 1 << 24


def _head_rows(weight: Tensor, dtype: torch.dtype) -> list[slice]:
    """The head's row blocks that :func:`_logits` and :func:`_times_head` cast one at a time: the whole
    head where it is already in ``dtype`` (the cast is then no copy), else blocks of at most
    :data:`HEAD_BLOCK_ELEMENTS` elements."""
    v = weight.shape[0]
    if weight.dtype == dtype:
        return [slice(0, v)]
    per = max(1, HEAD_BLOCK_ELEMENTS // max(1, weight.shape[1]))
    return [slice(r, min(v, r + per)) for r in range(0, v, per)]


def _logits(x: Tensor, weight: Tensor, blocks: list[slice], dtype: torch.dtype) -> Tensor:
    """``x @ weight.T`` in ``dtype`` (``[rows, V]``), the head read a block of rows at a time."""
    if len(blocks) == 1:
        return x @ weight.to(dtype).t()
    z = x.new_empty((x.shape[0], weight.shape[0]))
    for r in blocks:
        z[:, r] = x @ weight[r].to(dtype).t()
    return z


def _times_head(g: Tensor, weight: Tensor, blocks: list[slice], dtype: torch.dtype) -> Tensor:
    """``g @ weight`` in ``dtype`` (``[rows, H]``), the head read a block of rows at a time."""
    if len(blocks) == 1:
        return g @ weight.to(dtype)
    out = torch.zeros((g.shape[0], weight.shape[1]), dtype=dtype, device=g.device)
    for r in blocks:
        out.addmm_(g[:, r], weight[r].to(dtype))
    return out
