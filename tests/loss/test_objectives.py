"""Objectives as objects (opsd/objectives.py): GRPO with a distillation term (``grpo.distill_coef``),
and the held-out divergence metric (``eval.divergence``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd import Trainer
from opsd.cpu import LOSS_CHUNK_ROWS_HF, LOSS_SLAB_ELEMENTS
from opsd.loss import DistillSpec
from opsd.objectives import GRPO, Distillation, Scores, make_objective


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("objectives"))


def _micro_batch(n_tokens: int, lens: list[int], vocab: int, gen: torch.Generator):
    w = torch.rand(n_tokens, generator=gen, dtype=torch.float64) / n_tokens
    return SimpleNamespace(
        weights=w,
        targets=torch.randint(0, vocab, (n_tokens,), generator=gen),
        sample_indices=list(range(len(lens))),
        response_lens=lens,
        rollout_logprobs=None,
    )


def _grads(objective, s_hidden, t_hidden, head, mb, scores):
    h = s_hidden.clone().requires_grad_(True)
    w = head.clone().requires_grad_(True)
    loss, _ = objective.loss(h, t_hidden, w, mb, scores, head=w, matmul_dtype=None)
    loss.backward()
    return float(loss.detach()), h.grad, w.grad


def test_mixed_objective_gradient_is_the_sum_of_its_parts_in_float64():
    """GRPO + c * distillation: loss and gradients equal the policy-gradient part plus c times the
    distillation part, each computed alone. Same operations on the same float64 values, summed once
    more: equal to rounding of one addition, bounded by 1e-12 relative."""
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, lens = 17, 8, [3, 4]
    n = sum(lens)
    s_hidden = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    t_hidden = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    mb = _micro_batch(n, lens, vocab, gen)
    scores = Scores(advantages=[0.7, -0.4])
    distill = Distillation(DistillSpec(beta=0.0, temperature=1.1), chunk_size=4, sampling_temperature=1.1)
    coef = 0.3

    def grpo(c: float) -> GRPO:
        return GRPO(lambda r, a: 0.0, False, 1.1, 4, distill, distill_coef=c)

    mixed = _grads(grpo(coef), s_hidden, t_hidden, head, mb, scores)
    pg = _grads(grpo(0.0), s_hidden, None, head, mb, scores)
    dist = _grads(distill, s_hidden, t_hidden, head, mb, scores)
    assert dist[0] > 0 and torch.count_nonzero(dist[1]) > 0  # the teacher differs: the term is not zero
    assert math.isclose(mixed[0], pg[0] + coef * dist[0], rel_tol=1e-12)
    for i in (1, 2):
        torch.testing.assert_close(mixed[i], pg[i] + coef * dist[i], rtol=1e-12, atol=1e-15)


def test_distill_coef_zero_is_grpo_alone(assets, tmp_path):
    """No teacher term: the teacher never scores, the privileged solutions are not loaded."""
    cfg = make_cfg(assets, tmp_path / "run", objective="grpo", **{"grpo.grader": "helpers:letter_e_reward"})
    objective = make_objective(cfg, cfg.loss.chunk_size)
    assert isinstance(objective, GRPO) and not objective.uses_teacher
    tr = Trainer(cfg)
    assert all(ex.solution == "" for ex in tr.run.data.examples)
    # The tests' HF engine on a CPU: the CPU plan's loss chunks and slabs reach the objective, its
    # distillation term and the held-out divergence.
    assert tr.run.objective.chunk_size == tr.run.objective.distill.chunk_size == LOSS_CHUNK_ROWS_HF
    assert tr.run.divergence_loss.objective.chunk_size == LOSS_CHUNK_ROWS_HF
    assert (
        tr.run.objective.distill.slab_elements
        == tr.run.divergence_loss.objective.slab_elements
        == LOSS_SLAB_ELEMENTS
    )


def test_a_set_loss_chunk_size_wins_over_the_cpu_plan(assets, tmp_path):
    """``loss.chunk_size`` set: the plan's 128 rows give way; ``cpu.tuning: off``: neither chunks nor
    slabs of the plan (the loss's own 256-row choice, one slab per chunk)."""
    tr = Trainer(make_cfg(assets, tmp_path / "set", **{"loss.chunk_size": 512}))
    assert tr.run.objective.chunk_size == 512
    off = Trainer(make_cfg(assets, tmp_path / "off", **{"cpu.tuning": "off"}))
    assert off.run.objective.chunk_size is None and off.run.objective.slab_elements is None


def test_mixed_objective_uses_the_configured_privileged_teacher(assets, tmp_path):
    """With distill_coef > 0 the configured teacher (fixed: the adapter off) scores every micro-batch
    with the solution in its context. With every group's rewards equal the advantages are exactly 0,
    so all that moves the student is the distillation term: it must move (the teacher, who reads the
    solution, disagrees with the student), with loss equal to coef times the divergence loss."""
    cfg = make_cfg(
        assets,
        tmp_path / "run",
        objective="grpo",
        **{"grpo.distill_coef": 0.5, "grpo.grader": "helpers:letter_e_reward", "optim.max_steps": 1},
    )
    tr = Trainer(cfg)
    assert tr.run.objective.uses_teacher and tr.run.teacher.mode == "fixed"
    assert all(ex.solution for ex in tr.run.data.examples)
    tr.run.objective.reward = lambda response, answer: 1.0  # flat groups: no reward signal at all
    before = {k: v.detach().clone() for k, v in tr.run.model.named_parameters() if v.requires_grad}
    rec = tr.record(tr.step())
    assert rec["flat_group_frac"] == 1.0 and rec["grad_norm"] > 0 and rec["divergence"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in tr.run.model.named_parameters() if v.requires_grad)


def test_mixed_objective_needs_solutions(assets, tmp_path):
    from opsd.errors import UserError

    with pytest.raises(UserError, match="solution_key"):
        make_cfg(
            assets,
            tmp_path / "run",
            objective="grpo",
            **{"grpo.distill_coef": 0.5, "data.solution_key": "null"},
        )


@pytest.mark.parametrize("objective", ["opsd", "grpo"])
def test_heldout_divergence_is_recorded_at_evaluation(assets, tmp_path, objective):
    """eval.divergence adds eval/divergence: forward KL without clipping, so >= 0, and finite."""
    over = {
        "eval.path": assets["data"],
        "eval.every": 1,
        "eval.limit": 3,
        "eval.max_new_tokens": 4,
        "eval.divergence": True,
        "optim.max_steps": 1,
        "objective": objective,
        "grpo.grader": "helpers:letter_e_reward",
    }
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    (rec,) = tr.train()
    assert "eval/accuracy" in rec or any(k.startswith("eval/") for k in rec)
    assert math.isfinite(rec["eval/divergence"]) and rec["eval/divergence"] >= 0.0
    again = tr.heldout_divergence()  # the same seed stream at every evaluation: the same number
    assert again["divergence"] == rec["eval/divergence"]
    # the logged figures are the evaluation's own, and it repeats on the same weights
    evaluation = tr.evaluate()
    assert evaluation.divergence == rec["eval/divergence"]
    assert evaluation.metrics(prefix="eval/") == {k: v for k, v in rec.items() if k.startswith("eval/")}


@pytest.mark.parametrize(("shift", "expected"), [(math.log(1.5), 1.5), (math.log(3.0), 2.0), (0.0, 1.0)])
def test_truncated_importance_sampling_scales_the_policy_gradient(shift, expected):
    """With engine log-probs below the trainer's by ``shift`` every token's weight is
    min(exp(shift), cap=2): the loss and its gradients scale by exactly that (float64, same
    operations on scaled coefficients: 1e-12)."""
    from opsd.loss import token_logprobs

    gen = torch.Generator().manual_seed(1)
    vocab, hidden, lens = 13, 6, [2, 3]
    n = sum(lens)
    s_hidden = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    mb = _micro_batch(n, lens, vocab, gen)
    scores = Scores(advantages=[0.5, -1.0])
    distill = Distillation(DistillSpec(temperature=1.0), chunk_size=4, sampling_temperature=1.0)
    plain = _grads(GRPO(lambda r, a: 0.0, False, 1.0, 4, distill), s_hidden, None, head, mb, scores)
    mine = token_logprobs(s_hidden, head, mb.targets, temperature=1.0)
    mb.rollout_logprobs = mine - shift
    tis = GRPO(lambda r, a: 0.0, False, 1.0, 4, distill, tis_cap=2.0)
    scaled = _grads(tis, s_hidden, None, head, mb, scores)
    assert math.isclose(scaled[0], expected * plain[0], rel_tol=1e-12)
    for i in (1, 2):
        torch.testing.assert_close(scaled[i], expected * plain[i], rtol=1e-12, atol=1e-15)


def test_grpo_on_a_zero_weight_padding_micro_batch_adds_nothing():
    """Under torchrun a rank with fewer micro-batches runs zero-weight padding ones (one dummy row,
    no samples): GRPO's loss there is exactly 0 with a zero gradient, not a shape error."""
    from opsd.data.batching import zero_weight_microbatch

    mb = zero_weight_microbatch(0, "cpu")
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(11, 4, generator=gen, dtype=torch.float64)
    hidden = torch.randn(1, 4, generator=gen, dtype=torch.float64)
    distill = Distillation(DistillSpec(), chunk_size=4, sampling_temperature=1.0)
    loss, grad_h, _ = _grads(
        GRPO(lambda r, a: 0.0, False, 1.0, 4, distill), hidden, None, head, mb, Scores([])
    )
    assert loss == 0.0 and torch.count_nonzero(grad_h) == 0


def test_the_sft_objective_trains_on_the_solutions_without_rollouts_or_teacher(assets, tmp_path, monkeypatch):
    """objective=sft: each drawn row's solution and end token is its one response, the step's loss the
    token-mean cross-entropy of those tokens under the weights before the step (what `opsd sft`'s loop
    takes on the same rows); nothing is generated and no teacher scores."""
    from opsd.data.solutions import sft_pairs_from_examples
    from opsd.teacher import Teacher

    over = {"objective": "sft", "model.dtype": "float64", "optim.max_steps": 1, "checkpoint.enabled": "false"}
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    try:
        monkeypatch.setattr(tr.run.engine, "generate", lambda *a, **k: pytest.fail("sft generated a rollout"))
        monkeypatch.setattr(Teacher, "score", lambda *a, **k: pytest.fail("sft ran the teacher"))
        d = tr.cfg.data
        pairs = sft_pairs_from_examples(
            tr.run.tokenizer,
            tr.run.data.examples,
            instruction=d.instruction,
            enable_thinking=d.student_thinking,
            max_len=d.max_prompt_len + tr.cfg.rollout.max_new_tokens,
        )
        with torch.no_grad():
            nll = []
            for prompt, target in pairs:
                logits = tr.run.model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
                nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum"))
        out = tr.step()
        rows = out.example_indices
        assert len(rows) == tr.cfg.rollout.prompts_per_step and len(out.completions) == len(rows)
        for c, i in zip(out.completions, rows):
            assert c.token_ids == pairs[i][1] and c.token_ids[-1] == tr.run.tokenizer.eos_token_id
            assert c.finish_reason == "stop"
        tokens = sum(len(pairs[i][1]) for i in rows)
        dense = float(sum(nll[i] for i in rows)) / tokens
        # float64 but for the loss weights 1/n, which the batching layer keeps in float32
        assert math.isclose(float(out.loss_sum), dense, rel_tol=1e-7)
        assert tr.record(out)["tokens"] == tokens
    finally:
        tr.close()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["loss.sft_coef=0.5"], "loss.sft_coef"),
        (["teacher.solution_source=other"], "solution_source"),
        (["data.solution_key=null", "teacher.privileged=false"], "data.solution_key"),
    ],
)
def test_the_sft_objective_refuses_what_does_not_apply(keys, message):
    from opsd.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, ["data.path=x.jsonl", "objective=sft", *keys])
