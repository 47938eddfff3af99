"""The top-16 overlap mass (opsd/loss/overlap.py): its definition, the chunked kernels' sum of it, and the
trainer's ``overlap_mass`` metric on the tiny model."""

from __future__ import annotations

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd import Trainer
from opsd.loss import OVERLAP_K, DistillSpec, fused_linear_distill, topk_overlap_mass


def dense_overlap(zs: torch.Tensor, zt: torch.Tensor, temperature: float, k: int = OVERLAP_K) -> torch.Tensor:
    """Per row, ``P`` summed over the tokens in both top-k sets, from ``[N, V]`` boolean masks."""
    a, b = zs.double() / temperature, zt.double() / temperature
    p = b.softmax(-1)
    top_s = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, a.topk(k, -1).indices, True)
    top_t = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, b.topk(k, -1).indices, True)
    return (p * (top_s & top_t)).sum(-1)


def test_the_mass_matches_the_masks_and_lies_in_zero_one():
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(20, 300, generator=g, dtype=torch.float64) * 3
    zt = zs + torch.randn(20, 300, generator=g, dtype=torch.float64) * 2
    got = topk_overlap_mass(zs, zt.log_softmax(-1))
    torch.testing.assert_close(got, dense_overlap(zs, zt, 1.0), rtol=1e-12, atol=1e-15)
    assert bool((got >= 0).all()) and bool((got <= 1).all()) and 0 < float(got.mean()) < 1


def test_equal_distributions_give_the_teachers_top_k_mass_and_disjoint_ones_zero():
    z = torch.randn(5, 100, dtype=torch.float64)
    top = z.log_softmax(-1).topk(OVERLAP_K, -1).values.exp().sum(-1)
    torch.testing.assert_close(topk_overlap_mass(z + 7.0, z.log_softmax(-1)), top)
    zs = torch.zeros(1, 40, dtype=torch.float64)
    zs[0, :16] = 5.0
    zt = torch.zeros(1, 40, dtype=torch.float64)
    zt[0, 20:36] = 5.0
    assert float(topk_overlap_mass(zs, zt.log_softmax(-1))) == 0.0
    assert float(topk_overlap_mass(zs[:, :8], zt[:, :8].log_softmax(-1))) == pytest.approx(1.0)  # V < k


@pytest.mark.parametrize(
    "spec",
    [DistillSpec(temperature=0.7), DistillSpec(mode="topk", topk=5), DistillSpec(mode="sampled", beta=1.0)],
)
def test_the_chunked_kernel_sums_it_over_weighted_rows(spec):
    """The kernel's chunks and slabs (float32, as training computes) against the dense float64 masks."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 37, 16, 120
    hs = torch.randn(n, h, generator=g)
    ht = hs + 0.7 * torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g)
    weights = torch.rand(n, generator=g)
    weights[::4] = 0.0
    y = torch.randint(0, v, (n,), generator=g)
    _, stats = fused_linear_distill(hs, w, ht, w, weights, y, spec, chunk_size=8, slab_elements=3 * v)
    keep = weights != 0
    expect = dense_overlap(hs[keep] @ w.T, ht[keep] @ w.T, spec.temperature).sum()
    assert stats.overlap == pytest.approx(float(expect), rel=1e-5)
    assert 0 < stats.means()["overlap_mass"] <= 1


def test_the_trainer_logs_the_overlap_of_its_own_tokens(tmp_path):
    """On the tiny model: a step's ``overlap_mass`` is the dense top-16 overlap over the hidden states
    the loss was handed, at the loss temperature, and lies in [0, 1]."""
    cfg = make_cfg(build_assets(tmp_path / "assets"), tmp_path / "run", **{"loss.temperature": 0.8})
    tr = Trainer(cfg)
    seen = []
    loss = tr.run.forward_backward.loss

    def recording(s_hidden, t_hidden, t_head, mb, scores, **kw):
        head = tr.run.model.get_output_embeddings().weight
        keep = mb.weights != 0
        zs = s_hidden.detach()[keep].double() @ head.detach().double().T
        zt = t_hidden[keep].double() @ t_head.double().T
        seen.append(dense_overlap(zs, zt, 0.8))
        return loss(s_hidden, t_hidden, t_head, mb, scores, **kw)

    tr.run.forward_backward.loss = recording
    try:
        rec = tr.record(tr.step())
    finally:
        tr.close()
    dense = torch.cat(seen)
    assert rec["overlap_mass"] == pytest.approx(float(dense.mean()), rel=1e-4)
    assert 0.0 <= rec["overlap_mass"] <= 1.0
    assert rec["agreement"] <= 1.0
