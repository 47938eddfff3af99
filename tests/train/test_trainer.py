"""End-to-end trainer runs on a tiny random model: modes, resume, faults, checkpoints, the command.
tests/train/test_trainer_step.py runs the step's parts."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from helpers import build_assets, make_cfg

import opsd.objectives as objectives_mod
import opsd.trainer as trainer_mod
from opsd import Trainer
from opsd.checkpoint import list_checkpoints
from opsd.errors import UserError
from opsd.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("assets"))


def _frozen(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize(
    "over",
    [
        {"teacher.mode": "fixed"},
        {"teacher.mode": "ema", "teacher.ema_decay": 0.5},
        {"teacher.mode": "live"},
        {"teacher.mode": "fixed", "model.lora.enabled": "false", "teacher.frozen_copy": "cpu"},
        {"loss.mode": "topk", "loss.topk": 5, "loss.beta": 0.5},
        {"loss.mode": "sampled"},
        {"loss.clip_mode": "entry", "loss.clip": 0.05, "loss.reduction": "sequence"},
    ],
    ids=["fixed-lora", "ema", "live", "fixed-full", "topk", "sampled", "entry-clip-seq"],
)
def test_modes_train_and_teacher_stays_fixed(assets, tmp_path, over):
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    student0 = {k: v.detach().clone() for k, v in tr.run.model.named_parameters() if v.requires_grad}
    frozen0 = _frozen(tr.run.teacher.model) if tr.run.teacher.model is not None else None
    base0 = {k: v.detach().clone() for k, v in tr.run.model.named_parameters() if not v.requires_grad}
    ema0 = [e.clone() for e in tr.run.teacher.ema]
    hist = tr.train()
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    if over.get("loss.mode") != "sampled":  # the sampled estimate of the divergence can be negative
        assert all(h["divergence"] > 0 for h in hist)
    changed = [
        k for k, v in tr.run.model.named_parameters() if v.requires_grad and not torch.equal(v, student0[k])
    ]
    assert changed, "the student's weights did not change"
    if over.get("teacher.mode", "fixed") == "fixed":
        if frozen0 is not None:  # full fine-tuning: the frozen copy is untouched
            for k, v in tr.run.teacher.model.named_parameters():
                assert torch.equal(v, frozen0[k]), k
        else:  # LoRA: the teacher is the base weights, which never train
            for k, v in tr.run.model.named_parameters():
                if not v.requires_grad:
                    assert torch.equal(v, base0[k]), k
    if over.get("teacher.mode") == "ema":
        assert any(not torch.equal(a, b) for a, b in zip(ema0, tr.run.teacher.ema))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for key in (
        "step",
        "loss",
        "divergence",
        "clip_frac",
        "entropy_student",
        "entropy_teacher",
        "agreement",
        "resp_len_mean",
        "resp_len_max",
        "truncated_frac",
        "tokens_per_s",
        "time_rollout",
        "time_teacher",
        "time_student",
        "time_loss",
        "time_optim",
        "peak_mem_gb",
        "lr",
        "grad_norm",
    ):
        assert all(key in r for r in recs), key
    assert [r["step"] for r in recs] == [1, 2]
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (tmp_path / "run" / "samples.jsonl").is_file()
    ckpts = list_checkpoints(tmp_path / "run")
    assert [c.name for c in ckpts] == ["step_000001", "step_000002"]


def test_external_teacher(assets, tmp_path):
    tr = Trainer(
        make_cfg(assets, tmp_path / "run", **{"teacher.mode": "external", "teacher.path": assets["other"]})
    )
    t0 = _frozen(tr.run.teacher.model)
    hist = tr.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert all(torch.equal(v, t0[k]) for k, v in tr.run.teacher.model.named_parameters())


def test_external_teacher_with_other_tokenizer_is_refused(assets, tmp_path):
    other = tmp_path / "othertok"
    tok = build_tiny_tokenizer(texts=["completely different corpus"] * 3, vocab_size=300)
    m = build_tiny_model(tok, hidden_size=32)
    m.save_pretrained(other)
    tok.save_pretrained(other)
    cfg = make_cfg(assets, tmp_path / "run", **{"teacher.mode": "external", "teacher.path": str(other)})
    with pytest.raises(ValueError, match="tokenizer differs"):
        Trainer(cfg)


def test_resume_is_exact(assets, tmp_path):
    over = {
        "optim.max_steps": 6,
        "optim.scheduler": "cosine",
        "optim.warmup_steps": 2,
        "teacher.mode": "ema",
        "teacher.ema_decay": 0.7,
        "model.lora.dropout": 0.1,
    }
    full = Trainer(make_cfg(assets, tmp_path / "a", **over)).train()
    first = Trainer(make_cfg(assets, tmp_path / "b", **over))
    first.train(until_step=3)
    resumed = Trainer(make_cfg(assets, tmp_path / "b", **over), resume=True)
    assert resumed.step_num == 3
    rest = resumed.train()
    assert [r["step"] for r in rest] == [4, 5, 6]
    for a, b in zip(full[3:], rest):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a["step"], a["loss"], b["loss"])
        assert abs(a["divergence"] - b["divergence"]) < 1e-6


def test_a_checkpoint_in_the_format_before_resumes_exactly(assets, tmp_path):
    """Format 2 (opsd.checkpoint.FORMAT's history) kept the run's counters at the top of state.pt: such a
    checkpoint resumes as exactly as one written now."""
    over = {
        "optim.max_steps": 4,
        "optim.scheduler": "cosine",
        "teacher.mode": "ema",
        "teacher.ema_decay": 0.7,
    }
    full = Trainer(make_cfg(assets, tmp_path / "a", **over)).train()
    Trainer(make_cfg(assets, tmp_path / "b", **over)).train(until_step=2)
    path = list_checkpoints(tmp_path / "b")[-1] / "state.pt"
    state = torch.load(path, weights_only=True)
    old = {k: v for k, v in state.items() if k != "progress"} | state["progress"] | {"format": 2}
    torch.save(old, path)
    rest = Trainer(make_cfg(assets, tmp_path / "b", **over), resume=True).train()
    assert [r["step"] for r in rest] == [3, 4]
    for a, b in zip(full[2:], rest):
        assert a["loss"] == b["loss"] and a["divergence"] == b["divergence"], (
            a["step"],
            a["loss"],
            b["loss"],
        )


def test_sft_resume_is_exact(assets, tmp_path):
    """objective=sft draws its rows from the same resumable cursor: a resume across an epoch boundary
    trains on the rows and weights an uninterrupted run does."""
    over = {"objective": "sft", "optim.max_steps": 6, "optim.scheduler": "cosine", "optim.warmup_steps": 2}
    full = Trainer(make_cfg(assets, tmp_path / "a", **over)).train()
    Trainer(make_cfg(assets, tmp_path / "b", **over)).train(until_step=3)
    rest = Trainer(make_cfg(assets, tmp_path / "b", **over), resume=True).train()
    assert [r["step"] for r in rest] == [4, 5, 6]
    for a, b in zip(full[3:], rest):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a["step"], a["loss"], b["loss"])
        assert a["tokens"] == b["tokens"] and a["epoch"] == b["epoch"]


def test_run_dir_exists_is_refused_then_overwritten(assets, tmp_path):
    run = tmp_path / "run"
    Trainer(make_cfg(assets, run)).train(until_step=1)
    with pytest.raises(UserError, match="--resume.*--overwrite"):
        Trainer(make_cfg(assets, run))
    tr = Trainer(make_cfg(assets, run), overwrite=True)
    assert tr.step_num == 0 and not list_checkpoints(run)


def test_resume_without_checkpoint_is_refused(assets, tmp_path):
    with pytest.raises(UserError, match="not an opsd run directory"):
        Trainer(make_cfg(assets, tmp_path / "empty"), resume=True)


def test_run_killed_in_its_first_save_resumes_from_scratch(assets, tmp_path, capsys):
    """A kill -9 during the first checkpoint leaves config.yaml, metrics and a .tmp-* directory."""
    run = tmp_path / "run"
    full = Trainer(make_cfg(assets, tmp_path / "full", **{"optim.max_steps": 2})).train()
    tr = Trainer(make_cfg(assets, run, **{"optim.max_steps": 2, "checkpoint.enabled": "false"}))
    tr.train(until_step=1)
    partial = run / "checkpoints" / ".tmp-step_000001-123"
    (partial / "model").mkdir(parents=True)
    resumed = Trainer(make_cfg(assets, run, **{"optim.max_steps": 2}), resume=True)
    assert "starting this run again from step 0" in capsys.readouterr().err
    assert resumed.step_num == 0 and not partial.exists()
    hist = resumed.train()
    assert [h["loss"] for h in hist] == pytest.approx([h["loss"] for h in full], rel=1e-6)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the interrupted run's step-1 line was replaced, not repeated


def test_resume_records_overrides_and_reports_a_finished_run(assets, tmp_path, capsys):
    import yaml

    run = tmp_path / "run"
    Trainer(make_cfg(assets, run, **{"optim.max_steps": 1})).train()
    Trainer(make_cfg(assets, run, **{"optim.max_steps": 2}), resume=True).train()
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["max_steps"] == 2
    history = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["event"] for h in history] == ["start", "resume"]
    assert history[1]["changes"] == {"optim.max_steps": [1, 2]}
    capsys.readouterr()
    assert Trainer(make_cfg(assets, run, **{"optim.max_steps": 2}), resume=True).train() == []
    err = capsys.readouterr().err
    assert "is complete" in err and "optim.max_steps=N" in err


def test_nonfinite_steps_are_skipped_then_stop(assets, tmp_path, monkeypatch):
    real = objectives_mod.fused_linear_distill

    def poisoned(*a, **k):  # NaN loss on steps 2, 3, 4
        loss, st = real(*a, **k)
        return (loss * float("nan") if tr.step_num + 1 in (2, 3, 4) else loss), st

    monkeypatch.setattr(objectives_mod, "fused_linear_distill", poisoned)
    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 8, "optim.max_bad_steps": 3}))
    with pytest.warns(UserWarning, match="non-finite"):
        with pytest.raises(trainer_mod.TrainingError, match="3 consecutive steps"):
            tr.train()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_nonfinite"] for r in recs] == [0, 1, 1, 1]
    # the last good checkpoint is step 1 and it is intact: it loads and resumes
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["step_000001"]
    monkeypatch.setattr(objectives_mod, "fused_linear_distill", real)
    again = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 2}), resume=True)
    assert again.step_num == 1
    assert again.train()[0]["skipped_nonfinite"] == 0


def test_skipped_step_leaves_weights_unchanged(assets, tmp_path, monkeypatch):
    real = objectives_mod.fused_linear_distill
    monkeypatch.setattr(
        objectives_mod,
        "fused_linear_distill",
        lambda *a, **k: (lambda r: (r[0] * float("nan"), r[1]))(real(*a, **k)),
    )
    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 1}))
    w0 = {k: v.detach().clone() for k, v in tr.run.model.named_parameters()}
    with pytest.warns(UserWarning):
        tr.step()
    assert all(torch.equal(v, w0[k]) for k, v in tr.run.model.named_parameters())


def test_sigterm_saves_and_stops(assets, tmp_path, monkeypatch, capsys):
    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 5, "checkpoint.every": 0}))
    handler_before = signal.getsignal(signal.SIGTERM)
    real_step = tr.step

    def step_then_signal():
        rec = real_step()
        if tr.step_num == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return rec

    monkeypatch.setattr(tr, "step", step_then_signal)
    hist = tr.train()
    assert len(hist) == 2
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["step_000002"]
    assert "opsd train --resume" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is handler_before  # handlers restored
    assert tr.stopped


def test_lora_checkpoint_is_hf_loadable_and_merged(assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tr = Trainer(
        make_cfg(assets, tmp_path / "run", **{"checkpoint.save_merged": "true", "optim.max_steps": 1})
    )
    tr.train()
    ck = list_checkpoints(tmp_path / "run")[-1]
    merged = AutoModelForCausalLM.from_pretrained(ck / "merged")
    base = AutoModelForCausalLM.from_pretrained(assets["model"])
    adapted = PeftModel.from_pretrained(base, ck / "model")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-4)
        trained = tr.run.model(ids).logits
    torch.testing.assert_close(merged(ids).logits, trained, rtol=1e-4, atol=1e-4)


def test_interrupted_save_leaves_previous_checkpoint(assets, tmp_path, monkeypatch):
    import opsd.checkpoint as ck_mod

    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 2}))
    tr.train(until_step=1)
    real_save = torch.save

    def dying_save(*a, **k):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ck_mod.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    monkeypatch.setattr(ck_mod.torch, "save", real_save)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_000001"]
    again = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 2}), resume=True)
    assert again.step_num == 1


def test_cli_train_resume_and_errors(assets, tmp_path, capsys, monkeypatch):
    import yaml

    from opsd.cli import main

    for k in ("RANK", "LOCAL_RANK"):  # set by a VLLMEngine an earlier test built in this process
        monkeypatch.delenv(k, raising=False)

    run = tmp_path / "run"
    cfg = make_cfg(assets, run, **{"optim.max_steps": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["train", "--config", str(path), "optim.max_steps=1"]) == 0
    assert [c.name for c in list_checkpoints(run)] == ["step_000001"]
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "Traceback" not in err
    assert main(["train", "--resume", str(run), "optim.max_steps=2"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert main(["train", "--config", str(path), "--overwrite", "loss.beta=7"]) == 2
    assert "loss.beta" in capsys.readouterr().err
