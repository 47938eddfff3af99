"""End-to-end trainer runs on a tiny random model: modes, resume, faults, checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
from dataclasses import replace

import pytest
import torch
from helpers import build_assets, make_cfg

import opsd.objectives as objectives_mod
import opsd.trainer as trainer_mod
from opsd import Trainer, load_config, models
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
    student0 = {k: v.detach().clone() for k, v in tr.model.named_parameters() if v.requires_grad}
    frozen0 = _frozen(tr.teacher.model) if tr.teacher.model is not None else None
    base0 = {k: v.detach().clone() for k, v in tr.model.named_parameters() if not v.requires_grad}
    ema0 = [e.clone() for e in tr.teacher.ema]
    hist = tr.train()
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    if over.get("loss.mode") != "sampled":  # the sampled estimate of the divergence can be negative
        assert all(h["divergence"] > 0 for h in hist)
    changed = [
        k for k, v in tr.model.named_parameters() if v.requires_grad and not torch.equal(v, student0[k])
    ]
    assert changed, "the student's weights did not change"
    if over.get("teacher.mode", "fixed") == "fixed":
        if frozen0 is not None:  # full fine-tuning: the frozen copy is untouched
            for k, v in tr.teacher.model.named_parameters():
                assert torch.equal(v, frozen0[k]), k
        else:  # LoRA: the teacher is the base weights, which never train
            for k, v in tr.model.named_parameters():
                if not v.requires_grad:
                    assert torch.equal(v, base0[k]), k
    if over.get("teacher.mode") == "ema":
        assert any(not torch.equal(a, b) for a, b in zip(ema0, tr.teacher.ema))
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
    t0 = _frozen(tr.teacher.model)
    hist = tr.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert all(torch.equal(v, t0[k]) for k, v in tr.teacher.model.named_parameters())


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
    w0 = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
    with pytest.warns(UserWarning):
        tr.step()
    assert all(torch.equal(v, w0[k]) for k, v in tr.model.named_parameters())


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
        trained = tr.model(ids).logits
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


def test_eval_during_training_goes_to_metrics(assets, tmp_path):
    tr = Trainer(
        make_cfg(
            assets,
            tmp_path / "run",
            **{"eval.path": assets["data"], "eval.every": 1, "eval.limit": 3, "eval.max_new_tokens": 4},
        )
    )
    hist = tr.train()
    assert all("eval/avg@1" in h and 0.0 <= h["eval/avg@1"] <= 1.0 for h in hist)
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval/pass@1" in rec


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_steps_on_real_smollm2(smollm2_path, tmp_path):
    rows = [
        {"problem": "What is 12 + 30?", "solution": "12 + 30 = 42, so the answer is 42.", "answer": "42"},
        {"problem": "What is 7 * 6?", "solution": "7 * 6 = 42.", "answer": "42"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            f"model.path={smollm2_path}",
            f"data.path={data}",
            f"logging.run_dir={tmp_path / 'run'}",
            "model.lora.r=8",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=16",
            "optim.max_steps=2",
            "checkpoint.every=0",
            "logging.progress=false",
            "device=cpu",
        ],
    )
    tr = Trainer(cfg)
    hist = tr.train()
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert hist[0]["divergence"] > 0 and 0 < hist[0]["agreement"] <= 1
    assert list_checkpoints(tmp_path / "run")[-1].name == "step_000002"


def test_logprob_check_measures_the_rollout_trainer_gap(assets, tmp_path):
    """rollout.logprob_check: the HF engine samples from the trainer's own weights, so the gap is rounding;
    an engine whose log-probs are off by 0.5 shows 0.5. Off (auto with HF), the metric is absent."""
    tr = Trainer(make_cfg(assets, tmp_path / "on", **{"rollout.logprob_check": "true", "optim.max_steps": 1}))
    (rec,) = tr.train()
    # Error model: both sides are float32 log-softmaxes of the same float32 model, computed in two
    # orders (cached decoding against one full forward). A log-prob is about ln V = 6.2 here, and
    # each side carries a few roundings of that size in its logits and log-sum-exp; 8 per side, 16 in
    # all, gives 16 u32 ln V = 6e-6 (measured: 1e-7 to 3e-7). In bf16 this is 2^8 times larger.
    assert 0.0 <= rec["logprob_gap"] < 16 * (torch.finfo(torch.float32).eps / 2) * math.log(512)
    tr = Trainer(
        make_cfg(assets, tmp_path / "shifted", **{"rollout.logprob_check": "true", "optim.max_steps": 1})
    )
    generate = tr.engine.generate
    tr.engine.generate = lambda *a: [replace(c, logprobs=[x - 0.5 for x in c.logprobs]) for c in generate(*a)]
    (rec,) = tr.train()
    assert rec["logprob_gap"] == pytest.approx(0.5, abs=1e-4)
    (rec,) = Trainer(make_cfg(assets, tmp_path / "off", **{"optim.max_steps": 1})).train()
    assert "logprob_gap" not in rec


def test_logprob_check_refuses_top_k_and_vllm_server_needs_urls(assets, tmp_path):
    with pytest.raises(UserError, match="logprob_check=true needs"):
        make_cfg(assets, tmp_path / "r", **{"rollout.logprob_check": "true", "rollout.top_k": 5})
    with pytest.raises(UserError, match="vllm_server needs rollout.servers"):
        make_cfg(assets, tmp_path / "r", **{"rollout.engine": "vllm_server"})
    with pytest.raises(UserError, match="is not a URL"):
        make_cfg(
            assets, tmp_path / "r", **{"rollout.engine": "vllm_server", "rollout.servers": "[localhost:8000]"}
        )


def test_rollout_engine_auto_is_resolved_once_and_named_on_the_startup_line(
    assets, tmp_path, monkeypatch, capsys
):
    """The trainer resolves rollout.engine=auto once and hands the kind to every part that depends
    on it: the engine built, the CPU plan, the log-prob check, the startup line."""
    import importlib.util

    import opsd.setup as setup_mod
    from opsd.config import resolve_engine
    from opsd.rollout import HFEngine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    resolved = []
    monkeypatch.setattr(setup_mod, "resolve_engine", lambda s: resolved.append(s) or resolve_engine(s))
    tr = Trainer(make_cfg(assets, tmp_path / "r", **{"rollout.engine": "auto", "optim.max_steps": 1}))
    assert resolved == ["auto"]
    assert tr.engine_kind == "hf" and isinstance(tr.engine, HFEngine)
    assert not tr.check_lp  # auto's log-prob check is on beside vLLM only
    assert "rollout engine: hf (rollout.engine=auto: vLLM is not installed" in capsys.readouterr().err
    tr.close()


def test_cli_closes_the_engine_before_the_process_group(assets, tmp_path, monkeypatch):
    """vLLM's teardown uses the process group: `opsd train` closes the trainer (its engine) first,
    then destroys the group, also when training fails."""
    import opsd.distributed as D
    from opsd.cli import main

    calls = []

    class Recorder:
        def __init__(self, cfg, **kw):
            self.run_dir = tmp_path / "run"

        def train(self):
            calls.append("train")
            if fail:
                raise RuntimeError("boom")

        def close(self):
            calls.append("close")

    monkeypatch.setattr(trainer_mod, "Trainer", Recorder)
    monkeypatch.setattr(D, "init_distributed", lambda *a, **k: D.Dist(mesh=object()))
    monkeypatch.setattr(D, "shutdown", lambda: calls.append("shutdown"))
    args = [
        "train",
        f"model.path={assets['model']}",
        f"data.path={assets['data']}",
        f"logging.run_dir={tmp_path / 'run'}",
    ]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    fail = False
    assert main([*args[:1], "--config", str(cfg), *args[1:]]) == 0
    assert calls == ["train", "close", "shutdown"]
    calls.clear()
    fail = True
    with pytest.raises(RuntimeError, match="boom"):
        main([*args[:1], "--config", str(cfg), *args[1:]])
    assert calls == ["train", "close", "shutdown"]


def test_forward_backward_is_the_step_loop_and_can_run_without_gradients(assets, tmp_path):
    """The step's micro-batch loop is Trainer.forward_backward; with backward=False it computes the same
    loss and statistics (the same operations on the same weights: equal to the bit) and leaves no gradient."""
    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.max_steps": 1}))
    seen = {}
    real = tr.forward_backward

    def spy(batches, adv=None, **kw):
        seen["eval"] = real(batches, adv, backward=False)
        seen["grads"] = [p.grad for p in tr.params]
        seen["train"] = real(batches, adv, **kw)
        return seen["train"]

    tr.forward_backward = spy
    tr.train()
    assert all(g is None for g in seen["grads"])
    (loss_eval, st_eval), (loss_train, st_train) = seen["eval"], seen["train"]
    assert float(loss_eval) == float(loss_train) and st_eval.means() == st_train.means()


def test_cpu_trainer_packs_rows_into_one_forward(assets, tmp_path):
    """In one process on a CPU the trainer's micro-batches of unequal rows run packed into one forward
    once the rows are long enough for the model (:func:`opsd.cpu.packing.pack_from`; the tiny model's
    rows are not, so it is lowered here), computing no padding in float32, with the batched forward's
    loss: hidden states that differ by the products' summation order (a few u32 = 6e-8 relative) move
    each token's divergence, a difference of ~6-nat log-probabilities, by ~u32 * 6 * a few nats; the
    mean over tokens by no more."""
    from dataclasses import replace

    from opsd.cpu.packing import PACKED_SDPA, pack_from
    from opsd.data.batching import make_sample
    from opsd.models import non_embedding_params

    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"optim.min_real_token_frac": 0}))
    assert tr.plan.pack_from == pack_from(non_embedding_params(tr.model)) > 1000
    assert models.base_model(tr.model).config._attn_implementation == PACKED_SDPA  # rows packed
    lengths = (3, 11, 6)
    samples = [make_sample([5 + n] * n, [9] * (n + 4), [7, 8, 7], i, "stop") for i, n in enumerate(lengths)]
    (batched,) = tr.microbatches(samples)
    assert batched.student_rows is None and batched.teacher_rows is None  # the tiny model's short rows
    tr.plan = replace(tr.plan, pack_from=6)
    (mb,) = tr.microbatches(samples)
    assert mb.student_rows == [6, 14, 9] and mb.teacher_rows == [10, 18, 13]
    assert mb.student_padded_tokens == mb.student_real_tokens < mb.student_ids.numel()
    assert mb.teacher_padded_tokens == mb.teacher_real_tokens < mb.teacher_ids.numel()
    rows, _ = tr.forward_backward([mb], backward=False)
    batched_loss, _ = tr.forward_backward([batched], backward=False)
    assert float(rows) == pytest.approx(float(batched_loss), abs=1e-6)
    tr.plan = replace(tr.plan, pack_from=7)  # the shortest student row (6 tokens) is too short
    (mb,) = tr.microbatches(samples)
    assert mb.student_rows is None and mb.teacher_rows == [10, 18, 13]


def test_logprob_check_reuses_the_loss_logits_when_the_temperatures_agree(assets, tmp_path, monkeypatch):
    """With loss and sampling at one temperature the trainer's log S(y) comes from the fused loss's own
    student logits (no second head product); at another loss temperature it takes its own product."""

    def refuse(*a, **k):
        raise AssertionError("a second head product for the log-prob check")

    monkeypatch.setattr(objectives_mod, "token_logprobs", refuse)
    (rec,) = Trainer(
        make_cfg(assets, tmp_path / "same", **{"rollout.logprob_check": "true", "optim.max_steps": 1})
    ).train()
    assert 0.0 <= rec["logprob_gap"] < 16 * (torch.finfo(torch.float32).eps / 2) * math.log(512)  # as above
    with pytest.raises(AssertionError, match="second head product"):
        Trainer(
            make_cfg(
                assets,
                tmp_path / "other",
                **{"rollout.logprob_check": "true", "loss.temperature": 0.7, "optim.max_steps": 1},
            )
        ).train()


@pytest.mark.parametrize("tuning", ["auto", "off"])
def test_cpu_step_returns_the_heap_after_generation_and_after_the_step(assets, tmp_path, monkeypatch, tuning):
    """On a glibc CPU the trainer trims the C heap once generation is over (before the micro-batch loop
    reuses it) and once after the step, and with ``cpu.tune_malloc`` runs the micro-batch loop, and only
    it, with freed blocks reused: the order of calls, not a memory figure, is what this can check.
    ``cpu.tuning: off`` does none of it."""
    from opsd import setup
    from opsd.cpu import heap

    calls = []

    @contextlib.contextmanager
    def reuse(keep_pages):
        calls.append(f"reuse{' keeping pages' if keep_pages else ''}")
        yield True
        calls.append("reuse ends")

    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append("trim"))
    monkeypatch.setattr(heap, "reuse_freed_blocks", reuse)
    monkeypatch.setattr(heap, "glibc", lambda: object())  # as on glibc, whatever this machine is
    real_loop = setup.forward_backward

    def spy(*a, **kw):
        calls.append("micro-batches")
        return real_loop(*a, **kw)

    monkeypatch.setattr(setup, "forward_backward", spy)
    over = {"optim.max_steps": 2, "cpu.tune_malloc": True, "cpu.tuning": tuning}
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    tr.train()
    if tuning == "auto":
        assert calls == ["trim", "reuse", "micro-batches", "reuse ends", "trim"] * 2
    else:
        assert calls == ["micro-batches"] * 2


@pytest.mark.parametrize("lora", [True, False])
def test_a_trainer_frees_its_model_without_the_cycle_collector(assets, tmp_path, lora):
    """A trainer that trained, saved a checkpoint and resumed leaves no reference cycle holding its
    model: dropping it frees the weights at once (on a GPU, before the next trainer of a resume or of
    ``opsd compare``'s next arm allocates), with Python's cycle collector off."""
    import gc
    import weakref

    over = {"model.lora.enabled": lora, "optim.max_steps": 1}
    Trainer(make_cfg(assets, tmp_path / "run", **over)).train()
    gc.collect()
    gc.disable()
    try:
        tr = Trainer(make_cfg(assets, tmp_path / "run", **{**over, "optim.max_steps": 2}), resume=True)
        tr.train()
        model = weakref.ref(tr.model)
        del tr
        assert model() is None
    finally:
        gc.enable()


def test_the_trainer_imports_at_most_ten_opsd_modules():
    """The Trainer runs the parts opsd.setup builds: it names at most ten opsd modules, every
    ``from opsd...``/``import opsd...`` line counted (``from opsd import a, b`` names two)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(trainer_mod.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "opsd":
            subs = [f"opsd.{a.name}" for a in node.names] if node.module == "opsd" else [node.module]
            names.update(subs)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "opsd")
    assert len(names) <= 10, sorted(names)
