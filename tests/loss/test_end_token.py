"""loss.end_token=skip: the end token that closes a stopped response weighs nothing in the loss, and
the token counts that normalize the loss leave it out."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd.data import make_microbatches, make_sample
from opsd.data.batching import TokenWeights, loss_tokens
from opsd.trainer import Trainer


def _samples():
    stopped = make_sample([1, 2], [1, 2, 3], [5, 6, 7, 2], 0, "stop")  # ends with its end token 2
    cut = make_sample([1, 2], [1, 2, 3], [5, 6, 7], 1, "length")
    lone_end = make_sample([1, 2], [1, 2, 3], [2], 2, "stop")  # the end token alone
    return [stopped, cut, lone_end]


def test_only_a_stopped_responses_end_token_is_skipped():
    stopped, cut, lone_end = _samples()
    assert [loss_tokens(s, False) for s in (stopped, cut, lone_end)] == [4, 3, 1]
    assert [loss_tokens(s, True) for s in (stopped, cut, lone_end)] == [3, 3, 0]


@pytest.mark.parametrize("reduction", ["token", "sequence"])
@pytest.mark.parametrize("skip_end", [False, True])
def test_weights_sum_to_one_over_the_tokens_the_loss_reads(reduction, skip_end):
    samples = _samples()
    lens = [loss_tokens(s, skip_end) for s in samples]
    weighting = TokenWeights(reduction, float(sum(lens)), float(sum(n > 0 for n in lens)), skip_end)
    mbs = make_microbatches(samples, max_tokens=1000, pad_id=0, weights=weighting, device="cpu")
    weights = torch.cat([mb.weights for mb in mbs])
    # float32 sums of a few reciprocals of small integers: a few ulp of 1
    assert math.isclose(weights.sum().item(), 1.0, rel_tol=1e-6)
    per_sample = {i: w for mb in mbs for i, w in zip(mb.sample_indices, mb.weights.split(mb.response_lens))}
    assert (per_sample[0][-1] == 0).item() == skip_end  # the stopped response's end token
    assert (per_sample[1] > 0).all()  # a cut response has no end token: every token is read
    assert (per_sample[2] == 0).all().item() == skip_end


def test_a_run_that_skips_end_tokens_trains(tmp_path):
    assets = build_assets(tmp_path / "assets")
    cfg = make_cfg(assets, tmp_path / "run", **{"loss.end_token": "skip", "checkpoint.enabled": "false"})
    trainer = Trainer(cfg)
    try:
        assert trainer.run.skip_end
        out = trainer.step()
        assert out.finite and math.isfinite(float(out.loss_sum))
        stopped = [c for c in out.completions if c.finish_reason == "stop"]
        read = sum(float(mb.weights.gt(0).sum()) for mb in out.batches)
        assert read == sum(len(c.token_ids) for c in out.completions) - len(stopped)
    finally:
        trainer.close()


def test_a_run_that_floors_end_tokens_trains_with_the_models_end_tokens(tmp_path):
    """loss.end_token=floor puts the tokenizer's and the model's end tokens into the loss's spec, which
    the objective and the startup line share, and trains."""
    from opsd.rollout.base import end_token_ids

    assets = build_assets(tmp_path / "assets")
    cfg = make_cfg(assets, tmp_path / "run", **{"loss.end_token": "floor", "checkpoint.enabled": "false"})
    trainer = Trainer(cfg)
    try:
        ends = tuple(end_token_ids(trainer.run.tokenizer, trainer.run.model, []))
        assert ends and trainer.run.spec.end_ids == ends == trainer.run.objective.spec.end_ids
        assert "floored" in trainer.run.spec.describe()
        out = trainer.step()
        assert out.finite and math.isfinite(float(out.loss_sum))
    finally:
        trainer.close()


def test_the_floor_needs_the_full_distributions(tmp_path):
    from opsd.config import LossConfig

    with pytest.raises(ValueError, match="end_token=floor needs mode=jsd"):
        LossConfig(end_token="floor", mode="topk", topk=4)
