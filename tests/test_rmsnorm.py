"""The RMSNorm in one autograd node against transformers' own operations."""

from __future__ import annotations

import pytest
import torch
from helpers import build_assets, make_cfg
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from opsd import Trainer
from opsd.models import apply_lora
from opsd.rmsnorm import PLAIN_RMSNORMS, lean_rms_norms
from opsd.tiny import build_tiny_model

U32 = 2.0**-24  # float32 unit roundoff
BF16_ULP = 2.0**-7  # bf16 spacing relative to a value's own size is at most this (8 significant bits)


def _norm(dtype: torch.dtype, seed: int = 0, hidden: int = 48) -> LlamaRMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=g))
    return norm.to(dtype)


def _inputs(dtype: torch.dtype, seed: int = 1, hidden: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 7, hidden, generator=g) * torch.rand(3, 7, 1, generator=g) * 4).to(dtype)
    dy = torch.randn(3, 7, hidden, generator=g).to(dtype)
    return x, dy


def _grads(norm: LlamaRMSNorm, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    norm.weight.grad = None
    y = norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_is_transformers_bit_for_bit(dtype):
    norm = _norm(dtype)
    x, _ = _inputs(dtype)
    with torch.no_grad():
        before = norm(x)
        assert lean_rms_norms(norm) == 1
        assert "forward" in norm.__dict__
        torch.testing.assert_close(norm(x), before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_follow_transformers_autograd(dtype):
    """Both take the same formulas in float32 and round the results to the dtype once; they differ by the
    order of float32 operations (a few u32 of the terms' size) and, in bf16, by at most one bf16 spacing."""
    norm = _norm(dtype)
    x, dy = _inputs(dtype)
    y0, gx0, gw0 = _grads(norm, x, dy)
    lean_rms_norms(norm)
    y1, gx1, gw1 = _grads(norm, x, dy)
    assert gx1.dtype == gx0.dtype and gw1.dtype == gw0.dtype
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    # The terms of grad_x: dn r and x r^3 <dn, x> / H, in float64 from the same values.
    x64, dy64, w64 = x.double(), dy.double(), norm.weight.detach().double()
    r = (x64.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()
    dn = dy64 * w64
    size = (dn * r).abs() + x64.abs() * r.pow(3) * (dn * x64).abs().sum(-1, keepdim=True) / x.shape[-1]
    if dtype == torch.float32:
        # float32: a 48-term dot product and three roundings: <= (48 + 3) u32 of the terms' size
        assert torch.all((gx1.double() - gx0.double()).abs() <= 51 * U32 * size)
        # the weight gradient sums 21 products dy * n over rows: <= 21 u32 of the sum of |terms|
        bound = 21 * U32 * (dy64 * x64 * r).abs().sum((0, 1))
        assert torch.all((gw1.double() - gw0.double()).abs() <= bound)
    else:
        # bf16: the float32 values agree as above, then each is rounded to bf16 once (<= 1/2 spacing)
        tol = BF16_ULP * (gx0.double().abs() + 51 * U32 * size) + 51 * U32 * size
        assert torch.all((gx1.double() - gx0.double()).abs() <= tol)
        # the weight gradient: dy * n rounded to bf16 per element (the same in both), a float32 sum over 21
        # rows rounded to bf16 once
        sum_abs = (dy64 * x64 * r * 1.01).abs().sum((0, 1))
        tol_w = BF16_ULP * (gw0.double().abs() + 21 * U32 * sum_abs) + 21 * U32 * sum_abs
        assert torch.all((gw1.double() - gw0.double()).abs() <= tol_w)


def test_gradients_match_float64():
    """Against float64 autograd on the same float32 values: the formulas, not just agreement with autograd."""
    norm = _norm(torch.float32, seed=3)
    x, dy = _inputs(torch.float32, seed=4)
    lean_rms_norms(norm)
    _, gx, gw = _grads(norm, x, dy)
    ref = _norm(torch.float64, seed=3)
    ref.weight.data.copy_(norm.weight.data.double())
    x64 = x.double().requires_grad_()
    y = ref.weight * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    y.backward(dy.double())
    # float32 against float64: as above, <= 51 u32 of the terms' size; measured far below
    scale = x64.grad.abs().max().item()
    assert (gx.double() - x64.grad).abs().max().item() <= 51 * U32 * 10 * scale
    assert (
        gw.double() - ref.weight.grad
    ).abs().max().item() <= 21 * U32 * 10 * ref.weight.grad.abs().max().item()


def test_other_inputs_take_transformers_forward():
    """float64 (the reference runs, where opsd.models.float64_throughout hooks the norms) and a weight of
    another dtype than the input run transformers' own forward."""
    norm = _norm(torch.float64)
    lean_rms_norms(norm)
    x, dy = _inputs(torch.float64)
    x = x.requires_grad_()
    y = norm(x)
    assert y.grad_fn is not None and "RMSNorm" not in type(y.grad_fn).__name__
    mixed = _norm(torch.float32)
    lean_rms_norms(mixed)
    xb = _inputs(torch.bfloat16)[0]
    assert mixed(xb).dtype == torch.float32  # transformers' promotion: float32 weight * bf16


def test_lean_norms_in_a_lora_model(tiny_tokenizer):
    """Every norm of a (LoRA-wrapped) tiny Llama, once; logits unchanged bit for bit, adapter gradients
    within float32 rounding (each norm's gradient as in the test above, through two layers)."""
    ids = torch.tensor([tiny_tokenizer("What is 12 + 30? 42").input_ids])
    grads = []
    for lean in (False, True):
        model = build_tiny_model(tiny_tokenizer, seed=0)
        for mod in model.modules():
            if isinstance(mod, LlamaRMSNorm):
                with torch.no_grad():
                    mod.weight.mul_(1 + 0.2 * torch.arange(mod.weight.numel()) / mod.weight.numel())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the adapters' draws (lora_A) come from the global generator
            lora = apply_lora(
                model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", gradient_checkpointing=False
            )
        if lean:
            assert lean_rms_norms(lora, lora) == 2 * 2 + 1  # a second pass over the same model changes none
        logits = lora(ids).logits
        logits.float().pow(2).mean().backward()
        grads.append(
            (logits.detach(), {n: p.grad.clone() for n, p in lora.named_parameters() if p.grad is not None})
        )
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        # float32 through a 2-layer network of width 64, each norm's gradient within 51 u32 of its terms (as
        # above), the rest the same operations: 100 u32 of the gradient's largest entry; measured <= 5 u32
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=100 * U32 * g0[name].abs().max().item())


def test_the_trainer_runs_lean_norms(tmp_path):
    """The student's and the teacher's norms (one model, LoRA's teacher is the adapter switched off) run
    the one-node forward; with ``model.compile`` they stay transformers' (tests/test_compile.py)."""
    tr = Trainer(make_cfg(build_assets(tmp_path / "assets"), tmp_path / "run", **{"optim.max_steps": 1}))
    norms = [m for m in tr.model.modules() if type(m).__name__ in PLAIN_RMSNORMS]
    assert norms and all("forward" in m.__dict__ for m in norms)
