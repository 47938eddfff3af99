"""The decoder's RMSNorm as one autograd node with its gradient written out.

transformers' Llama-style RMSNorm is six tensor operations (a float32 copy, the mean square, rsqrt,
the scale, a cast back, the weight), and autograd takes their backward one operation at a time:
about a dozen calls over ``[tokens, hidden]`` blocks, each making its own intermediate. On a CPU these
are short memory-bound loops whose count and traffic, not their arithmetic, set the time.
:class:`RMSNorm` computes the same forward (bit for bit) and the backward from its closed form in
seven calls, and keeps the input (bf16 in a bf16 model) for the backward instead of its float32 copy.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

# The norms that compute ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in float32 (transformers'
# LlamaRMSNorm and its copies); Gemma's ``1 + weight`` and other variants are not among them.
PLAIN_RMSNORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


class RMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`` with the statistics in float32.

    With ``n = x r`` and ``r = (mean(x^2) + eps)^(-1/2)``, the input gradient is
    ``dn r - x r^3 <dn, x> / H`` (``dn = dy * weight``, in float32), the weight gradient the row sum
    of ``dy * n``: the same formulas autograd applies to transformers' operations, taken in fewer passes.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        normed = torch.mul(xf, r, out=torch.empty_like(x))  # float32 product, rounded once as .to(x.dtype)
        ctx.save_for_backward(x, r, weight)
        return weight * normed

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, r, weight = ctx.saved_tensors
        xf = x.float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            normed = torch.mul(xf, r, out=torch.empty_like(x))
            grad_w = (dy * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dn = (dy * weight).float()
            coef = torch.linalg.vecdot(dn, xf).unsqueeze(-1).mul_(r.pow(3)).mul_(-1.0 / x.shape[-1])
            grad_x = torch.addcmul(dn.mul_(r), xf, coef).to(x.dtype)
        return grad_x, grad_w, None


def lean_rms_norms(*models: nn.Module | None) -> int:
    """Every plain RMSNorm (:data:`PLAIN_RMSNORMS`) of ``models`` runs :class:`RMSNorm` for its
    forward. Returns how many modules changed.

    Why: a SmolLM2-135M norm over 2,200 tokens took 4.6-4.9 ms forward and backward in bf16 against
    7.1-7.6 ms for transformers' operations, 3.1 against 5.9-6.5 ms in float32, on a 2-core AMX CPU;
    with the loss's slabs the trainer's bf16 loop over one step's micro-batches (teacher, student,
    loss) ran ~3-5% faster, each change alone within the loop's spread (development readings,
    docs/benchmarks.md, "The loss in slabs; RMSNorm in one node"). Inputs other than bfloat16,
    float16 and float32 (the float64 reference runs) and a weight of another dtype run transformers'
    own forward. A per-instance ``forward``: state dicts, hooks and checkpoints are unchanged.
    """
    changed = 0
    for model in models:
        if model is None:
            continue
        for mod in model.modules():
            if type(mod).__name__ not in PLAIN_RMSNORMS or "forward" in mod.__dict__:
                continue
            mod.forward = partial(_lean_forward, mod)
            changed += 1
    return changed


def _lean_forward(mod: nn.Module, x: Tensor) -> Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or mod.weight.dtype != x.dtype:
        return type(mod).forward(mod, x)
    return RMSNorm.apply(x, mod.weight, mod.variance_epsilon)
