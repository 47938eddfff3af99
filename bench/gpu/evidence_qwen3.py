"""Check 4 of the GPU evidence run (bench/gpu/evidence.py): Qwen3-1.7B's shape, random weights, full
fine-tuning and LoRA by phase, and the plain PyTorch baseline; each setup a process of its own
(``evidence.py qwen3-setup`` and ``evidence.py qwen3-baseline``)."""

from __future__ import annotations

import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from evidence_shared import SETUPS, SKIP, Report, device_for, left_after, stream
from flops import H200_BF16_DENSE, batch_lengths, matmul_peak, model_shape, step_flops

EVIDENCE = Path(__file__).resolve().parent / "evidence.py"  # what runs each setup's process
# Check 4: the baseline's first loss against opsd's on the same batch and weights (bf16 teachers that
# differ in their norms' precision; bf16 logits in the baseline).
BASELINE_LOSS_RTOL = 0.05

# Qwen3-1.7B (Qwen/Qwen3-1.7B config.json), random weights; --tiny: the same architecture, CPU-sized.
QWEN3_1P7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN3_TINY = {
    **QWEN3_1P7B,
    **dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2),
    **dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
}
# Words per synthetic prompt and reference solution, new tokens per response (check 4).
LENGTHS = {"prompt": 128, "solution": 384, "response": 256}
TINY_LENGTHS = {"prompt": 16, "solution": 32, "response": 12}


def _word_tokenizer(vocab_size: int):
    """Word-level: ``w0 .. wN`` and ChatML's special tokens, exactly ``vocab_size`` ids, so every id the
    model samples decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from opsd.fetch import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE

    specials = ["<unk>", *CHATML_SPECIAL_TOKENS]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*words, *specials])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(CHATML_SPECIAL_TOKENS),
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _qwen3_assets(root: Path, shape: dict, lengths: dict, device: str, rep: Report) -> tuple[dict, int]:
    """A Qwen3-shaped model initialized at random directly on ``device`` in bf16 and saved as bf16
    safetensors (the Trainer takes a path; 3.4 GB at Qwen3-1.7B), its tokenizer, 32 synthetic rows.
    Returns the paths and the parameter count (the tied head counted once)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = _word_tokenizer(shape["vocab_size"])
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen3Config(**shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
            dtype=torch.bfloat16,
        )
    params = sum(p.numel() for p in model.parameters())
    built = time.perf_counter() - t0
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in (root / "model").iterdir()) / 2**30
    rep.add("model", params=params, build_s=built, save_s=time.perf_counter() - t0 - built, disk_gib=size)
    g = torch.Generator().manual_seed(1)
    words = shape["vocab_size"] - 16

    def text(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, words, (n,), generator=g))

    rows = [
        {"problem": text(lengths["prompt"]), "solution": text(lengths["solution"]), "answer": "w1"}
        for _ in range(32)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "data": str(root / "train.jsonl")}, params


def _gib(device: str, what: str = "allocated") -> float | None:
    """Peak allocated (or reserved) GiB since the last reset, on CUDA; None elsewhere."""
    if device != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated() if what == "allocated" else torch.cuda.max_memory_reserved()
    return peak / 2**30


# Each part of check 4 runs in a process of its own under its own timeout (GPU budgets, in seconds; with
# --tiny only the check's own timeout bounds them): full fine-tuning, then LoRA, then the baseline.
QWEN3_PARTS = (("full", 100), ("lora", 80), ("baseline", 45))


def check_qwen3(tiny: bool, out: Path | None) -> int:
    """Qwen3-1.7B's shape: the model built and saved once, the matmul peak measured, then full
    fine-tuning, LoRA and the plain PyTorch baseline, each a guarded process of its own
    (:func:`qwen3_setup`, :func:`qwen3_baseline`). Its figures: each setup's step time, tokens/s, MFU
    (passes and step, datasheet and measured peaks), training peak memory, and opsd's time and peak
    against the baseline's on the same batches."""
    rep = Report("qwen3", out)
    device = device_for(tiny)
    if device is None:
        print("no CUDA device: check 4 needs one (--tiny runs it on the CPU at a tiny shape)")
        return SKIP
    shape, lengths = (QWEN3_TINY, TINY_LENGTHS) if tiny else (QWEN3_1P7B, LENGTHS)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _, n_params = _qwen3_assets(root, shape, lengths, device, rep)
        # the peak this machine reaches: bf16 on a GPU; on a CPU (--tiny) the faster of float32 and bf16
        dtypes = (torch.float32, torch.bfloat16) if tiny else (torch.bfloat16,)
        peak = max(matmul_peak(device, dt, *((512, 3) if tiny else (8192, 10))) for dt in dtypes)
        if device == "cuda":
            torch.cuda.empty_cache()  # the setups' processes get the GPU: this one keeps no products cached
        rep.add("matmul peak", flops_per_s=peak, datasheet=H200_BF16_DENSE)
        rep.figure(params=n_params, matmul_tflops=round(peak / 1e12, 3 if tiny else 1))
        results = {}
        for part, budget in QWEN3_PARTS:
            cmd = [sys.executable, str(EVIDENCE), f"qwen3-{'baseline' if part == 'baseline' else 'setup'}"]
            cmd += [*(["--setup", part] if part != "baseline" else []), "--assets", str(root)]
            cmd += [
                "--peak",
                repr(peak),
                *(["--tiny"] if tiny else []),
                *(["--out", str(out)] if out else []),
            ]
            code, _ = stream(cmd, None if tiny else budget)
            got = root / f"{part}.json"
            results[part] = json.loads(got.read_text()) if got.is_file() else {}
            passed = code == 0 and bool(results[part].get("passed"))
            ok &= passed
            rep.figure(**{f"{part}_status": "ok" if passed else f"fail({code})"})
        for setup in SETUPS:
            mean = results[setup].get("mean")
            if mean:
                rep.figure(**{f"{setup}_{k}": v for k, v in mean.items()})
        base, full = results["baseline"], results["full"]
        if base.get("seconds") and full.get("train_s_on_baseline_batches"):
            ratio = full["train_s_on_baseline_batches"] / base["seconds"]
            rep.add("opsd / baseline", time_ratio=ratio, opsd=full, baseline=base)
            rep.figure(opsd_over_baseline_s=round(ratio, 3), baseline_loss_rdiff=base.get("loss_rdiff"))
            rep.figure(
                opsd_peak_gib=full["mean"].get("train_peak_gib"), baseline_peak_gib=base.get("peak_gib")
            )
    return rep.finish(ok)


def _qwen3_overrides(setup: str, root: Path, device: str, lengths: dict, steps: int) -> list[str]:
    over = {
        "device": device,
        "model.path": str(root / "model"),
        "data.path": str(root / "train.jsonl"),
        "logging.run_dir": str(root / setup),
        "model.dtype": "bfloat16",
        "model.lora.enabled": str(setup == "lora").lower(),
        "model.lora.r": 64,
        "model.lora.alpha": 128,
        "teacher.frozen_copy": "device",
        "data.max_prompt_len": lengths["prompt"] + 64,
        "data.max_teacher_prompt_len": lengths["prompt"] + lengths["solution"] + 128,
        "rollout.engine": "hf",
        "rollout.prompts_per_step": 8,
        "rollout.n": 2,
        "rollout.batch_size": 16,
        "rollout.max_new_tokens": lengths["response"],
        "rollout.temperature": 1.1,
        # KL(teacher || student) per response token, as the baseline computes it
        "loss.beta": 0.0,
        "loss.clip_mode": "none",
        "loss.temperature": 1.0,
        "loss.reduction": "token",
        "optim.lr": 1e-5,
        "optim.max_steps": steps,
        "checkpoint.enabled": "false",
        "logging.progress": "false",
        "logging.sample_every": 0,
        "logging.step_lines": "false",
    }
    if device == "cpu":  # --tiny: a GPU's plan is empty; the CPU's own mechanisms are not under test here
        over["cpu.tuning"] = "off"
    return [f"{k}={v}" for k, v in over.items()]


BATCH_KEYS = ("student_ids", "student_mask", "student_pos", "teacher_ids", "teacher_mask", "teacher_pos")


def qwen3_setup(setup: str, root: Path, tiny: bool, out: Path | None, peak: float) -> int:
    """One setup of check 4 in its own process: 3 steps, each step's phases, tokens/s, FLOPs and MFU,
    peak memory of the whole step and of its training phases; the full setup also saves its batches
    (token ids, masks, positions, weights) for the baseline. Writes ``ROOT/SETUP.json``."""
    from opsd import Trainer, load_config

    rep = Report("qwen3", out)
    device = device_for(tiny)
    lengths = TINY_LENGTHS if tiny else LENGTHS
    steps = 3  # the first warms up: the means are over the others
    t0 = time.perf_counter()
    trainer = Trainer(load_config(None, _qwen3_overrides(setup, root, device, lengths, steps)))
    load_s = time.perf_counter() - t0
    print(f"{setup}: the Trainer built in {load_s:.1f} s", flush=True)
    shape = model_shape(trainer.run.model)
    rep.add(f"{setup} shape", **vars(shape))
    rollout_peak: list[float | None] = []
    inner = trainer.run.forward_backward

    def forward_backward(*a, **k):  # the rollout's peak, then the training phases' own from here on
        rollout_peak.append(_gib(device))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return inner(*a, **k)

    trainer.run.forward_backward = forward_backward
    records, batches = [], []
    for _ in range(steps):
        out_ = trainer.step()
        rec = trainer.record(out_)
        train_peak = _gib(device)
        s_lens, t_lens, r = batch_lengths(out_.batches)
        f = step_flops(shape, s_lens, t_lens, r)
        passes_s = sum(rec[f"time_{p}"] for p in ("teacher", "student", "loss"))
        train_s = passes_s + rec["time_optim"]
        step_s = rec["time_step"]
        row = {
            "step": rec["step"],
            "loss": rec["loss"],
            "grad_norm": rec["grad_norm"],
            "step_s": step_s,
            **{f"{p}_s": rec[f"time_{p}"] for p in ("rollout", "teacher", "student", "loss", "optim")},
            "passes_s": passes_s,
            "train_s": train_s,
            "response_tokens": r,
            "tokens_per_s": rec["tokens_per_s"],
            "student_tokens": sum(s_lens),
            "teacher_tokens": sum(t_lens),
            "flops": f,
            "tflop": f["total"] / 1e12,
            "mfu_passes": f["total"] / (passes_s * H200_BF16_DENSE),
            "mfu_passes_measured": f["total"] / (passes_s * peak),
            "mfu_step": f["total"] / (step_s * H200_BF16_DENSE),
            "mfu_step_measured": f["total"] / (step_s * peak),
            "step_peak_gib": max((x for x in (rollout_peak[-1], train_peak) if x is not None), default=None),
            "train_peak_gib": train_peak,
            "reserved_gib": _gib(device, "reserved"),
        }
        records.append(row)
        rep.add(f"{setup} step", **row)
        if setup == "full":
            batches.append(
                [
                    {**{k: getattr(mb, k).cpu() for k in BATCH_KEYS}, "weights": mb.weights.cpu()}
                    for mb in out_.batches
                    if mb.sample_indices
                ]
            )
    trainer.close()
    del trainer, out_
    left = left_after()
    if batches:
        torch.save(batches, root / "batches.pt")
    later = records[1:]
    finite = all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in records)
    # MFU above 1 against the peak measured here would mean a FLOP or timing error; on a GPU only: a
    # CPU's tiny products and shared cores make its small measured peak no bound (--tiny)
    bound = 1.0 if device == "cuda" else math.inf
    sane = all(
        x["grad_norm"] > 0 and x["response_tokens"] > 0 and 0 < x["mfu_passes_measured"] <= bound
        for x in later
    )
    passed = len(records) == steps and finite and sane
    mean = {
        "step_s": round(sum(x["step_s"] for x in later) / len(later), 3),
        "tok_s": round(sum(x["tokens_per_s"] for x in later) / len(later)),
        **{
            k: round(sum(x[k] for x in later) / len(later), 4)
            for k in ("mfu_passes", "mfu_passes_measured", "mfu_step", "mfu_step_measured")
        },
        "loss_share": round(sum(x["loss_s"] / x["step_s"] for x in later) / len(later), 3),
        "train_peak_gib": _round(max((x["train_peak_gib"] or 0.0 for x in records), default=0.0) or None),
        "step_peak_gib": _round(max((x["step_peak_gib"] or 0.0 for x in records), default=0.0) or None),
        "left_mib": round(left, 1),
    }
    rep.add(setup, load_s=load_s, mean_after_first=mean, finite=finite, sane=sane, passed=passed)
    _table(setup, records)
    result = {"passed": passed, "mean": mean, "first_loss": records[0]["loss"]}
    result["train_s_on_baseline_batches"] = sum(x["train_s"] for x in later)
    (root / f"{setup}.json").write_text(json.dumps(result))
    return 0 if passed else 1


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def qwen3_baseline(root: Path, tiny: bool, out: Path | None, peak: float) -> int:
    """The plain PyTorch step on the full setup's batches (``batches.pt``), in its own process: the
    student under bf16 autocast over float32 weights, a bf16 copy of the model as the teacher, full
    logits, KL(teacher || student) on the response positions with opsd's token weights, AdamW (fused
    on CUDA). The first batch at the initial weights: its loss against opsd's first step's; the others
    timed. Writes ``ROOT/baseline.json``."""
    from transformers import AutoModelForCausalLM

    rep = Report("qwen3", out)
    device = device_for(tiny)
    opsd_first = json.loads((root / "full.json").read_text())["first_loss"]
    steps = torch.load(root / "batches.pt")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).to(device)
    teacher = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16).to(device)
    teacher.requires_grad_(False).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    rows = []
    for i, batch in enumerate(steps):
        row = _plain_step(
            model, teacher, [{k: v.to(device) for k, v in mb.items()} for mb in batch], opt, device
        )
        rows.append(row)
        rep.add("baseline step", index=i, **row)
    first, later = rows[0], rows[1:]
    rdiff = abs(first["loss"] - opsd_first) / max(abs(opsd_first), 1e-12)
    seconds = sum(r["step_s"] for r in later)
    peak_gib = max((r["peak_gib"] or 0.0 for r in later), default=0.0) or None
    passed = all(math.isfinite(r["loss"]) for r in rows) and rdiff <= BASELINE_LOSS_RTOL and seconds > 0
    result = {
        "passed": passed,
        "seconds": seconds,
        "peak_gib": _round(peak_gib),
        "loss_rdiff": round(rdiff, 5),
    }
    rep.add("baseline", opsd_first_loss=opsd_first, first_loss=first["loss"], **result)
    (root / "baseline.json").write_text(json.dumps(result))
    return 0 if passed else 1


def _plain_step(model, teacher, batch: list[dict], opt, device: str) -> dict:
    """One plain step over ``batch``'s micro-batches; its loss, phase times and peak memory."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    times = {"teacher": 0.0, "student": 0.0}
    total = 0.0
    t_step = time.perf_counter()
    for mb in batch:
        t0 = time.perf_counter()
        with torch.no_grad():
            t_logits = teacher(input_ids=mb["teacher_ids"], attention_mask=mb["teacher_mask"]).logits
        t_logp = t_logits.flatten(0, 1)[mb["teacher_pos"]].float().log_softmax(-1)
        del t_logits
        sync()
        t1 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            s_logits = model(input_ids=mb["student_ids"], attention_mask=mb["student_mask"]).logits
        s_logp = s_logits.flatten(0, 1)[mb["student_pos"]].float().log_softmax(-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
        loss = (kl * mb["weights"]).sum()
        loss.backward()
        total += float(loss.detach())
        del s_logits, s_logp, t_logp, kl, loss
        sync()
        times["teacher"] += t1 - t0
        times["student"] += time.perf_counter() - t1
    t0 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    optim = time.perf_counter() - t0
    return {
        "loss": total,
        "step_s": time.perf_counter() - t_step,
        "teacher_s": times["teacher"],
        "student_s": times["student"],
        "optim_s": optim,
        "peak_gib": _gib(device),
    }


def _table(setup: str, rows: list[dict]) -> None:
    def gib(x):
        return "-" if x is None else f"{x:.1f}"

    print(
        f"\n{setup}: | step | s | rollout | teacher | student | loss | optim | tok/s | step peak GiB | "
        "training peak GiB | TFLOP | MFU passes | MFU passes (measured peak) | MFU step |"
    )
    for r in rows:
        print(
            f"| {r['step']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['teacher_s']:.2f} | "
            f"{r['student_s']:.2f} | {r['loss_s']:.2f} | {r['optim_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{gib(r['step_peak_gib'])} | {gib(r['train_peak_gib'])} | {r['tflop']:.3g} | "
            f"{r['mfu_passes']:.1%} | {r['mfu_passes_measured']:.1%} | {r['mfu_step']:.1%} |",
            flush=True,
        )
