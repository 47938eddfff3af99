"""The loss tests' shared cases: an independent formulation of the loss, inputs, and the grid of specs they
run over."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

BETAS = [0.0, 0.3, 0.5, 1.0]
CLIPS = [("none", 0.0), ("entry", 0.05), ("token", 0.3), ("scale", 0.3)]


def independent(zs, zt, targets, *, mode, beta, temperature, clip_mode, clip, topk, end_ids=()):
    """Per-token loss written with F.kl_div and explicit mixtures, in float64; ``end_ids``: the
    teacher's end mass raised to the student's where lower, as a mask and a mixture of two rescalings."""
    zs, zt = zs.double() / temperature, zt.double() / temperature
    if mode == "topk":
        idx = zt.topk(topk, -1).indices
        zs, zt = zs.gather(-1, idx), zt.gather(-1, idx)
    log_s, log_p = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    if end_ids:
        is_end = torch.zeros(zs.shape[-1], dtype=torch.bool)
        is_end[list(end_ids)] = True
        p, s = log_p.exp(), log_s.exp()
        raised = torch.where(is_end & (s > p), s, p)
        m_p, m_f = (p * is_end).sum(-1, keepdim=True), (raised * is_end).sum(-1, keepdim=True)
        log_p = torch.where(is_end, raised, p * (1 - m_f) / (1 - m_p)).log()
    if mode == "sampled":
        ls = log_s.gather(-1, targets[:, None])[:, 0]
        lp = log_p.gather(-1, targets[:, None])[:, 0]
        return -(lp - ls) * ls
    if beta == 0:
        ell = F.kl_div(log_s, log_p, reduction="none", log_target=True)  # P log(P/S)
    elif beta == 1:
        ell = F.kl_div(log_p, log_s, reduction="none", log_target=True)  # S log(S/P)
    else:
        m = (1 - beta) * log_s.exp() + beta * log_p.exp()
        ell = beta * F.kl_div(m.log(), log_p, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
            m.log(), log_s, reduction="none", log_target=True
        )
    if clip_mode == "entry":
        return ell.clamp(max=clip).sum(-1)
    rows = ell.sum(-1)
    return rows.clamp(max=clip) if clip_mode == "token" else rows  # scale: the value is unclipped


def make(n=12, h=16, v=40, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g, dtype=dtype) * scale
    ht = hs + 0.5 * torch.randn(n, h, generator=g, dtype=dtype) * scale
    w = torch.randn(v, h, generator=g, dtype=dtype) / h**0.5
    y = torch.randint(0, v, (n,), generator=g)
    return hs, ht, w, y


def cases():
    for beta, (cm, c) in itertools.product(BETAS, CLIPS):
        yield dict(mode="jsd", beta=beta, clip_mode=cm, clip=c, topk=0)
    for beta, (cm, c) in itertools.product([0.0, 0.5, 1.0], CLIPS):
        yield dict(mode="topk", beta=beta, clip_mode=cm, clip=c, topk=5)
    yield dict(mode="sampled", beta=0.0, clip_mode="none", clip=0.0, topk=0)
    for beta, (cm, c) in itertools.product(BETAS, CLIPS):  # loss.end_token=floor, two end tokens
        yield dict(mode="jsd", beta=beta, clip_mode=cm, clip=c, topk=0, end_ids=END_IDS)


END_IDS = (3, 7)
CASES = list(cases())
IDS = [f"{c['mode']}-b{c['beta']}-{c['clip_mode']}" + ("-floor" if c.get("end_ids") else "") for c in CASES]
