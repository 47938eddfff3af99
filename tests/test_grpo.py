"""GRPO: group-relative advantages, the policy-gradient loss against autograd, and the objective end to end."""

from __future__ import annotations

import json

import pytest
import torch

from opsd.loss import fused_linear_policy_gradient
from opsd.rewards import flat_group_fraction, group_advantages, make_reward


def test_advantages_on_a_hand_computed_group():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5; group 1: all equal -> no signal
    adv = group_advantages([1, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1])
    assert adv == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    scaled = group_advantages([1, 0, 0, 1], [0, 0, 0, 0], scale=True)
    std = (4 * 0.25 / 3) ** 0.5  # sample standard deviation of (1, 0, 0, 1)
    assert scaled == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert flat_group_fraction([1, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]) == 0.5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_gradient_matches_autograd(temperature):
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    coef = torch.randn(n, generator=g, dtype=torch.float64)
    coef[::5] = 0  # zero-advantage rows are skipped and must contribute nothing
    loss, stats = fused_linear_policy_gradient(hidden, weight, y, coef, temperature=temperature, chunk_size=8)
    loss.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    log_s = torch.log_softmax(hidden @ weight.t() / temperature, -1)
    ref = -(coef * log_s.gather(-1, y[:, None]).squeeze(-1)).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-10, atol=1e-12)


def test_all_equal_groups_give_zero_gradient():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    coef = torch.tensor(group_advantages([1.0] * 6, [0, 0, 0, 1, 1, 1]))
    loss, _ = fused_linear_policy_gradient(hidden, weight, torch.arange(6), coef)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_reward_from_the_grader():
    math = make_reward("math")
    assert math("so the answer is \\boxed{42}", "42") == 1.0
    assert math("\\boxed{41}", "42") == 0.0
    demo = make_reward("opsd.demo.task:grade")
    assert demo("1 + 2 = 3 so 3", "3") == 1.0 and demo("so 4", "3") == 0.0


def test_unknown_grader_is_a_user_error():
    from opsd.errors import UserError

    with pytest.raises(UserError, match="grpo.grader"):
        make_reward("no.such.module:fn")
