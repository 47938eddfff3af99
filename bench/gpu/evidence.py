"""The Python checks of the GPU evidence run; ``bench/gpu/evidence.sh`` runs each under its own timeout.

    python bench/gpu/evidence.py trainer  [--tiny] [--out DIR]   # check 2: the Trainer, checkpoint, resume
    python bench/gpu/evidence.py torchrun [--tiny] [--out DIR]   # check 3: torchrun, FSDP2, bf16 policy
    python bench/gpu/evidence.py qwen3    [--tiny] [--out DIR]   # check 4: Qwen3-1.7B's shape, by phase,
                                                                  #   and the plain PyTorch baseline
    python bench/gpu/evidence.py loss     [--tiny] [--out DIR]   # check 5: bench/loss.py, dense vs chunked

Only public entry points: :class:`opsd.Config` through :func:`opsd.load_config`, :class:`opsd.Trainer`
(``train``, ``step``, ``record``, ``close``) and ``python -m opsd train``. Everything is built offline:
random weights, a tokenizer made here, a few rows of synthetic problems in a temporary directory.

Each check prints what it measures as it goes, appends one JSON object per measurement to
``DIR/evidence.jsonl`` (written at once, so a run cut short keeps what it measured), prints
``FIGURES key=value ...`` as its last line (``evidence.sh`` copies it into ``summary.tsv``) and exits
0 when what it checks holds, 1 when not, 77 when it cannot run here (no CUDA without ``--tiny``).
``--tiny``: the same code on the CPU at a tiny shape, so that the suite can run it
(``tests/train/test_gpu_evidence.py``).

Full fine-tuning runs before LoRA in every check, and each setup in a guard of its own (check 2: an
exception is caught and recorded; checks 3 and 4: a process of its own, under its own timeout), so that
one setup's failure costs its own figures only.

Check 4's arithmetic (``flops.py`` has it in full, and ``tests/train/test_gpu_flops.py`` checks it by hand):

    FLOPs = 6 N_body T_s + 2 N_body T_t + 8 V H R + attention     (full fine-tuning)
    FLOPs = 4 N_body T_s + 6 N_lora T_s + 2 N_body T_t + 6 V H R + attention     (LoRA)

N_body the decoder's matrices (1.41e9 at Qwen3-1.7B: no embedding, no head), N_lora the adapters
(6.97e7 at r=64 on every linear layer), T_s and T_t the student's and teacher's real tokens, R the
response tokens (the only rows the fused loss sends through the 151936 x 2048 head), attention causal:
2 d L (L + 1) per layer and sequence forward, 3x that for the student. MFU is quoted twice over: over
the teacher and student passes (the teacher, student and loss phases: what the FLOPs count) and over
the whole step (rollout and optimizer included), each against the datasheet's dense bf16 peak (989e12
FLOP/s) and against an 8192^3 bf16 matrix product measured on the spot.

The baseline (check 4, full fine-tuning): on the same model and on the very batches opsd trained on, a
plain PyTorch step: the student under bf16 autocast over float32 weights, a bf16 copy as the teacher,
full logits, KL(teacher || student) on the response positions with opsd's token weights, fused AdamW
(on CUDA). opsd runs that objective too (loss.beta 0, no clipping, temperature 1), so its first step's
loss and the baseline's on the same batch at the same initial weights must agree; the summary gives
opsd's time over the baseline's on the same batches, and both peaks.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(1, _p)
# Deterministic cuBLAS for check 2's bit-for-bit comparisons; read when CUDA starts, so set before torch.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from flops import H200_BF16_DENSE, batch_lengths, matmul_peak, model_shape, step_flops  # noqa: E402

SKIP = 77  # the exit status evidence.sh reads as "skipped"
SETUPS = ("full", "lora")  # full fine-tuning first: a LoRA failure must not cost its figures
# The resume check's floor: nondeterministic kernels (SDPA's backward on CUDA) can leave a resumed run
# this far from a straight one even where a second straight run happened to match the first exactly.
RESUME_FLOOR = {"record": 1e-4, "weights": 1e-5}
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


# --- shared ----------------------------------------------------------------------------------------


class Report:
    """What a check measured: printed, and appended to ``evidence.jsonl`` line by line."""

    def __init__(self, check: str, out: Path | None) -> None:
        self.check, self.path, self.figures = check, (out / "evidence.jsonl" if out else None), {}

    def add(self, what: str, **values) -> None:
        rec = {"check": self.check, "what": what, **values}
        line = json.dumps(rec, default=str)
        print(f"EVIDENCE {line}", flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")

    def figure(self, **values) -> None:
        self.figures.update(values)

    def failed(self, what: str, err: BaseException) -> None:
        """A guarded setup that raised: its traceback printed, one record of it, the check goes on."""
        import traceback

        traceback.print_exception(err)
        self.add(what, error=f"{type(err).__name__}: {err}"[:500], passed=False)
        self.figure(**{f"{what}_error": type(err).__name__})

    def finish(self, ok: bool) -> int:
        def fmt(v) -> str:
            return f"{v:.4g}" if isinstance(v, float) else str(v)

        print("FIGURES " + " ".join(f"{k}={fmt(v)}" for k, v in self.figures.items()), flush=True)
        return 0 if ok else 1


def _device(tiny: bool) -> str | None:
    """cpu for --tiny, cuda otherwise; None where there is no CUDA to run on."""
    if tiny:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def _left_after() -> float:
    """The accelerator memory still allocated (MiB) once the caller has closed its Trainer and dropped
    every reference to it and to what its steps returned: what a Trainer leaves behind."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**20


def _tiny_assets(root: Path, rows: int = 8) -> dict:
    """The tiny BPE tokenizer and a 2-layer model (opsd.tiny), and addition problems with solutions."""
    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = [
        {
            "problem": f"What is {a} + {b}?",
            "solution": f"{a} + {b} = {a + b}. The answer is {a + b}.",
            "answer": a + b,
        }
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2), (4, 5), (6, 1)][:rows]
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return {"model": str(root / "model"), "data": str(root / "train.jsonl")}


def _tiny_overrides(assets: dict, run_dir: Path, device: str, **over) -> list[str]:
    base = {
        "device": device,
        "model.path": assets["model"],
        "data.path": assets["data"],
        "logging.run_dir": str(run_dir),
        "model.lora.r": 4,
        "model.lora.alpha": 8,
        "rollout.engine": "hf",  # there is no vLLM on the GPU machine; auto would pick it where it is
        "rollout.prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 8,
        "rollout.temperature": 1.0,
        "optim.lr": 0.01,  # large: the weights move visibly in a few steps
        "loss.clip_mode": "none",
        "data.max_prompt_len": 256,
        "logging.progress": "false",
        "logging.sample_every": 0,
        "logging.step_lines": "false",
    }
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


# --- check 2: the Trainer on one device; a checkpoint and an exact resume ------------------------------

RECORD_KEYS = ("loss", "grad_norm", "divergence", "entropy_student", "entropy_teacher", "agreement")


def _trained(trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().float().cpu().clone()
        for n, p in trainer.run.model.named_parameters()
        if p.requires_grad
    }


def _run(
    overrides: list[str], *, until: int | None = None, resume: bool = False
) -> tuple[list[dict], dict, float]:
    from opsd import Trainer, load_config

    trainer = Trainer(load_config(None, overrides), resume=resume)
    history = trainer.train(until_step=until)
    weights = _trained(trainer)
    trainer.close()
    del trainer
    return history, weights, _left_after()


def _differences(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> dict[str, float]:
    """The largest differences between two runs' last step records and their trained weights."""
    (ha, wa), (hb, wb) = a, b
    rec = max(abs(ha[-1][k] - hb[-1][k]) for k in RECORD_KEYS)
    weights = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
    return {"record": rec, "weights": weights}


def resume_passes(diff: dict[str, float], noise: dict[str, float] | None) -> bool:
    """A resume that is not bit-exact passes where it is no further from the straight run than 10 times
    a second straight run is (nondeterministic kernels), or than :data:`RESUME_FLOOR`."""
    if noise is None:
        return all(diff[k] == 0.0 for k in diff)
    return all(diff[k] <= max(10 * noise[k], RESUME_FLOOR[k]) for k in diff)


def check_trainer(tiny: bool, out: Path | None) -> int:
    """Full fine-tuning, then LoRA, on one device: 4 steps straight against 2 steps, a checkpoint and a
    resumed process for the last 2; the last step's record and the trained weights must be equal bit
    for bit. Where they are not, a second straight run tells run-to-run noise (nondeterministic
    kernels) from a resume defect (:func:`resume_passes`). Each setup in its own guard."""
    rep = Report("trainer", out)
    device = _device(tiny)
    if device is None:
        print("no CUDA device: check 2 needs one (--tiny runs it on the CPU)")
        return SKIP
    torch.use_deterministic_algorithms(True, warn_only=True)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = _tiny_assets(root)
        for setup in SETUPS:
            try:
                ok &= _trainer_setup(setup, root, assets, device, rep)
            except Exception as err:  # noqa: BLE001 - the guard: this setup's figures are lost, not the next's
                rep.failed(setup, err)
                ok = False
                _left_after()
    return rep.finish(ok)


def _trainer_setup(setup: str, root: Path, assets: dict, device: str, rep: Report) -> bool:
    t0 = time.perf_counter()
    over = {"model.lora.enabled": str(setup == "lora").lower(), "model.dtype": "float32"}
    over |= {"optim.max_steps": 4, "checkpoint.every": 2, "checkpoint.keep_last": 2}

    def cfg(name: str) -> list[str]:
        return _tiny_overrides(assets, root / f"{setup}-{name}", device, **over)

    straight, w_straight, left = _run(cfg("straight"))
    first, _, _ = _run(cfg("resumed"), until=2)
    ckpt = root / f"{setup}-resumed" / "checkpoints"
    ckpt_mib = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**20
    resumed, w_resumed, _ = _run(cfg("resumed"), resume=True)
    diff = _differences((straight, w_straight), (resumed, w_resumed))
    exact = diff["record"] == 0.0 and diff["weights"] == 0.0
    noise = None
    if not exact:
        again, w_again, _ = _run(cfg("again"))
        noise = _differences((straight, w_straight), (again, w_again))
    steps = [r["step"] for r in first] + [r["step"] for r in resumed]
    passed = steps == [1, 2, 3, 4] and resume_passes(diff, noise)
    moved = max(float(w.abs().max()) for w in w_straight.values()) > 0
    passed = passed and moved and all(torch.isfinite(torch.tensor(r["loss"])) for r in straight)
    rep.add(
        setup,
        steps=steps,
        last=straight[-1],
        resume_exact=exact,
        resume_diff=diff,
        rerun_diff=noise,
        checkpoint_mib=ckpt_mib,
        left_after_mib=left,
        seconds=time.perf_counter() - t0,
        passed=passed,
    )
    rep.figure(**{f"{setup}_exact": exact, f"{setup}_diff": max(diff.values())})
    rep.figure(**{f"{setup}_left_mib": round(left, 1), f"{setup}_ckpt_mib": round(ckpt_mib, 2)})
    return passed


# --- check 3: torchrun, FSDP2 on NCCL, the bf16 mixed-precision policy ----------------------------------


def _stream(cmd: list[str], timeout: float | None = None) -> tuple[int, list[str]]:
    """Run ``cmd`` from the repository root with its output streamed as it comes and kept; past
    ``timeout`` seconds its whole process group is killed and the exit status is 124 (as `timeout`'s)."""
    import signal
    import threading

    print("$ " + " ".join(cmd), flush=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill) if timeout else None
    if timer is not None:
        timer.start()
    lines = []
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
        code = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if expired.is_set():
        print(f"== cut off after {timeout:.0f} s", flush=True)
        return 124, lines
    return code, lines


def _torchrun(config: Path, nproc: int = 1, timeout: float | None = None) -> tuple[int, list[str]]:
    """``torchrun --standalone --nproc-per-node N -m opsd train --config CONFIG``, its output streamed
    (``torchrun`` as this very Python's ``-m torch.distributed.run``: one on the PATH may be another's)."""
    from opsd.distributed import torchrun_command

    return _stream(torchrun_command(nproc, "-m", "opsd", "train", "--config", str(config)), timeout)


def check_torchrun(tiny: bool, out: Path | None) -> int:
    """`torchrun -m opsd train` on one rank: FSDP2 (NCCL on a GPU, gloo with --tiny) with model.dtype
    bfloat16, full fine-tuning (float32 masters, bf16 gathered weights, float32 gradient reduction)
    and then LoRA (bf16 base, float32 adapters); 2 steps each and the final checkpoint. Each launch is a
    process group of its own under its own timeout (none with --tiny: the check's own bounds it)."""
    rep = Report("torchrun", out)
    device = _device(tiny)
    if device is None:
        print("no CUDA device: check 3 needs one (--tiny runs it on the CPU with gloo)")
        return SKIP
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = _tiny_assets(root)
        for setup, budget in zip(SETUPS, (28, 26)):
            try:
                ok &= _torchrun_setup(setup, root, assets, device, None if tiny else budget, rep)
            except Exception as err:  # noqa: BLE001 - the guard: this setup's figures are lost, not the next's
                rep.failed(setup, err)
                ok = False
    return rep.finish(ok)


def _yaml_config(overrides: list[str], path: Path) -> Path:
    """``key.sub=value`` overrides as a YAML config file (what `opsd train --config` reads)."""
    import yaml

    tree: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(tree))
    return path


def _torchrun_setup(
    setup: str, root: Path, assets: dict, device: str, budget: float | None, rep: Report
) -> bool:
    run_dir = root / f"torchrun-{setup}"
    over = _tiny_overrides(
        assets,
        run_dir,
        device,
        **{"model.lora.enabled": str(setup == "lora").lower(), "model.dtype": "bfloat16"},
        **{"optim.max_steps": 2, "checkpoint.every": 0, "teacher.frozen_copy": "device"},
    )
    config = _yaml_config(over, root / f"{setup}.yaml")
    t0 = time.perf_counter()
    code, lines = _torchrun(config, timeout=budget)
    seconds = time.perf_counter() - t0
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    precision = next((x.split("precision:", 1)[1].strip() for x in lines if "precision:" in x), "?")
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if code == 0 else []
    finite = bool(recs) and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    passed = code == 0 and [r["step"] for r in recs] == [1, 2] and finite and bool(saved)
    rep.add(
        setup,
        exit=code,
        precision=precision,
        losses=[r["loss"] for r in recs],
        grad_norms=[r["grad_norm"] for r in recs],
        checkpoints=saved,
        seconds=seconds,
        passed=passed,
    )
    rep.figure(**{f"{setup}_exit": code, f"{setup}_steps": len(recs), f"{setup}_s": round(seconds, 1)})
    return passed


# --- check 4: Qwen3-1.7B's shape, random weights, full fine-tuning and LoRA by phase, the baseline ---------


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
    device = _device(tiny)
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
            cmd = [sys.executable, __file__, f"qwen3-{'baseline' if part == 'baseline' else 'setup'}"]
            cmd += [*(["--setup", part] if part != "baseline" else []), "--assets", str(root)]
            cmd += [
                "--peak",
                repr(peak),
                *(["--tiny"] if tiny else []),
                *(["--out", str(out)] if out else []),
            ]
            code, _ = _stream(cmd, None if tiny else budget)
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
    device = _device(tiny)
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
    left = _left_after()
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
    device = _device(tiny)
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


# --- check 5: the loss alone, dense against chunked (bench/loss.py) -------------------------------------

LOSS_LINE = re.compile(r"^(\S+) N=(\d+) (\S+): ([0-9.]+)s peak (-?[0-9.]+) MB loss (\S+)")


def check_loss(tiny: bool, out: Path | None) -> int:
    """``bench/loss.py``'s dense-versus-chunked comparison (forward and backward of the distillation loss
    from hidden states and the head) at Qwen3-1.7B's head on CUDA, N = 1024 and 4096 rows (--tiny:
    SmolLM2's head, 256 rows, on the CPU); its rows as measurements, chunked / dense time and peak."""
    rep = Report("loss", out)
    device = _device(tiny)
    if device is None:
        print("no CUDA device: check 5 needs one (--tiny runs it on the CPU)")
        return SKIP
    shape, ns = ("SmolLM2-135M", ["256"]) if tiny else ("Qwen3-1.7B", ["1024", "4096"])
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "bench" / "loss.py"), "--device", device, "--shapes", shape]
        code, lines = _stream([*cmd, "--ns", *ns, "--out", str(Path(tmp) / "loss.md")])
    rows: dict[tuple[int, str], dict] = {}
    for line in lines:
        m = LOSS_LINE.match(line)
        if m:
            row = {"n": int(m[2]), "impl": m[3], "time_s": float(m[4]), "peak_mb": float(m[5]), "loss": m[6]}
            rows[(row["n"], row["impl"])] = row
            rep.add("row", shape=m[1], **row)
    ok = code == 0
    for n in map(int, ns):
        chunked, dense = rows.get((n, "opsd-chunked")), rows.get((n, "naive"))
        ok &= chunked is not None
        if chunked and dense:
            rep.figure(**{f"n{n}_time_ratio": round(chunked["time_s"] / dense["time_s"], 3)})
            rep.figure(
                **{f"n{n}_chunked_mb": round(chunked["peak_mb"]), f"n{n}_dense_mb": round(dense["peak_mb"])}
            )
        elif chunked:
            rep.figure(**{f"n{n}_chunked_mb": round(chunked["peak_mb"]), f"n{n}_dense": "skipped"})
    return rep.finish(ok)


CHECKS = {"trainer": check_trainer, "torchrun": check_torchrun, "qwen3": check_qwen3, "loss": check_loss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=sorted([*CHECKS, "qwen3-setup", "qwen3-baseline"]))
    ap.add_argument("--tiny", action="store_true", help="on the CPU at a tiny shape (checks the script)")
    ap.add_argument("--out", type=Path, default=None, help="where evidence.jsonl is appended to")
    ap.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)
    ap.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.check == "qwen3-setup":
        return qwen3_setup(args.setup, args.assets, args.tiny, args.out, args.peak)
    if args.check == "qwen3-baseline":
        return qwen3_baseline(args.assets, args.tiny, args.out, args.peak)
    return CHECKS[args.check](args.tiny, args.out)


if __name__ == "__main__":
    sys.exit(main())
