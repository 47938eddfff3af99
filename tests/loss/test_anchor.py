"""loss.sft_coef: the SFT anchor's gradient is the token-mean cross-entropy's on the step's reference
solutions (end token included), and a run logs it as sft_loss."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd.anchor import SFTAnchor
from opsd.config import DataConfig, load_config
from opsd.data import make_microbatches
from opsd.data.batching import TokenWeights
from opsd.data.sources import Example
from opsd.tiny import build_tiny_model, build_tiny_tokenizer
from opsd.trainer import Trainer


def test_the_anchor_is_the_token_mean_cross_entropy_of_the_solutions():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, seed=0).double()
    examples = [
        Example(problem=f"What is {a} + {b}?", solution=f"{a} + {b} = {a + b}.", answer=str(a + b), row=i)
        for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6)])
    ]
    data = DataConfig(path="x.jsonl", instruction="Add.")
    anchor = SFTAnchor(1.0, tok, examples, data, max_len=256)

    def microbatches(samples):
        n = sum(s.response_len for s in samples)
        kw = dict(weights=TokenWeights("token", float(n), float(len(samples))), device="cpu")
        return make_microbatches(samples, max_tokens=64, pad_id=0, **kw)  # several micro-batches

    sums: dict[str, float] = {}
    loss = anchor.backward(model, [0, 1, 0, 2], microbatches, nullcontext, sums)  # example 0 counted once
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    nll, count = 0.0, 0
    for i in (0, 1, 2):
        prompt, target = anchor.pair(i)
        assert target[-1] == tok.eos_token_id  # the end token is a target
        ids = torch.tensor([prompt + target])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        nll = nll + torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum")
        count += len(target)
    dense = nll / count
    dense.backward()
    # float64 throughout but for the loss weights 1/n, which the batching layer keeps in float32:
    # each token's term carries their rounding, u32 = 6e-8 relative
    dense_value = float(dense.detach())
    assert math.isclose(float(loss), dense_value, rel_tol=1e-7)
    assert math.isclose(sums["sft_loss"], dense_value, rel_tol=1e-7)
    for n, p in model.named_parameters():
        # an entry sums terms of both signs: its error is u32 of their summed magnitudes, which stay
        # within the parameter's largest entry here (measured: 1.5e-8 on 0.26)
        torch.testing.assert_close(fused[n], p.grad, rtol=0, atol=1e-7 * float(p.grad.abs().max()), msg=n)


def test_a_run_with_the_anchor_logs_sft_loss(tmp_path):
    assets = build_assets(tmp_path / "assets")
    cfg = make_cfg(assets, tmp_path / "run", **{"loss.sft_coef": "0.5", "checkpoint.enabled": "false"})
    trainer = Trainer(cfg)
    try:
        rec = trainer.record(trainer.step())
        assert rec["sft_loss"] > 0 and math.isfinite(rec["sft_loss"])
        assert math.isfinite(rec["loss"])
    finally:
        trainer.close()


def test_the_anchor_needs_the_solutions():
    with pytest.raises(ValueError, match="loss.sft_coef"):
        load_config(None, ["data.path=x.jsonl", "loss.sft_coef=0.5", "teacher.privileged=false"])
