"""End-to-end trainer runs on a tiny random model, the step's parts: evaluation during training, the
rollout log-prob check, the engine's resolution and shutdown, the micro-batch loop, the CPU path, memory."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import build_assets, make_cfg

import opsd.objectives as objectives_mod
import opsd.trainer as trainer_mod
from opsd import Trainer, load_config, models
from opsd.checkpoint import list_checkpoints
from opsd.errors import UserError


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("assets"))


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
    generate = tr.run.engine.generate
    tr.run.engine.generate = lambda *a: [
        replace(c, logprobs=[x - 0.5 for x in c.logprobs]) for c in generate(*a)
    ]
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
    assert tr.run.engine_kind == "hf" and isinstance(tr.run.engine, HFEngine)
    assert not tr.run.check_lp  # auto's log-prob check is on beside vLLM only
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
    real = tr.run.forward_backward

    def spy(batches, adv=None, **kw):
        seen["eval"] = real(batches, adv, backward=False)
        seen["grads"] = [p.grad for p in tr.run.params]
        seen["train"] = real(batches, adv, **kw)
        return seen["train"]

    tr.run.forward_backward = spy
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
    assert tr.run.plan.pack_from == pack_from(non_embedding_params(tr.run.model)) > 1000
    assert models.base_model(tr.run.model).config._attn_implementation == PACKED_SDPA  # rows packed
    lengths = (3, 11, 6)
    samples = [make_sample([5 + n] * n, [9] * (n + 4), [7, 8, 7], i, "stop") for i, n in enumerate(lengths)]
    (batched,) = tr.microbatches(samples)
    assert batched.student_rows is None and batched.teacher_rows is None  # the tiny model's short rows
    tr.run.plan = replace(tr.run.plan, pack_from=6)
    (mb,) = tr.microbatches(samples)
    assert mb.student_rows == [6, 14, 9] and mb.teacher_rows == [10, 18, 13]
    assert mb.student_padded_tokens == mb.student_real_tokens < mb.student_ids.numel()
    assert mb.teacher_padded_tokens == mb.teacher_real_tokens < mb.teacher_ids.numel()
    rows, _ = tr.run.forward_backward([mb], backward=False)
    batched_loss, _ = tr.run.forward_backward([batched], backward=False)
    assert float(rows) == pytest.approx(float(batched_loss), abs=1e-6)
    tr.run.plan = replace(tr.run.plan, pack_from=7)  # the shortest student row (6 tokens) is too short
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
        model = weakref.ref(tr.run.model)
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
