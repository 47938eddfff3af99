"""RLSD (``objective: rlsd``, opsd/objectives.py): the token advantages against a dense float64 reference
written from the formula, the loss's gradient by autograd, the teacher's decaying share, the config keys,
and a few training steps of the tiny model with their metrics."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd import Trainer
from opsd.config import Config
from opsd.errors import UserError
from opsd.loss import DistillSpec
from opsd.objectives import GRPO, RLSD, Distillation, Scores, make_objective

T = 1.3  # the loss temperature, not 1, so that a missing division by it shows


def _objective(lam: float, epsilon: float, decay_steps: int = 0, chunk: int = 4) -> RLSD:
    distill = Distillation(DistillSpec(temperature=T), chunk_size=chunk, sampling_temperature=T)
    grpo = GRPO(lambda r, a: 0.0, False, T, chunk, distill)
    return RLSD(grpo, lam=lam, decay_steps=decay_steps, epsilon=epsilon)


def _case(seed: int = 0):
    """Float64 hidden states of a student and of a teacher with its own head; four responses, one of
    them with advantage 0; some rows of weight 0."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, lens = 23, 8, [3, 5, 2, 4]
    n = sum(lens)
    s_hidden = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    t_hidden = s_hidden + 0.8 * torch.randn(n, hidden, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    t_head = head + 0.3 * torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    weights = torch.rand(n, generator=g, dtype=torch.float64) / n
    weights[[2, 11]] = 0.0
    mb = SimpleNamespace(
        weights=weights,
        targets=torch.randint(0, vocab, (n,), generator=g),
        sample_indices=list(range(len(lens))),
        response_lens=lens,
        rollout_logprobs=None,
    )
    return s_hidden, t_hidden, t_head, head, mb, Scores(advantages=[0.8, -0.6, 0.0, 1.5])


def _dense_advantages(s_hidden, t_hidden, t_head, head, mb, scores, lam, epsilon) -> list[float]:
    """``A_t = A ((1 - lam) + lam clip(exp(sign(A) (log P(y_t) - log S(y_t))), 1 - eps, 1 + eps))``, token
    by token, from the full ``[N, V]`` log-softmaxes."""
    log_s = (s_hidden @ head.T / T).log_softmax(-1)
    log_p = (t_hidden @ t_head.T / T).log_softmax(-1)
    per_token = [scores.advantages[i] for i, n in zip(mb.sample_indices, mb.response_lens) for _ in range(n)]
    out = []
    for row, (a, y) in enumerate(zip(per_token, mb.targets.tolist())):
        if a == 0.0 or float(mb.weights[row]) == 0.0:
            out.append(0.0)  # no advantage, or a row the loss does not read
            continue
        delta = float(log_p[row, y] - log_s[row, y])
        w = min(max(math.exp(math.copysign(1.0, a) * delta), 1 - epsilon), 1 + epsilon)
        out.append(a * ((1 - lam) + lam * w))
    return out


@pytest.mark.parametrize("lam, epsilon", [(0.5, 0.2), (1.0, 0.05), (0.3, 0.9)])
def test_token_advantages_match_the_formula_in_float64(lam, epsilon):
    s_hidden, t_hidden, t_head, head, mb, scores = _case()
    obj = _objective(lam, epsilon)
    scores.teacher_share = lam
    scores.sums = {"rlsd_weight_sum": 0.0, "rlsd_weight_clipped": 0.0, "rlsd_weight_tokens": 0.0}
    credit, _, stats = obj.credit(s_hidden, t_hidden, t_head, mb, scores, head)
    expect = torch.tensor(
        _dense_advantages(s_hidden, t_hidden, t_head, head, mb, scores, lam, epsilon), dtype=torch.float64
    )
    torch.testing.assert_close(credit, expect, rtol=1e-12, atol=1e-15)
    # Weights are summed over the tokens read with a non-zero advantage (rows 2 and 11 weigh 0, the third
    # response's two tokens have advantage 0).
    assert scores.sums["rlsd_weight_tokens"] == 14 - 2 - 2
    assert 1 - epsilon <= scores.sums["rlsd_weight_sum"] / scores.sums["rlsd_weight_tokens"] <= 1 + epsilon
    assert stats.tokens == float((mb.weights != 0).sum()) and 0 < stats.overlap <= stats.tokens
    assert torch.all(credit[6:8] * -0.6 >= 0)  # the verifier sets the sign; the teacher never flips it


def test_the_loss_is_the_policy_gradient_of_those_advantages_by_autograd():
    """``-sum_n w_n A_t log S(y_n)`` with ``A_t`` held constant: loss and gradients (hidden states and
    head) against autograd over the dense float64 logits."""
    lam, epsilon = 0.6, 0.25
    s_hidden, t_hidden, t_head, head, mb, scores = _case(seed=1)
    obj = _objective(lam, epsilon)
    scores.teacher_share = lam
    scores.sums = {"rlsd_weight_sum": 0.0, "rlsd_weight_clipped": 0.0, "rlsd_weight_tokens": 0.0}
    h = s_hidden.clone().requires_grad_(True)
    w = head.clone().requires_grad_(True)
    loss, _ = obj.loss(h, t_hidden, t_head, mb, scores, head=w, matmul_dtype=None)
    loss.backward()
    credit = torch.tensor(
        _dense_advantages(s_hidden, t_hidden, t_head, head, mb, scores, lam, epsilon), dtype=torch.float64
    )
    h_ref = s_hidden.clone().requires_grad_(True)
    w_ref = head.clone().requires_grad_(True)
    log_s = (h_ref @ w_ref.T / T).log_softmax(-1).gather(-1, mb.targets[:, None]).squeeze(-1)
    ref = -(mb.weights * credit * log_s).sum()
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-12, atol=1e-15)


def test_a_zero_share_is_grpo():
    s_hidden, t_hidden, t_head, head, mb, scores = _case(seed=2)
    obj = _objective(0.0, 0.2)
    scores.sums = {"rlsd_weight_sum": 0.0, "rlsd_weight_clipped": 0.0, "rlsd_weight_tokens": 0.0}
    rlsd, _ = obj.loss(s_hidden, t_hidden, t_head, mb, scores, head=head, matmul_dtype=None)
    grpo, _ = obj.grpo.loss(s_hidden, None, None, mb, scores, head=head, matmul_dtype=None)
    assert float(rlsd) == pytest.approx(float(grpo), rel=1e-12)


def test_the_teachers_share_falls_linearly_to_zero():
    obj = _objective(0.5, 0.2, decay_steps=4)
    assert [obj.teacher_share(s) for s in (0, 1, 2, 4, 9)] == [0.5, 0.375, 0.25, 0.0, 0.0]
    assert _objective(0.5, 0.2, decay_steps=0).teacher_share(1000) == 0.5  # 0: no decay


def _assets_cfg(tmp_path, **over):
    over = {"objective": "rlsd", "grpo.grader": "helpers:letter_e_reward", **over}
    return make_cfg(build_assets(tmp_path / "assets"), tmp_path / "run", **over)


def test_the_keys_their_defaults_and_their_checks(tmp_path):
    cfg = _assets_cfg(tmp_path, **{"rlsd.lambda": 0.3, "rlsd.lambda_decay_steps": 7, "rlsd.epsilon_w": 0.1})
    obj = make_objective(cfg, None)
    assert isinstance(obj, RLSD) and obj.uses_teacher and obj.needs_answers
    assert (obj.lam, obj.decay_steps, obj.epsilon) == (0.3, 7, 0.1)
    assert obj.grpo.distill_coef == 0.0 and not obj.grpo.uses_teacher  # the teacher reweights; no KL term
    assert cfg.model_dump(mode="json")["rlsd"] == {"lambda": 0.3, "lambda_decay_steps": 7, "epsilon_w": 0.1}
    assert (
        Config.model_validate(cfg.model_dump(mode="json")).rlsd == cfg.rlsd
    )  # a run's config.yaml reads back
    default = Config.model_fields["rlsd"].default
    assert (default.lambda_, default.lambda_decay_steps, default.epsilon_w) == (0.5, 50, 0.2)
    with pytest.raises(UserError, match=r"rlsd\.lambda"):
        _assets_cfg(tmp_path, **{"rlsd.lambda": 1.5})
    with pytest.raises(UserError, match=r"rlsd\.epsilon_w"):
        _assets_cfg(tmp_path, **{"rlsd.epsilon_w": 1.0})
    with pytest.raises(UserError, match=r"rollout\.n >= 2"):
        _assets_cfg(tmp_path, **{"rollout.n": 1})
    with pytest.raises(UserError, match="solution_key"):
        _assets_cfg(tmp_path, **{"data.solution_key": "null"})


def test_rlsd_trains_the_tiny_model_and_logs_its_metrics(tmp_path):
    """Three steps with the share decaying over two: each step's record has the reward, the share, the
    token weights within their clip, and the teacher's agreement and overlap on the student's tokens."""
    cfg = _assets_cfg(
        tmp_path,
        **{
            "rollout.n": 4,
            "optim.max_steps": 3,
            "rlsd.lambda": 0.8,
            "rlsd.lambda_decay_steps": 2,
            "checkpoint.enabled": "false",
        },
    )
    tr = Trainer(cfg)
    before = {k: v.detach().clone() for k, v in tr.run.model.named_parameters() if v.requires_grad}
    try:
        history = tr.train()
    finally:
        tr.close()
    assert [r["rlsd_lambda"] for r in history] == pytest.approx([0.8, 0.4, 0.0])
    for r in history:
        assert math.isfinite(r["loss"]) and 0.0 <= r["reward_mean"] <= 1.0
        assert 0.8 <= r["rlsd_weight_mean"] <= 1.2 and 0.0 <= r["rlsd_weight_clip_frac"] <= 1.0
        assert 0.0 <= r["agreement"] <= 1.0 and 0.0 <= r["overlap_mass"] <= 1.0 and r["divergence"] != 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and all("rlsd_weight_mean" in x for x in lines)
    assert any(not torch.equal(v, before[k]) for k, v in tr.run.model.named_parameters() if v.requires_grad)
