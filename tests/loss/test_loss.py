"""The loss library against independent formulations and autograd: values, gradients, clipping, statistics
and bad arguments."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import FrozenInstanceError

import pytest
import torch
from loss_cases import CASES, IDS, independent, make

from opsd.config import LossConfig
from opsd.errors import UserError
from opsd.loss import (
    DistillSpec,
    distill_loss_dense,
    fused_linear_distill,
    per_token_loss_dense,
)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_dense_and_chunked_match_independent_formulation(kw):
    hs, ht, w, y = make()
    zs, zt = hs @ w.t(), ht @ w.t()
    ref = independent(zs, zt, y, temperature=1.3, **kw)
    spec = DistillSpec(temperature=1.3, **kw)
    dense = per_token_loss_dense(zs, zt, y, spec)
    # float64 (u = 1.1e-16), the same sums written two ways: a row's log-softmax and V=40 terms with
    # |z/T| <= ~3 round to <= V*u*3 = 1.3e-14 at worst; measured 9e-17 per row, 9e-16 for the sum below.
    torch.testing.assert_close(dense, ref, rtol=0, atol=1e-13)
    weights = torch.rand(hs.shape[0], dtype=torch.float64)
    loss, _ = fused_linear_distill(hs, w, ht, w, weights, y, spec, chunk_size=5)
    # 12 such rows, weights < 1: 12x the per-row bound
    torch.testing.assert_close(loss, (ref * weights).sum(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_chunked_gradients_match_dense_autograd(kw):
    hs, ht, w, y = make(seed=1)
    weights = torch.rand(hs.shape[0], dtype=torch.float64)
    weights[3] = 0.0
    spec = DistillSpec(temperature=0.9, **kw)
    hs1, w1 = hs.clone().requires_grad_(), w.clone().requires_grad_()
    dense = distill_loss_dense(hs1 @ w1.t(), ht @ w1.t().detach(), weights, y, spec)
    dense.backward()
    hs2, w2 = hs.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = fused_linear_distill(hs2, w2, ht, w2, weights, y, spec, chunk_size=4)
    loss.backward()
    # float64, analytic vs autograd: a hidden-state gradient sums V=40 products of size <= ~4 (|h| <= 3.7), a
    # weight gradient 12 rows x 40, the loss 12 x 40 terms: <= 500*u*4 = 2.2e-13 at worst; measured 1.1e-14.
    torch.testing.assert_close(loss, dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(hs2.grad, hs1.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_gradcheck_chunked(kw):
    hs, ht, w, y = make(n=5, h=4, v=9, seed=2)
    wt = w + 0.1  # a separate teacher head, so the student weight gradient is only the student's
    weights = torch.tensor([0.3, 0.0, 0.2, 0.4, 0.1], dtype=torch.float64)

    def f(h, wgt):
        spec = DistillSpec(temperature=1.1, **kw)
        return fused_linear_distill(h, wgt, ht, wt, weights, y, spec, chunk_size=2)[0]

    if kw.get("end_ids"):
        pytest.skip(
            "the floor holds the student's end probabilities as constants of the target (no gradient "
            "through them): its gradient is the dense oracle's, whose detach says so "
            "(test_chunked_gradients_match_dense_autograd)"
        )
    if kw["clip_mode"] == "scale":
        # scale's gradient is c_n dD_n with c_n = min(1, clip / D_n) a constant of the step: the gradient
        # of sum w_n c_n D_n, whose own gradient gradcheck checks by central differences with c0 fixed.
        # The clip sits at the rows' median divergence, so both kinds of row are in the check.
        unclipped = DistillSpec(temperature=1.1, **(kw | {"clip_mode": "none", "clip": 0.0}))
        d0 = per_token_loss_dense(hs @ w.t(), ht @ wt.t(), y, unclipped)
        clip = float(d0[weights > 0].median())
        c0 = torch.where(d0 > clip, clip / d0, torch.ones_like(d0))
        scaled = DistillSpec(temperature=1.1, **(kw | {"clip": clip}))
        assert (c0[weights > 0] < 1).any() and (c0[weights > 0] == 1).any()

        def g(h, wgt):
            return fused_linear_distill(h, wgt, ht, wt, weights * c0, y, unclipped, chunk_size=2)[0]

        args = (hs.clone().requires_grad_(), w.clone().requires_grad_())
        assert torch.autograd.gradcheck(g, args, atol=1e-9, rtol=0)  # as below
        h1, w1 = hs.clone().requires_grad_(), w.clone().requires_grad_()
        h2, w2 = hs.clone().requires_grad_(), w.clone().requires_grad_()
        fused_linear_distill(h1, w1, ht, wt, weights, y, scaled, chunk_size=2)[0].backward()
        g(h2, w2).backward()
        # float64, the same analytic gradient with the factor applied on the weight or on the row: a few u
        torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-13)
        torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-13)
        return
    if kw["mode"] != "sampled":
        # central differences (eps=1e-6) of a float64 loss |f| < 1: rounding ~u*|f|/eps = 1e-10, truncation
        # ~eps^2*|f'''| = 1e-12; measured <= 1.2e-10 (gradcheck's default atol=1e-5, rtol=1e-3 are far looser)
        args = (hs.clone().requires_grad_(), w.clone().requires_grad_())
        assert torch.autograd.gradcheck(f, args, atol=1e-9, rtol=0)
        return
    # The sampled estimator is a surrogate: its advantage A is a constant of the step. Check the
    # analytic gradient against central differences of -sum w A0 log S(y) with A0 held fixed.
    zt = ht @ wt.t() / 1.1
    a0 = (zt.log_softmax(-1) - (hs @ w.t() / 1.1).log_softmax(-1)).gather(-1, y[:, None])[:, 0]

    def surrogate(h):
        return -(weights * a0 * (h @ w.t() / 1.1).log_softmax(-1).gather(-1, y[:, None])[:, 0]).sum()

    h = hs.clone().requires_grad_()
    f(h, w).backward()
    numeric = torch.zeros_like(hs)
    for i, j in itertools.product(range(hs.shape[0]), range(hs.shape[1])):
        e = torch.zeros_like(hs)
        e[i, j] = 1e-6
        numeric[i, j] = (surrogate(hs + e) - surrogate(hs - e)) / 2e-6
    # as gradcheck above: ~u*|f|/eps = 5e-11 from rounding (|f| = 0.43); measured 4e-11
    torch.testing.assert_close(h.grad, numeric, rtol=0, atol=1e-9)


def test_clip_semantics():
    hs, ht, w, y = make(seed=3, scale=3.0)
    zs, zt = hs @ w.t(), ht @ w.t()
    token_clip = DistillSpec(clip_mode="token", clip=0.2)
    raw = per_token_loss_dense(zs, zt)
    tok = per_token_loss_dense(zs, zt, spec=token_clip)
    assert (raw > 0.2).any() and (raw < 0.2).any()
    # exact: token clipping clamps the same row sums
    torch.testing.assert_close(tok, raw.clamp(max=0.2), rtol=0, atol=0)
    # a clipped token gets exactly zero gradient
    zs_g = zs.clone().requires_grad_()
    per_token_loss_dense(zs_g, zt, spec=token_clip).sum().backward()
    clipped = raw > 0.2
    assert torch.all(zs_g.grad[clipped] == 0) and torch.all(zs_g.grad[~clipped].abs().sum(-1) > 0)
    # entry clipping can make the per-token loss negative (forward-KL terms can be negative)
    ent = per_token_loss_dense(zs, zt, spec=DistillSpec(clip_mode="entry", clip=0.0))
    assert (ent < 0).all()
    _, stats = fused_linear_distill(hs, w, ht, w, spec=token_clip)
    assert stats.clipped == clipped.sum().item() and stats.clip_total == len(raw)


def test_stats_are_sums_over_tokens():
    hs, ht, w, y = make(n=10, seed=5)
    zs, zt = hs @ w.t(), ht @ w.t()
    _, st = fused_linear_distill(hs, w, ht, w, chunk_size=3)
    assert st.tokens == 10
    # float64, the same 10 x 40 terms grouped in chunks of 3 rows: reordering moves a sum by <= 400*u times
    # its terms' total size (<= ~2x the sum for KL terms of either sign): <= 1e-13; measured <= 1.6e-16
    torch.testing.assert_close(st.divergence, per_token_loss_dense(zs, zt).sum().item(), rtol=1e-12, atol=0)
    ent = -(zs.softmax(-1) * zs.log_softmax(-1)).sum()
    torch.testing.assert_close(st.entropy_student, ent.item(), rtol=1e-12, atol=0)
    assert st.agree == (zs.argmax(-1) == zt.argmax(-1)).sum().item()


@pytest.mark.parametrize(
    "kw", [{"beta": 0.0}, {"beta": 1.0}, {"beta": 0.5}, {"mode": "topk", "topk": 5}, {"mode": "sampled"}]
)
def test_every_kernel_reports_both_entropies_over_the_full_vocabulary(kw):
    """The kernels take the entropies from S and P they already have (or, for top-k, from the full
    vocabulary): each mode and beta reports the same statistics as a dense computation."""
    hs, ht, w, y = make(n=10, seed=7)
    zs, zt = hs @ w.t(), ht @ w.t()
    spec = DistillSpec(clip_mode="none", **kw)
    _, st = fused_linear_distill(hs, w, ht, w, targets=y, spec=spec, chunk_size=4)
    # float64: the same 10 x 40 products summed over chunks of 4 rows; <= 400*u of the entropies' total
    # size (all terms >= 0) is ~1e-13: 1e-12 is the stated bound
    for z, got in ((zs, st.entropy_student), (zt, st.entropy_teacher)):
        want = -(z.softmax(-1) * z.log_softmax(-1)).sum().item()
        torch.testing.assert_close(float(got), want, rtol=1e-12, atol=0)
    assert st.agree == (zs.argmax(-1) == zt.argmax(-1)).sum().item()


@pytest.mark.parametrize("kw", [{"beta": 0.0, "clip_mode": "entry", "clip": 0.05}, {"mode": "sampled"}])
def test_a_shared_head_gives_what_two_heads_give(kw):
    """With one head tensor (LoRA) student and teacher rows go through one product; with two (a full
    fine-tune's fixed teacher) through one each. Float64, the same dot products over H=16: at most
    reassociated, ~16 u relative per logit, so loss and gradient agree to 1e-12."""
    hs, ht, w, y = make(n=11, seed=9)
    spec = DistillSpec(temperature=1.1, **kw)
    got = []
    for wt in (w, w.clone()):
        h = hs.clone().requires_grad_()
        lp = torch.full((11,), float("nan"), dtype=torch.float64)
        loss, st = fused_linear_distill(h, w, ht, wt, targets=y, spec=spec, chunk_size=4, target_logprobs=lp)
        loss.backward()
        got.append((loss.detach(), h.grad, lp, float(st.entropy_teacher)))
    for one, two in zip(*got):
        torch.testing.assert_close(one, two, rtol=1e-12, atol=1e-14)


def test_top1_agreement_takes_the_first_of_tied_maxima_like_argmax():
    """The kernel counts agreement with ``max(-1).indices`` (faster than ``argmax`` on a CPU); both take
    the first maximal index, so rows whose maxima tie count as argmax counts them. Exact: no arithmetic."""
    from opsd.loss.kernels import chunk_log_probs

    a = torch.zeros(4, 8, dtype=torch.float64)
    b = torch.zeros(4, 8, dtype=torch.float64)
    a[0, [2, 5]] = b[0, [2, 5]] = 1.0  # tied at 2 and 5 in both: first is 2 in both (agree)
    a[1, [2, 5]] = 1.0
    b[1, 5] = 1.0  # a ties (first 2), b's only maximum is 5 (disagree)
    a[2, 3] = b[2, [3, 6]] = 1.0  # b ties (first 3) with a's 3 (agree)
    # row 3: every entry ties in both: index 0 in both (agree)
    want = (a.argmax(-1) == b.argmax(-1)).sum()
    _, _, _, stats = chunk_log_probs(a.clone(), b.clone(), DistillSpec(), with_stats=True)
    assert int(stats.agree) == int(want) == 3


def test_sampled_tokens_log_probs_come_from_the_kernels_log_softmax():
    """``lp`` is filled from the kernel's own ``log S`` (the block log_softmax wrote), bit for bit,
    not from a separate logsumexp pass."""
    from opsd.loss.kernels import chunk_log_probs

    g = torch.Generator().manual_seed(4)
    a, b = (torch.randn(5, 50, generator=g) * 6 for _ in range(2))
    y = torch.randint(0, 50, (5,), generator=g)
    want = a.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
    lp = torch.full((5,), float("nan"))
    chunk_log_probs(a, b, DistillSpec(), with_stats=False, y=y, lp=lp)
    assert torch.equal(lp, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_probs_are_written_into_the_logit_blocks(dtype):
    """Over the full vocabulary the kernel's log S and log P take the logit blocks' memory (two [c, V]
    blocks fewer per chunk) and hold exactly what log_softmax gives (the same kernel, written in place)."""
    from opsd.loss.kernels import chunk_log_probs

    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(6, 300, generator=g, dtype=dtype) * 8 for _ in range(2))
    want_s, want_p = a.log_softmax(-1), b.log_softmax(-1)
    log_s, log_p, idx, _ = chunk_log_probs(a, b, DistillSpec(), with_stats=True)
    assert idx is None
    assert log_s.data_ptr() == a.data_ptr() and log_p.data_ptr() == b.data_ptr()
    assert torch.equal(log_s, want_s) and torch.equal(log_p, want_p)


def test_micro_batches_with_global_weights_add_up_to_one_big_batch():
    hs, ht, w, y = make(n=16, seed=6)
    mask = torch.ones(4, 4)
    mask[0, 3] = mask[2, 2:] = 0
    big_w = (mask / mask.sum()).flatten()  # every token weighs 1 / (tokens in the whole batch)
    full, _ = fused_linear_distill(hs, w, ht, w, big_w.double())
    parts = sum(
        fused_linear_distill(hs[i : i + 8], w, ht[i : i + 8], w, big_w[i : i + 8].double())[0] for i in (0, 8)
    )
    # float64: the same 13 weighted rows summed as 8 + 5 (positive terms: <= 13*u relative), their logits
    # from differently sized matmuls (<= 40*u more): <= 6e-15 at worst; measured 1.1e-16
    torch.testing.assert_close(parts, full, rtol=1e-13, atol=0)


def test_default_weights_are_a_mean_in_the_input_dtype():
    hs, ht, w, y = make(n=12, seed=6)  # 1/12 is not a float32 number: a float32 mean would be off by ~1e-8
    loss, _ = fused_linear_distill(hs, w, ht, w)
    dense = distill_loss_dense(hs @ w.t(), ht @ w.t())
    # float64: 12 x 40 terms summed two ways, typically ~sqrt(480)*u = 2.4e-15 apart (measured 2e-16);
    # 1e-14 is 4x that and 1e6 below the ~1e-8 error of a float32 mean that this test must expose
    torch.testing.assert_close(loss, dense, rtol=1e-14, atol=0)
    explicit, _ = fused_linear_distill(hs, w, ht, w, torch.full((12,), 1 / 12, dtype=torch.float64))
    assert loss.item() == explicit.item()


# ---------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(beta=1.5), "beta must be in"),
        (dict(beta=-0.1), "beta must be in"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(clip_mode="entry", clip=-1.0), "clip must be >= 0"),
        (dict(clip_mode="sometimes"), "clip_mode must be one of"),
        (dict(mode="topk", topk=0), "topk >= 1"),
        (dict(mode="nope"), "loss mode must be one of"),
        (dict(mode="sampled", clip_mode="token", clip=1.0), "needs clip_mode=none"),
        (dict(reduction="batch"), "reduction must be one of"),
    ],
)
def test_bad_spec(kw, match):
    with pytest.raises(UserError, match=match):
        DistillSpec(**kw)


def test_topk_larger_than_the_vocabulary():
    hs, ht, w, y = make()
    spec = DistillSpec(mode="topk", topk=41)
    with pytest.raises(UserError, match="exceeds the vocabulary size V=40"):
        fused_linear_distill(hs, w, ht, w, None, y, spec)
    with pytest.raises(UserError, match="exceeds the vocabulary size V=40"):
        distill_loss_dense(hs @ w.t(), ht @ w.t(), None, y, spec)
    fused_linear_distill(hs, w, ht, w, None, y, DistillSpec(mode="topk", topk=40))


def test_spec_is_frozen_and_built_from_the_config():
    with pytest.raises(FrozenInstanceError):
        DistillSpec().beta = 0.5
    lc = LossConfig(mode="topk", topk=5, beta=0.5, clip_mode="token", clip=0.2, reduction="sequence")
    assert lc.to_spec(1.1) == DistillSpec(
        mode="topk", beta=0.5, temperature=1.1, clip_mode="token", clip=0.2, topk=5, reduction="sequence"
    )
    assert lc.to_spec(0.0).temperature == 1.0  # greedy rollouts: T = 1
    assert LossConfig(temperature=0.7).to_spec(1.1).temperature == 0.7


def test_spec_imports_without_torch():
    code = "import sys, opsd.config, opsd.loss; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shape_errors():
    hs, ht, w, y = make()
    with pytest.raises(ValueError, match="vocab size mismatch"):
        fused_linear_distill(hs, w, ht, w[:-1])
    with pytest.raises(ValueError, match="vocab size mismatch"):
        distill_loss_dense(hs @ w.t(), ht @ w[:-1].t())
    with pytest.raises(ValueError, match="rows"):
        fused_linear_distill(hs, w, ht[:-1], w)
    with pytest.raises(ValueError, match=r"\[V, H\]"):
        fused_linear_distill(hs, w[:, :-1], ht, w)
    with pytest.raises(ValueError, match="weights must have shape"):
        fused_linear_distill(hs, w, ht, w, torch.ones(3))
    with pytest.raises(ValueError, match="targets"):
        fused_linear_distill(hs, w, ht, w, spec=DistillSpec(mode="sampled"))


def test_every_mode_has_one_kernel_and_one_reference():
    """A loss mode is a name in spec.MODES, a chunk kernel in kernels.KERNELS and a dense reference in
    reference.DENSE (docs/architecture.md); the three tables name the same modes."""
    from opsd.loss import MODES
    from opsd.loss.kernels import KERNELS
    from opsd.loss.reference import DENSE

    assert set(KERNELS) == set(DENSE) == set(MODES)
