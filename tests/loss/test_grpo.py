"""GRPO: group-relative advantages, the policy-gradient loss against autograd, and the objective end
to end."""

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
    # group_advantages divides by std + 1e-6: 1e-6 / std = 1.7e-6 relative by design (float64 rounding adds
    # ~1e-16); rel 1e-5 leaves 6x over that
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
    # float64 (u = 1.1e-16): 37 terms -A log S(y) of size <= 3.8 * 27 (|z/T| <= 20, logsumexp over V=50):
    # <= ~(37 + 50)*u*|L| = 8e-13 at |L| = 86, i.e. 1e-14 relative; measured 1.7e-16 relative
    torch.testing.assert_close(loss, ref, rtol=1e-13, atol=0)
    # gradients: sums over V=50 (hidden) or 37 rows (weight) of terms <= |A|/T * |W or h| <= 17, so
    # <= 50*u*17 = 1e-13 at worst; measured <= 1e-14 (where |g| <= 11)
    torch.testing.assert_close(gh, hidden.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, weight.grad, rtol=0, atol=1e-12)


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
    demo = make_reward("opsd.demo.task:grade_digits")
    assert demo("1 + 2 = 3 so 3", "3") == 1.0 and demo("so 4", "3") == 0.0


def test_unknown_grader_is_a_user_error():
    from opsd.errors import UserError

    with pytest.raises(UserError, match="grpo.grader"):
        make_reward("no.such.module:fn")


def _assets(root):
    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32, seed=0).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"problem": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(6)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "model", root / "train.jsonl"


def _grpo_cfg(tmp_path, model, data, *extra):
    from opsd import load_config

    return load_config(
        None,
        [
            f"model.path={model}",
            f"data.path={data}",
            f"logging.run_dir={tmp_path / 'run'}",
            "objective=grpo",
            "rollout.engine=hf",
            "data.solution_key=null",
            "model.lora.r=4",
            "model.lora.alpha=8",
            "rollout.prompts_per_step=2",
            "rollout.n=4",
            "rollout.max_new_tokens=4",
            "rollout.temperature=1.0",
            "optim.lr=0.05",
            "optim.max_steps=2",
            "checkpoint.enabled=false",
            "logging.progress=false",
            "logging.sample_every=0",
            "device=cpu",
            *extra,
        ],
    )


def test_grpo_trains_the_tiny_model_with_rewards_from_a_grader(tmp_path, monkeypatch):
    """A grader that rewards responses containing a given token id gives a signal; all-equal rewards none."""
    from opsd import Trainer

    model, data = _assets(tmp_path)
    tr = Trainer(_grpo_cfg(tmp_path, model, data))
    calls = []

    def reward(response: str, answer: str) -> float:  # deterministic, varies across a group
        calls.append(answer)
        return float(len(response) % 2)

    tr.run.objective.reward = reward
    before = {k: v.detach().clone() for k, v in tr.run.model.named_parameters() if v.requires_grad}
    rec = tr.record(tr.step())
    assert len(calls) == 8 and set(calls) <= {
        str(a + 1) for a in range(6)
    }  # every response graded against its answer
    assert 0.0 <= rec["reward_mean"] <= 1.0 and 0.0 <= rec["flat_group_frac"] <= 1.0
    moved = any(not torch.equal(v, before[k]) for k, v in tr.run.model.named_parameters() if v.requires_grad)
    assert moved == (rec["flat_group_frac"] < 1.0)

    tr = Trainer(_grpo_cfg(tmp_path, model, data), overwrite=True)  # fresh: no AdamW momentum
    tr.run.objective.reward = lambda response, answer: (
        1.0
    )  # every group flat: zero advantage, zero gradient, no movement
    before = {k: v.detach().clone() for k, v in tr.run.model.named_parameters() if v.requires_grad}
    rec = tr.record(tr.step())
    assert rec["flat_group_frac"] == 1.0 and rec["grad_norm"] == 0.0 and rec["loss"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in tr.run.model.named_parameters() if v.requires_grad)


def test_grpo_needs_answers_and_groups(tmp_path):
    from opsd.errors import UserError

    model, data = _assets(tmp_path)
    with pytest.raises(UserError, match="rollout.n >= 2"):
        _grpo_cfg(tmp_path, model, data, "rollout.n=1")
    noans = tmp_path / "noans.jsonl"
    noans.write_text(json.dumps({"problem": "What is 1 + 1?"}) + "\n")
    from opsd import Trainer

    with pytest.raises(UserError, match="answer"):
        Trainer(_grpo_cfg(tmp_path, model, noans))
