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


class Plain:
    """A checkpoint part holding plain data (the Stateful protocol)."""

    def __init__(self, state=None) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def _saved(model, tokenizer, shared: dict | None = None, **kw) -> ck.RunState:
    """What the trainer hands :func:`save_checkpoint`: each ``shared`` entry a part of its own."""
    parts = {name: Plain(state) for name, state in (shared or {}).items()}
    return ck.RunState(model, tokenizer, shared=parts, **kw)


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
    path = save_checkpoint(tmp_path, 1, _saved(tiny_model, tiny_tokenizer, state), keep_last=2)
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
    path = save_checkpoint(tmp_path, 1, _saved(tiny_model, tiny_tokenizer, {"step": 1}), keep_last=1)
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
    path = save_checkpoint(
        tmp_path, 1, _saved(lora, tiny_tokenizer, {"step": 1}), keep_last=1, save_merged=True
    )
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
    save_checkpoint(tmp_path, 5, _saved(tiny_model, tiny_tokenizer, {"step": 5}), keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_000005"]


def test_resaving_a_step_replaces_it_and_keep_last_prunes(tiny_model, tiny_tokenizer, tmp_path):
    for step in (1, 2, 2, 3):
        save_checkpoint(tmp_path, step, _saved(tiny_model, tiny_tokenizer, {"step": step}), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_keep_last_rotation_never_deletes_the_best(tiny_model, tiny_tokenizer, tmp_path):
    """checkpoints/best.json (opsd.guard) names a checkpoint the keep_last rotation skips; once another
    is named, prune_checkpoints drops the old one."""
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _saved(tiny_model, tiny_tokenizer, {"step": step}), keep_last=1)
        if step == 2:
            write_best(tmp_path, 2, "eval/avg@1", 0.5, tmp_path / "checkpoints" / "step_000002")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    assert latest_checkpoint(tmp_path).name == "step_000004" and load_state(list_checkpoints(tmp_path)[0])
    write_best(tmp_path, 4, "eval/avg@1", 0.6, tmp_path / "checkpoints" / "step_000004")
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best.json", "step_000004"]
    (tmp_path / "checkpoints" / "best.json").write_text("{not json")  # unreadable: no best, plain rotation
    save_checkpoint(tmp_path, 5, _saved(tiny_model, tiny_tokenizer, {"step": 5}), keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005"]


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", ["state", "model"])
def test_failed_write_is_one_line_and_keeps_the_previous_checkpoint(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch, writer
):
    previous = save_checkpoint(tmp_path, 1, _saved(tiny_model, tiny_tokenizer, {"step": 1}), keep_last=3)
    if writer == "state":
        monkeypatch.setattr(ck.torch, "save", _disk_full)
    else:
        monkeypatch.setattr(tiny_model, "save_pretrained", _disk_full)
    with pytest.raises(TrainingError) as err:
        save_checkpoint(tmp_path, 2, _saved(tiny_model, tiny_tokenizer, {"step": 2}), keep_last=3)
    msg = str(err.value)
    assert "\n" not in msg
    assert "disk full?" in msg and "No space left on device" in msg
    assert str(tmp_path / "checkpoints") in msg and f"{previous} is intact" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert load_state(previous) == {"format": ck.FORMAT, "step": 1}


def test_failed_first_write_says_there_is_no_checkpoint(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(ck.torch, "save", _disk_full)
    with pytest.raises(TrainingError, match="no earlier checkpoint"):
        save_checkpoint(tmp_path, 1, _saved(tiny_model, tiny_tokenizer, {"step": 1}), keep_last=1)
    assert list(Path(tmp_path / "checkpoints").iterdir()) == []


def test_save_and_load_walk_the_named_parts(tiny_model, tiny_tokenizer, tmp_path):
    """Each shared part goes to state.pt under its name, each rank's own to its rank file; a load puts
    every one back by name, and a rank the saving run did not have gives each of its parts None."""
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    ema = {"ema.0": params[0].detach().clone() + 1}
    shared = {"progress": Plain({"step": 3, "bad_steps": 1}), "cursor": Plain({"position": 2})}
    mine = {"truncated": Plain({"student": 1, "teacher": 0})}
    run = ck.RunState(tiny_model, tiny_tokenizer, tensors=ema, shared=shared, per_rank=mine)
    path = save_checkpoint(tmp_path, 3, run, keep_last=1)
    state = load_state(path)
    assert state == {"format": ck.FORMAT, "progress": {"step": 3, "bad_steps": 1}, "cursor": {"position": 2}}
    assert set(torch.load(path / "rank_00000.pt", weights_only=True)) == {"truncated", "rng"}
    fresh = {name: Plain() for name in shared}
    fresh_mine = {"truncated": Plain()}
    target = {"ema.0": torch.zeros_like(ema["ema.0"])}
    ck.load_checkpoint(path, ck.RunState(tiny_model, tensors=target, shared=fresh, per_rank=fresh_mine))
    assert {k: p.state for k, p in fresh.items()} == {k: p.state for k, p in shared.items()}
    assert fresh_mine["truncated"].state == {"student": 1, "teacher": 0}
    assert torch.equal(target["ema.0"], ema["ema.0"])
    (path / "rank_00000.pt").unlink()  # as if this rank were new: its parts start as built
    ck.load_checkpoint(path, ck.RunState(tiny_model, shared=fresh, per_rank=fresh_mine, tensors=target))
    assert fresh_mine["truncated"].state is None


def test_old_formats_load_and_a_newer_one_is_refused_in_one_line(tiny_model, tiny_tokenizer, tmp_path):
    """Formats 1 (no key) and 2 kept the counters at the top of state.pt: they load into ``progress``.
    A format this opsd does not know is refused with one line naming it."""
    path = save_checkpoint(tmp_path, 2, _saved(tiny_model, tiny_tokenizer), keep_last=1)
    for old in ({"format": 2}, {}):
        torch.save(old | {"step": 2, "bad_steps": 1, "cursor": {"position": 4}}, path / "state.pt")
        parts = {"progress": Plain(), "cursor": Plain()}
        ck.load_checkpoint(path, ck.RunState(tiny_model, shared=parts))
        assert parts["progress"].state == {"step": 2, "bad_steps": 1}
        assert parts["cursor"].state == {"position": 4}
    torch.save({"format": ck.FORMAT + 1, "progress": {}}, path / "state.pt")
    with pytest.raises(UserError) as err:
        ck.load_checkpoint(path, ck.RunState(tiny_model, shared={"progress": Plain()}))
    assert "\n" not in str(err.value) and f"checkpoint format {ck.FORMAT + 1}" in str(err.value)
