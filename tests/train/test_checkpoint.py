"""Checkpoints: safe loading, RNG state, merged export that leaves the live model untouched, failed writes."""

from __future__ import annotations

import copy
import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import opsd.checkpoint as ck
from opsd.checkpoint import (
    clean_partial,
    latest_checkpoint,
    list_checkpoints,
    load_state,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from opsd.errors import TrainingError, UserError
from opsd.models import apply_lora
from opsd.records import write_best
from opsd.tiny import build_tiny_model


def _lora(model):
    lora = apply_lora(
        model, r=4, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"], gradient_checkpointing=False
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a real delta (peft starts B at zero)
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return lora


def _train_state(model) -> dict:
    """What the trainer stores: optimizer and scheduler after a step, counters, cursor, RNG."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sum(p.sum() for p in params).backward()
    opt.step()
    sched.step()
    return {
        "step": 1,
        "bad_steps": 0,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "teacher": {"ema": [p.detach().clone() for p in params[:2]]},
        "cursor": {"num_examples": 8, "seed": 0, "shuffle": True, "epoch": 0, "position": 2},
        "truncated": {"student": 0, "teacher": 1},
        "rng": rng_state(),
    }


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_rng_state_round_trips_through_weights_only(tmp_path):
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = _draws()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


def test_save_and_load_round_trip(tiny_model, tiny_tokenizer, tmp_path):
    state = _train_state(tiny_model)
    path = save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, state, keep_last=2)
    assert path == tmp_path / "checkpoints" / "step_000001" == latest_checkpoint(tmp_path)
    loaded = load_state(path)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for k, v in state["optimizer"]["state"].items():
        assert all(torch.equal(v[name], loaded["optimizer"]["state"][k][name]) for name in v)
    assert loaded["cursor"] == state["cursor"] and loaded["scheduler"] == state["scheduler"]
    set_rng_state(loaded["rng"])
    first = _draws()
    set_rng_state(state["rng"])
    assert _draws() == first


def test_pickled_code_in_state_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    path = save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, {"step": 1}, keep_last=1)
    marker = tmp_path / "code_ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"step": 1, "rng": Payload()}, path / "state.pt")
    with pytest.raises(UserError, match=rf"{path / 'state.pt'}: refused to load.*posix.mkdir") as err:
        load_state(path)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_merged_export_leaves_bf16_weights_bit_identical(tiny_tokenizer, tmp_path):
    """The base weights are the fixed teacher: exporting merged weights must not move them one bit."""
    from transformers import AutoModelForCausalLM

    lora = _lora(build_tiny_model(tiny_tokenizer).to(torch.bfloat16))
    # the round trip the export must avoid does change bf16 weights (else this test shows nothing)
    probe = copy.deepcopy(lora)
    w0 = probe.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    probe.merge_adapter()
    probe.unmerge_adapter()
    assert not torch.equal(probe.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, w0)

    before = {k: v.clone() for k, v in lora.state_dict().items()}
    path = save_checkpoint(tmp_path, 1, lora, tiny_tokenizer, {"step": 1}, keep_last=1, save_merged=True)
    assert all(torch.equal(v, before[k]) for k, v in lora.state_dict().items())

    merged = AutoModelForCausalLM.from_pretrained(path / "merged", dtype=torch.bfloat16)
    ids = torch.tensor([tiny_tokenizer("What is 12 + 30?").input_ids])
    with torch.no_grad():
        # bf16 (spacing 2^-8): each forward rounds every product to bf16, merged W + dW once more; logits
        # |z| <= 0.66 land ~2 ulps apart (measured 7.3e-3 over 25 LoRA inits); 0.05 is 7x that, and a
        # merge that dropped the delta would be off by >= 0.6
        torch.testing.assert_close(merged(ids).logits, lora(ids).logits, rtol=0.05, atol=0.05)


def test_leftover_temporary_dirs_are_removed(tiny_model, tiny_tokenizer, tmp_path):
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_000003-123").mkdir(parents=True)
    (root / ".tmp-step_000003-123" / "state.pt").write_bytes(b"partial")
    assert clean_partial(tmp_path) == [root / ".tmp-step_000003-123"]
    assert clean_partial(tmp_path / "elsewhere") == []
    (root / ".tmp-step_000004-456" / "model").mkdir(parents=True)
    save_checkpoint(tmp_path, 5, tiny_model, tiny_tokenizer, {"step": 5}, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_000005"]


def test_resaving_a_step_replaces_it_and_keep_last_prunes(tiny_model, tiny_tokenizer, tmp_path):
    for step in (1, 2, 2, 3):
        save_checkpoint(tmp_path, step, tiny_model, tiny_tokenizer, {"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_keep_last_rotation_never_deletes_the_best(tiny_model, tiny_tokenizer, tmp_path):
    """checkpoints/best.json (opsd.guard) names a checkpoint the keep_last rotation skips; once another
    is named, prune_checkpoints drops the old one."""
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, tiny_model, tiny_tokenizer, {"step": step}, keep_last=1)
        if step == 2:
            write_best(tmp_path, 2, "eval/avg@1", 0.5, tmp_path / "checkpoints" / "step_000002")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    assert latest_checkpoint(tmp_path).name == "step_000004" and load_state(list_checkpoints(tmp_path)[0])
    write_best(tmp_path, 4, "eval/avg@1", 0.6, tmp_path / "checkpoints" / "step_000004")
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best.json", "step_000004"]
    (tmp_path / "checkpoints" / "best.json").write_text("{not json")  # unreadable: no best, plain rotation
    save_checkpoint(tmp_path, 5, tiny_model, tiny_tokenizer, {"step": 5}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005"]


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", ["state", "model"])
def test_failed_write_is_one_line_and_keeps_the_previous_checkpoint(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch, writer
):
    previous = save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, {"step": 1}, keep_last=3)
    if writer == "state":
        monkeypatch.setattr(ck.torch, "save", _disk_full)
    else:
        monkeypatch.setattr(tiny_model, "save_pretrained", _disk_full)
    with pytest.raises(TrainingError) as err:
        save_checkpoint(tmp_path, 2, tiny_model, tiny_tokenizer, {"step": 2}, keep_last=3)
    msg = str(err.value)
    assert "\n" not in msg
    assert "disk full?" in msg and "No space left on device" in msg
    assert str(tmp_path / "checkpoints") in msg and f"{previous} is intact" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert load_state(previous) == {"step": 1}


def test_failed_first_write_says_there_is_no_checkpoint(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(ck.torch, "save", _disk_full)
    with pytest.raises(TrainingError, match="no earlier checkpoint"):
        save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, {"step": 1}, keep_last=1)
    assert list(Path(tmp_path / "checkpoints").iterdir()) == []
