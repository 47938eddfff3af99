"""``eval.sets``: every named set reported beside eval.path, the split of a set's accuracy by answers seen
in training, and the drift from the initial model (the bucketed KL, its reference kept in the run
directory, against float64 computed apart from the code under test)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd.eval.sets import bucketed_kl, bucketed_logprobs, load_sets, reference_samples
from opsd.rollout import Completion
from opsd.trainer import Trainer

U32 = 2.0**-24  # float32's unit roundoff

# --- the bucketed KL on random logits ----------------------------------------------------------------


def _logits(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 logit blocks [rows, vocab], spread enough that each row's KL is of order 1."""
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(rows, vocab, generator=g), 2 * torch.randn(rows, vocab, generator=g)


def _kl32(ref: torch.Tensor, model: torch.Tensor, k: int) -> torch.Tensor:
    index, ref_top, ref_rest = bucketed_logprobs(ref, None, k)
    _, top, rest = bucketed_logprobs(model, index, 0)
    return bucketed_kl(ref_top, ref_rest, top, rest)


def _kl64(ref: torch.Tensor, model: torch.Tensor, k: int) -> torch.Tensor:
    """KL(p || q) per row in float64 over p's ``k`` most likely tokens and the rest as one outcome, summed
    from probabilities (no log-sum-exp): the definition, written apart from the code under test."""
    p, q = ref.double().softmax(-1), model.double().softmax(-1)
    kept = torch.zeros_like(p, dtype=torch.bool).scatter(-1, p.topk(k, dim=-1).indices, True)
    terms = torch.where(kept, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)
    p_rest, q_rest = (p * ~kept).sum(-1), (q * ~kept).sum(-1)
    tail = torch.where(p_rest > 0, p_rest * (p_rest.log() - q_rest.log()), torch.zeros_like(p_rest))
    return terms + tail


# Each float32 log-prob is logit - logsumexp: a few roundings of |log p| <= 20 here, so within
# 4 u32 * 20 = 5e-6 absolute; a KL sums p * (a - b) over the row, weights summing to 1, so its error is
# within 2 * 5e-6 = 1e-5 absolute, plus the float32 sum's V * u32 relative (3e-6 at V = 50).
ATOL, RTOL = 1e-5, 50 * U32


def test_bucketed_kl_at_the_vocabulary_size_is_the_full_kl() -> None:
    """With K = V the bucket is empty (its log-prob -inf, its term 0): the dense KL."""
    ref, model = _logits(7, 50, seed=0)
    index, _, ref_rest = bucketed_logprobs(ref, None, 50)
    assert torch.equal(index.sort(-1).values, torch.arange(50).expand(7, 50))
    assert torch.isneginf(ref_rest).all()
    lp, lq = ref.double().log_softmax(-1), model.double().log_softmax(-1)
    dense = (lp.exp() * (lp - lq)).sum(-1)
    assert (dense > 0.5).all()  # the tolerance is small against the values
    torch.testing.assert_close(_kl32(ref, model, 50).double(), dense, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_bucketed_kl_below_the_vocabulary_size_is_the_coarse_grained_kl(k: int) -> None:
    ref, model = _logits(7, 50, seed=1)
    want = _kl64(ref, model, k)
    assert (want > 0.05).all()
    torch.testing.assert_close(_kl32(ref, model, k).double(), want, rtol=RTOL, atol=ATOL)


def test_bucketed_kl_is_a_lower_bound_rising_to_the_full_kl() -> None:
    """Coarse-graining never raises a divergence: 0 <= KL over the top K and the rest <= the full KL, and
    since the top K + 1 refine the top K, the bound rises with K (each to within the float32 error)."""
    ref, model = _logits(9, 50, seed=2)
    kls = torch.stack([_kl32(ref, model, k).double() for k in range(1, 51)])
    slack = ATOL + RTOL * kls.abs()
    assert (kls >= -slack).all()
    assert (kls[:-1] <= kls[-1] + slack[-1]).all()
    assert (kls[1:] >= kls[:-1] - slack[1:]).all()
    assert (kls[0] < 0.5 * kls[-1]).any()  # the bound is not vacuous: one kept token loses a lot


def test_the_kl_of_a_distribution_with_itself_is_zero() -> None:
    ref, _ = _logits(5, 50, seed=3)
    for k in (1, 10, 50):
        assert torch.equal(_kl32(ref, ref.clone(), k), torch.zeros(5))


# --- sets during training ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """The trainer's tiny assets (training answers 3, 7, 11, 15, 10, 4, 9, 7) and a small held-out set."""
    root = tmp_path_factory.mktemp("sets")
    out = build_assets(root)
    rows = [{"problem": f"Name the colour number {i}.", "answer": str(i)} for i in range(3)]
    (root / "retention.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out | {"retention": str(root / "retention.jsonl")}


# Set B: which rows' answers are training answers, and what the scripted model answers (exact grader).
B_ROWS = [
    ("Who keeps the lighthouse?", "7", "7"),  # seen, right
    ("Which river runs north?", "3", "According to the map, 4"),  # seen, wrong
    ("How tall is the tower?", "100", "100."),  # other, right
    ("How old is the bridge?", "200", "old"),  # other, wrong
    ("Which gate is open?", "11", "11."),  # seen, right
]
# The training file's first 3 rows, read by eval.path and set A (contains grader).
A_ANSWERS = ["The answer is 3", "according to me, 8", "none"]  # right, wrong, wrong


def _scripted(tokenizer, prompts, n, params) -> list[Completion]:
    """Each prompt answered by its problem's scripted text, the same for all ``n`` samples."""
    script = {p: text for p, _, text in B_ROWS}
    script |= {f"What is {a} + {b}?": t for (a, b), t in zip([(1, 2), (3, 4), (5, 6)], A_ANSWERS)}
    out = []
    for i, ids in enumerate(prompts):
        text = tokenizer.decode(ids)
        (answer,) = [t for problem, t in script.items() if problem in text]
        tokens = tokenizer.encode(answer)
        out += [Completion(i, tokens, [0.0] * len(tokens), "stop") for _ in range(n)]
    return out


def test_every_set_is_reported_and_split_by_answers_seen_in_training(assets, tmp_path, monkeypatch):
    """Two sets beside eval.path, each under its own grader: avg@1, the seen/other split and the
    artifact share all match a hand count of the scripted responses."""
    b_path = tmp_path / "b.jsonl"
    b_path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a, _ in B_ROWS))
    over = {
        "eval.path": assets["data"],
        "eval.limit": 3,
        "eval.artifacts": '["According to"]',
        "eval.sets.A.path": assets["data"],
        "eval.sets.A.limit": 3,
        "eval.sets.A.grader": "contains",
        "eval.sets.B.path": str(b_path),
        "eval.sets.B.grader": "exact",
        "eval.sets.B.seen_answers": "true",
        "checkpoint.enabled": "false",
    }
    trainer = Trainer(make_cfg(assets, tmp_path / "run", **over))
    try:
        monkeypatch.setattr(trainer.run.engine, "generate", lambda *a: _scripted(trainer.run.tokenizer, *a))
        m = trainer.evaluate().metrics()
    finally:
        trainer.close()
    assert m["eval/avg@1"] == 0.0  # eval.grader math: no \boxed{} anywhere
    assert m["eval/artifacts"] == pytest.approx(1 / 3)
    assert m["eval/A/avg@1"] == pytest.approx(1 / 3) and m["eval/A/artifacts"] == pytest.approx(1 / 3)
    assert m["eval/B/avg@1"] == pytest.approx(3 / 5) and m["eval/B/artifacts"] == pytest.approx(1 / 5)
    assert m["eval/B/seen"] == pytest.approx(2 / 3)  # rows 0, 1, 4 answer 7, 3, 11: training answers
    assert m["eval/B/other"] == pytest.approx(1 / 2)
    assert not {"eval/A/seen", "eval/A/other", "eval/A/drift", "eval/B/drift"} & set(m)


def test_a_set_saved_as_a_dataset_dict_is_read_at_eval_split(assets, tmp_path):
    """A set is read like eval.path: a DatasetDict at ``eval.split``, not the loader's default ``train``."""
    import datasets

    rows = [{"problem": f"Question {i}?", "answer": str(i)} for i in range(3)]
    whole = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": whole, "test": whole.select([2])}).save_to_disk(str(tmp_path / "dd"))
    over = {"eval.path": assets["data"], "eval.sets.R.path": str(tmp_path / "dd")}
    cfg = make_cfg(assets, tmp_path / "run", **over)
    assert [ex.answer for ex in load_sets(cfg, [])[0].examples] == ["2"]  # eval.split defaults to test
    cfg = make_cfg(assets, tmp_path / "run", **over, **{"eval.split": "train"})
    assert [ex.answer for ex in load_sets(cfg, [])[0].examples] == ["0", "1", "2"]


def test_the_sets_are_logged_with_each_evaluation(assets, tmp_path):
    over = {
        "eval.path": assets["data"],
        "eval.limit": 2,
        "eval.every": 1,
        "eval.max_new_tokens": 4,
        "eval.sets.A.path": assets["retention"],
        "eval.sets.B.path": assets["data"],
        "eval.sets.B.limit": 2,
        "optim.max_steps": 1,
    }
    Trainer(make_cfg(assets, tmp_path / "run", **over)).train()
    (rec,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("eval/avg@1", "eval/A/avg@1", "eval/B/avg@1", "eval/A/pass@1", "eval/B/pass@1"):
        assert 0.0 <= rec[key] <= 1.0, key


# --- drift ---------------------------------------------------------------------------------------------


def _drift_cfg(assets: dict, run: Path, **over):
    base = {
        "eval.path": assets["data"],
        "eval.limit": 1,
        "eval.max_new_tokens": 8,
        "eval.sets.R.path": assets["retention"],
        "eval.sets.R.drift": "true",
        "eval.drift_topk": 16,
    }
    return make_cfg(assets, run, **(base | over))


def _reference(run: Path) -> dict:
    return torch.load(run / "drift_reference_R.pt", weights_only=True)


def test_the_initial_model_has_no_drift(assets, tmp_path):
    """Evaluated as built, the model is the reference: each token's KL sums p * (a - b) over log-probs
    computed alike, so |drift| is within float32's rounding of them, 2 u32 max|log p|."""
    trainer = Trainer(_drift_cfg(assets, tmp_path / "run"))
    try:
        drift = trainer.evaluate().metrics()["eval/R/drift"]
    finally:
        trainer.close()
    ref = _reference(tmp_path / "run")
    assert len(ref["responses"]) == 3 and all(ref["responses"])  # one greedy answer per row
    assert all(t.shape == (len(r), 16) for t, r in zip(ref["top"], ref["responses"]))
    largest = max(float(torch.cat([t.flatten(), r]).abs().max()) for t, r in zip(ref["top"], ref["rest"]))
    assert abs(drift) <= 2 * U32 * largest


def _perturb(model: torch.nn.Module, scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _logprobs64(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float64 log-probs [len(response), V] at the response's positions, from a plain forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return logits.double().log_softmax(-1)


def _drift64(
    ref: dict, initial: torch.nn.Module, now: torch.nn.Module, now32: list[torch.Tensor]
) -> tuple[float, float]:
    """The mean per-token KL(initial || now) over the cached answers' tokens, each position's kept tokens
    the reference's and the rest one outcome, all in float64; and the largest error of the float32
    log-probs (the cached initial ones, ``now32`` the model's logits now) against float64."""
    total, tokens, err = 0.0, 0, 0.0
    for j, (prompt, response) in enumerate(zip(ref["prompts"], ref["responses"])):
        index = ref["index"][j]
        lp, lq = _logprobs64(initial, prompt, response), _logprobs64(now, prompt, response)
        err = max(err, float((ref["top"][j].double() - lp.gather(-1, index)).abs().max()))
        err = max(err, float((now32[j].log_softmax(-1).double() - lq).abs().max()))
        # the kept tokens are the initial model's most likely, up to the float32 error
        rest = lp.scatter(-1, index, float("-inf"))
        assert (lp.gather(-1, index).min(-1).values >= rest.max(-1).values - 1e-5).all()
        kept = torch.zeros_like(lp, dtype=torch.bool).scatter(-1, index, True)
        p, q = lp.exp(), lq.exp()
        kl = torch.where(kept, p * (lp - lq), torch.zeros_like(p)).sum(-1)
        p_rest, q_rest = (p * ~kept).sum(-1), (q * ~kept).sum(-1)
        total += float((kl + p_rest * (p_rest.log() - q_rest.log())).sum())
        tokens += len(response)
    return total / tokens, err


def test_drift_after_a_change_is_the_float64_kl_from_the_initial_model(assets, tmp_path):
    """The model moved (its LoRA weights perturbed): the drift is the float64 bucketed KL from the
    initial model, computed by plain forwards on the cached answers. A token's KL sums p * (a - b) with
    p summing to 1 over float32 log-probs each within ``err`` of float64 (measured here, 3e-6 at most), so
    it is within 2 err, and so is the mean."""
    trainer = Trainer(_drift_cfg(assets, tmp_path / "run"))
    try:
        initial = copy.deepcopy(trainer.run.model).double().eval()
        _perturb(trainer.run.model, 0.5)
        now = copy.deepcopy(trainer.run.model).double().eval()
        drift = trainer.evaluate().metrics()["eval/R/drift"]
        ref = _reference(tmp_path / "run")
        now32 = trainer.answer_logits()(reference_samples(ref))
    finally:
        trainer.close()
    want, err = _drift64(ref, initial, now, now32)
    assert err <= 1e-5  # float32 forwards of a 2-layer width-32 model
    assert want > 100 * 2 * err  # far above the bound: a wrong drift is told apart
    assert abs(drift - want) <= 2 * err


def test_a_resumed_run_keeps_the_initial_models_reference(assets, tmp_path):
    """The reference is computed once, before any step or resume: a resumed run reads it (the same file,
    the same drift as the run that wrote it at the same weights), never recomputes it from the
    resumed weights (which would make its drift 0)."""
    cfg = _drift_cfg(assets, tmp_path / "run", **{"optim.lr": 0.05, "optim.max_steps": 2})
    trainer = Trainer(cfg)
    try:
        trainer.train(until_step=1)
        before = trainer.evaluate().metrics()["eval/R/drift"]
    finally:
        trainer.close()
    written = (tmp_path / "run" / "drift_reference_R.pt").read_bytes()
    resumed = Trainer(cfg, resume=True)
    try:
        after = resumed.evaluate().metrics()["eval/R/drift"]
    finally:
        resumed.close()
    assert (tmp_path / "run" / "drift_reference_R.pt").read_bytes() == written
    assert before > 1e-5  # a reference recomputed at the resumed weights gives 0 (within 1e-6)
    assert after == pytest.approx(before, rel=1e-5)  # the same weights, reloaded from float32 exactly
