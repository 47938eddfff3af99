"""Precision: what `model.dtype` resolves to on each device, float32 master weights under bf16 compute,
and the loss kept in float32, on every CPU (the CPU probe is faked both ways by OPSD_CPU_BF16).

Emulated bf16 (a CPU without AMX or AVX512-BF16) is ~25x slower than float32: these runs are a few
steps of the 2-layer, 32-wide tiny model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import FULL_FT, ScriptedEngine, build_assets, make_cfg

from opsd import Trainer, precision
from opsd.cli import main
from opsd.cpu import bf16
from opsd.errors import UserError

BF16, FP32 = torch.bfloat16, torch.float32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("precision"))


# --- the resolver -----------------------------------------------------------------------------


def test_auto_follows_the_cpu_probe_both_ways(cpu_bf16):
    p = precision.resolve("auto", CPU, full_finetune=True)
    assert p.compute == (BF16 if cpu_bf16 else FP32)
    assert p.storage == FP32  # full fine-tuning keeps float32 masters either way
    assert "OPSD_CPU_BF16" in p.why and "overrides" in p.why


@pytest.mark.parametrize(
    ("flags", "has"),
    [("fpu avx512f amx_bf16 amx_tile", True), ("fpu avx512f avx512_bf16", True), ("fpu avx2 avx512f", False)],
)
def test_cpu_probe_reads_the_flags(monkeypatch, flags, has):
    monkeypatch.delenv("OPSD_CPU_BF16")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(bf16, "cpu_flags", lambda: flags)
    assert bf16.cpu_has_bf16_units()[0] is has
    assert precision.compute_dtype("auto", CPU)[0] == (BF16 if has else FP32)


@pytest.mark.parametrize(
    ("env", "has"),
    [
        ({"ATEN_CPU_CAPABILITY": "avx2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False),
        ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    ],
)
def test_an_isa_cap_below_bf16_counts_as_no_bf16_units(monkeypatch, env, has):
    """How an AVX2-only machine is reproduced on a newer one: its kernels then emulate bf16 products."""
    monkeypatch.delenv("OPSD_CPU_BF16")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(bf16, "cpu_flags", lambda: "fpu avx512f amx_bf16 amx_tile")
    ok, why = bf16.cpu_has_bf16_units()
    assert ok is has
    assert has or next(iter(env)) in why


@pytest.mark.parametrize(
    ("setting", "full", "pure", "compute", "storage"),
    [
        ("bfloat16", True, False, BF16, FP32),  # full fine-tuning: float32 masters
        ("bfloat16", True, True, BF16, BF16),  # the explicit opt-out
        ("bfloat16", False, False, BF16, BF16),  # LoRA or evaluation: the frozen base as it computes
        ("float32", True, False, FP32, FP32),
        ("float64", True, False, torch.float64, torch.float64),
    ],
)
def test_storage_follows_compute_and_what_is_trained(setting, full, pure, compute, storage):
    p = precision.resolve(setting, CPU, full_finetune=full, pure_bf16=pure)
    assert (p.compute, p.storage, p.mixed) == (compute, storage, compute != storage)


def test_a_bad_override_is_one_line(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPSD_CPU_BF16", "yes")
    with pytest.raises(UserError, match=r"OPSD_CPU_BF16='yes': expected 0 .* or 1"):
        precision.resolve("auto", CPU, full_finetune=False)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {assets['model']}}}\ndata: {{path: {assets['data']}}}\n")
    assert main(["train", "--config", str(cfg), f"logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("opsd train: error: OPSD_CPU_BF16='yes'"), err


def test_startup_line_says_when_the_override_is_in_effect(assets, tmp_path, cpu_bf16, capsys):
    Trainer(
        make_cfg(
            assets,
            tmp_path / "run",
            **{"model.dtype": "auto", "model.lora.enabled": "false", "optim.max_steps": 1},
        )
    )
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("precision:"))
    want = "compute bfloat16 over float32 master weights" if cpu_bf16 else "precision: float32"
    assert want in line and f"OPSD_CPU_BF16={int(cpu_bf16)} overrides the CPU probe" in line, line


# --- mixed precision in training ---------------------------------------------------------------


def _changed_fraction(before: dict, model) -> float:
    changed = total = 0
    for k, v in model.named_parameters():
        changed += int((v.detach().float() != before[k].float()).sum())
        total += v.numel()
    return changed / total


def _train_full(assets, run_dir, dtype: str, **over):
    tr = Trainer(make_cfg(assets, run_dir, **{**FULL_FT, "model.dtype": dtype, **over}))
    before = {k: v.detach().clone() for k, v in tr.run.model.named_parameters()}
    hist = tr.train()
    return tr, before, hist


def test_bf16_full_finetuning_keeps_float32_masters_and_moves_the_weights(assets, tmp_path, monkeypatch):
    """The defect: AdamW on bf16 weights at lr 5e-6 rounds most updates away (an update of ~lr against
    a bf16 ulp of ~1e-4 at the tiny model's weight size). With float32 masters, bf16 compute moves as
    many weights as float32 does: all but the embedding rows of tokens no batch contained."""
    monkeypatch.setattr("opsd.setup.make_engine", ScriptedEngine)
    tr16, before, h16 = _train_full(assets, tmp_path / "bf16", "bfloat16")
    assert tr16.run.precision.mixed and all(p.dtype == FP32 for p in tr16.run.model.parameters())
    assert all(s["exp_avg"].dtype == FP32 for s in tr16.run.optimizer.state.values())
    # the frozen copy is never updated: its matrices in the compute dtype are enough
    assert tr16.run.teacher.model.model.layers[0].mlp.up_proj.weight.dtype == BF16
    moved16 = _changed_fraction(before, tr16.run.model)
    tr32, before32, h32 = _train_full(assets, tmp_path / "fp32", "float32")
    moved32 = _changed_fraction(before32, tr32.run.model)
    trp, beforep, _ = _train_full(assets, tmp_path / "pure", "bfloat16", **{"model.pure_bf16": "true"})
    assert all(p.dtype == BF16 for p in trp.run.model.parameters())
    moved_pure = _changed_fraction(beforep, trp.run.model)
    assert moved16 >= 0.8 and moved32 >= 0.8, (moved16, moved32)
    assert moved_pure < 0.5, moved_pure  # what the masters fix (the issue measured 6%)

    # bf16 compute against float32 on the same responses. Every logit carries bf16 rounding: each of
    # the ~2 layers x (attention, MLP) x 2 products rounds its output to 2^-9 relative, so a logit is
    # off by about eps_z = 8 u_bf16 |z|max. The loss is a divergence L ~ sum P (dz)^2 / 2 between
    # teacher and student logits that differ by dz ~ sqrt(2 L), so it moves by at most
    # 2 sqrt(2 L) eps_z + eps_z^2 (both models' errors, not cancelling).
    z_max = _max_logit(tr32)
    eps_z = 8 * 2.0**-9 * z_max
    for a, b in zip(h16, h32):
        bound = 2 * math.sqrt(2 * abs(b["loss"])) * eps_z + eps_z**2
        assert abs(a["loss"] - b["loss"]) <= bound, (a["step"], a["loss"], b["loss"], bound)


def _max_logit(tr) -> float:
    ids = torch.arange(40, 72).view(1, -1)
    with torch.no_grad():
        return float(tr.run.model(input_ids=ids).logits.abs().max())


def test_bf16_resume_is_exact(assets, tmp_path):
    """Same operations on the same values: a resumed bf16 run equals the uninterrupted one bit for bit
    (float32 masters and AdamW state are in the checkpoint; the frozen bf16 copy is rebuilt)."""
    over = {
        **FULL_FT,
        "model.dtype": "bfloat16",
        "optim.max_steps": 4,
        "optim.lr": 1e-3,
        "checkpoint.every": 2,
        "rollout.max_new_tokens": 4,
    }
    full = Trainer(make_cfg(assets, tmp_path / "a", **over)).train()
    Trainer(make_cfg(assets, tmp_path / "b", **over)).train(until_step=2)
    resumed = Trainer(make_cfg(assets, tmp_path / "b", **over), resume=True)
    assert all(p.dtype == FP32 for p in resumed.run.model.parameters())
    rest = resumed.train()
    assert [(r["loss"], r["grad_norm"]) for r in rest] == [(r["loss"], r["grad_norm"]) for r in full[2:]]


def test_lora_adapters_and_ema_stay_float32_over_a_bf16_base(assets, tmp_path):
    over = {
        "model.dtype": "bfloat16",
        "teacher.mode": "ema",
        "teacher.ema_decay": 0.9,
        "optim.max_steps": 2,
        "rollout.max_new_tokens": 4,
    }
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    tr.train()
    lora = {k: v.dtype for k, v in tr.run.model.named_parameters() if "lora_" in k}
    frozen = {v.dtype for k, v in tr.run.model.named_parameters() if "lora_" not in k}
    assert lora and set(lora.values()) == {FP32} and frozen == {BF16}
    assert {e.dtype for e in tr.run.teacher.ema} == {FP32}
    resumed = Trainer(make_cfg(assets, tmp_path / "run", **{**over, "optim.max_steps": 3}), resume=True)
    assert {v.dtype for k, v in resumed.run.model.named_parameters() if "lora_" in k} == {FP32}
    assert {e.dtype for e in resumed.run.teacher.ema} == {FP32}


def test_bf16_on_a_cpu_pads_to_bucket_widths(assets, tmp_path, monkeypatch):
    """In bf16 on a CPU the trainer's micro-batches (student and teacher) are padded to bucket widths and
    the HF engine buckets its prompts: the CPU's bf16 attention keeps a kernel per sequence length."""
    from opsd.cpu.buckets import bucket_width

    over = {"model.dtype": "bfloat16", "optim.max_steps": 1, "rollout.max_new_tokens": 4}
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    assert tr.run.engine.cpu_settings.bucket_widths
    seen = []
    real = tr.microbatches

    def spy(samples):
        mbs = real(samples)
        seen.extend(mbs)
        return mbs

    monkeypatch.setattr(tr, "microbatches", spy)
    tr.train()
    pairs = [(m.student_ids, m.student_mask) for m in seen] + [(m.teacher_ids, m.teacher_mask) for m in seen]
    widths = [(ids.shape[1], int(mask.sum(1).max())) for ids, mask in pairs]
    assert widths and all(w == bucket_width(longest) for w, longest in widths)
    assert any(w > longest for w, longest in widths)  # the padding is exercised


def test_the_loss_runs_without_autocast(assets, tmp_path, monkeypatch):
    """Under one process's bf16 autocast the model forwards compute in bf16 but the loss kernel's
    products stay float32: a bf16 product there would round each logit to 2^-9 relative."""
    from opsd import objectives as objectives_mod

    seen = []
    real = objectives_mod.fused_linear_distill

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    calls = []

    def inner_spy(a, b, *rest, **kw):
        calls.append((a.dtype, torch.is_autocast_enabled("cpu")))
        return real.__wrapped__(a, b, *rest, **kw)

    monkeypatch.setattr(objectives_mod, "fused_linear_distill", spy)
    monkeypatch.setattr(real, "__wrapped__", inner_spy, raising=False)
    tr = Trainer(
        make_cfg(
            assets,
            tmp_path / "run",
            **{**FULL_FT, "model.dtype": "bfloat16", "optim.max_steps": 1, "rollout.max_new_tokens": 4},
        )
    )
    with tr.run.autocast():
        assert torch.is_autocast_enabled("cpu")  # the forwards' context
    tr.train()
    assert seen and not any(seen)  # the trainer calls the loss outside the forwards' autocast
    with torch.autocast("cpu", dtype=BF16):  # and the kernel switches it off itself
        h = torch.randn(3, 8)
        w = torch.randn(16, 8)
        loss, _ = real(h, w, h + 0.01, w)
    assert loss.dtype == FP32


def test_vllm_dtype_follows_the_compute_dtype(fake_vllm, tiny_model, tiny_tokenizer):
    from opsd.config import RolloutConfig
    from opsd.rollout.base import EngineRun
    from opsd.rollout.make import make_engine

    make_engine(RolloutConfig(engine="vllm"), tiny_model, tiny_tokenizer, EngineRun(compute_dtype=BF16))
    assert fake_vllm.llms[-1].kwargs["dtype"] == "bfloat16"  # not the float32 of master weights
    make_engine(
        RolloutConfig(engine="vllm", vllm_dtype="float32"),
        tiny_model,
        tiny_tokenizer,
        EngineRun(compute_dtype=BF16),
    )
    assert fake_vllm.llms[-1].kwargs["dtype"] == "float32"


# --- checkpoints from before the change --------------------------------------------------------


def test_checkpoint_formats(assets, tmp_path, capsys):
    over = {"optim.max_steps": 2, "checkpoint.every": 1}
    Trainer(make_cfg(assets, tmp_path / "run", **over)).train(until_step=1)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["format"] == 3 and state["progress"] == {"step": 1, "bad_steps": 0}
    # What opsd wrote before: format 2 kept the counters at the top, and before it no format key.
    state = {k: v for k, v in state.items() if k != "progress"} | state["progress"]
    for old in (2, None):
        state["format"] = old
        torch.save({k: v for k, v in state.items() if v is not None}, ckpt / "state.pt")
        assert Trainer(make_cfg(assets, tmp_path / "run", **over), resume=True).step_num == 1
    state["format"] = 99  # a newer opsd's: one line
    torch.save(state, ckpt / "state.pt")
    cfg = tmp_path / "run" / "config.yaml"
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2, cfg
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "checkpoint format 99 was written by a newer opsd" in err, err
    json.loads((tmp_path / "run" / "data_report.json").read_text())  # the run directory is untouched


def test_loss_products_are_bf16_only_on_bf16_units(cpu_bf16):
    bf16 = precision.resolve("bfloat16", CPU, full_finetune=False)
    assert precision.loss_matmul_dtype(bf16, CPU) == (BF16 if cpu_bf16 else None)
    assert precision.loss_matmul_dtype(precision.resolve("float32", CPU, full_finetune=False), CPU) is None


def test_the_trainer_uses_bf16_loss_products_on_bf16_units(assets, tmp_path, monkeypatch):
    """With bf16 units the trainer's loss multiplies in bf16 (two products per logit block,
    opsd/loss/fused.py's logits_bf16): on the same micro-batches it gives another float than float32
    products do, so the path is taken. How close it is to float64 is the kernel's own test
    (tests/loss/test_loss_precision.py, per mode, with its error model); how close two oneDNN builds'
    bf16 products are to each other depends on the instruction set (measured here: 8e-8 with AVX512
    kernels, 1.7e-7 with AVX2 ones, on a loss of 1e-4), so no bound between the two paths is asserted here."""
    monkeypatch.setenv("OPSD_CPU_BF16", "1")
    tr = Trainer(
        make_cfg(
            assets,
            tmp_path / "run",
            **{"model.dtype": "bfloat16", "optim.max_steps": 1, "rollout.max_new_tokens": 4},
        )
    )
    assert tr.run.forward_backward.loss.matmul_dtype == BF16
    seen = {}
    real = tr.run.forward_backward

    def spy(batches, adv=None, **kw):
        seen["bf16"] = float(real(batches, adv, backward=False)[0])
        real.loss.matmul_dtype = None
        seen["fp32"] = float(real(batches, adv, backward=False)[0])
        real.loss.matmul_dtype = BF16
        return real(batches, adv, **kw)

    tr.run.forward_backward = spy
    tr.train()
    assert seen["bf16"] != seen["fp32"] and math.isfinite(seen["bf16"]), seen


# --- one resolver for train, eval and sft ------------------------------------------------------


def test_eval_resolves_auto_like_train(assets, cpu_bf16):
    from opsd.config import EvalCommand, load_config
    from opsd.eval.cli import evaluate

    keys = [f"model.path={assets['model']}", f"eval.path={assets['data']}", "eval.limit=1", "device=cpu"]
    (res,) = evaluate(load_config(None, [*keys, "eval.max_new_tokens=2"], schema=EvalCommand)).values()
    assert res.settings["dtype"] == ("bfloat16" if cpu_bf16 else "float32")


def test_bf16_sft_keeps_float32_masters(assets, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    args = [
        "sft",
        "--model",
        assets["model"],
        "--data",
        assets["data"],
        "--out",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--dtype",
        "bfloat16",
        "--lr",
        "1e-3",
    ]
    assert main(args) == 0
    assert "compute bfloat16 over float32 master weights" in capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(out).dtype == FP32  # the masters are what is saved


def test_lora_adapters_compute_in_bf16_over_a_bf16_base(assets, tmp_path):
    """The adapters' products run in the compute dtype under the trainer's forward context (no float32
    copy of each layer's input), while the adapters and their gradients stay float32.

    Error model for the hidden states against peft's float32 adapter path: both paths round each
    layer's output to bf16 (2^-9 relative); they differ in where the small adapter term is rounded
    (bf16 products against float32 ones), at most a few 2^-9 of a layer's output per layer. Over the
    tiny model's 2 layers, with room for attention and the norm to amplify it, 2^-5 of max|h|."""
    from peft.tuners.lora.layer import LoraLayer

    from opsd.models import final_hidden

    tr = Trainer(make_cfg(assets, tmp_path / "run", **{"model.dtype": "bfloat16", "optim.max_steps": 1}))
    with torch.no_grad():  # a non-zero adapter, so its term shows in the output
        for name, p in tr.run.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    layer = next(m for m in tr.run.model.modules() if isinstance(m, LoraLayer))
    seen = []
    hook = layer.lora_A["default"].register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    ids = torch.randint(3, 50, (2, 9))
    mask = torch.ones_like(ids)
    pos = torch.arange(18)
    with tr.run.autocast():
        h = final_hidden(tr.run.model, ids, mask, pos)
    h.float().square().mean().backward()
    hook.remove()
    assert seen == [(BF16, BF16)]
    grads = [p.grad for name, p in tr.run.model.named_parameters() if "lora_" in name]
    assert grads and all(g is not None and g.dtype == FP32 and g.isfinite().all() for g in grads)
    assert {p.dtype for name, p in tr.run.model.named_parameters() if "lora_" in name} == {FP32}
    with torch.no_grad():
        ref = final_hidden(tr.run.model, ids, mask, pos)  # peft's own float32 adapter path
    assert (h.float() - ref.float()).abs().max() <= 2**-5 * ref.float().abs().max()


@pytest.mark.parametrize(
    "lora, dtype, setting, want",
    [
        (True, "bfloat16", "auto", torch.bfloat16),  # LoRA's float32 adapters compute in bf16 under FSDP
        (False, "bfloat16", "auto", torch.bfloat16),  # float32 masters, bf16 compute
        (True, "float32", "auto", None),
        (False, "float32", "auto", None),
        (True, "bfloat16", "float32", torch.float32),  # a set parallel.param_dtype wins
    ],
)
def test_fsdp_param_dtype_computes_lora_adapters_in_the_compute_dtype(
    assets, tmp_path, lora, dtype, setting, want
):
    """Under torchrun one process's autocast does not run, so FSDP2's mixed-precision policy casts: with
    LoRA on a bf16 base its float32 adapters must be cast too, or peft casts every projection's input up
    to float32 (float32 GEMMs, and more saved activations than the micro-batch budget assumes)."""
    from opsd import setup

    over = {"model.lora.enabled": lora, "model.dtype": dtype, "parallel.param_dtype": setting}
    cfg = make_cfg(assets, tmp_path / "run", **over)
    prec = precision.resolve(dtype, torch.device("cpu"), full_finetune=not lora)
    assert setup.fsdp_param_dtype(cfg, prec) == want


def test_loss_products_float32_keeps_the_loss_products_in_float32(assets, tmp_path, monkeypatch):
    """``loss.products: auto`` takes bf16 products on bf16 units for a bf16 model; ``float32`` keeps
    them float32 whatever the hardware."""
    monkeypatch.setenv("OPSD_CPU_BF16", "1")
    over = {"model.dtype": "bfloat16", "checkpoint.enabled": "false"}
    auto = Trainer(make_cfg(assets, tmp_path / "auto", **over))
    assert auto.run.forward_backward.loss.matmul_dtype == torch.bfloat16
    plain = Trainer(make_cfg(assets, tmp_path / "f32", **over, **{"loss.products": "float32"}))
    assert plain.run.forward_backward.loss.matmul_dtype is None
