"""The Python checks of the GPU evidence run; ``bench/gpu/evidence.sh`` runs each under its own timeout.

    python bench/gpu/evidence.py trainer  [--tiny] [--out DIR]   # check 2: the Trainer, checkpoint, resume
    python bench/gpu/evidence.py torchrun [--tiny] [--out DIR]   # check 3: torchrun, FSDP2, bf16 policy
    python bench/gpu/evidence.py qwen3    [--tiny] [--out DIR]   # check 4: Qwen3-1.7B's shape, by phase

Only public entry points: :class:`opsd.Config` through :func:`opsd.load_config`, :class:`opsd.Trainer`
(``train``, ``step``, ``record``, ``close``) and ``python -m opsd train``. Everything is built offline:
random weights, a tokenizer made here, a few rows of synthetic problems in a temporary directory.

Each check prints what it measures as it goes, appends one JSON object per measurement to
``DIR/evidence.jsonl`` (written at once, so a run cut short keeps what it measured), prints
``FIGURES key=value ...`` as its last line (``evidence.sh`` copies it into ``summary.tsv``) and exits
0 when what it checks holds, 1 when not, 77 when it cannot run here (no CUDA without ``--tiny``).
``--tiny``: the same code on the CPU at a tiny shape, so that the suite can run it
(``tests/test_gpu_evidence.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))
# Deterministic cuBLAS for check 2's bit-for-bit comparisons; read when CUDA starts, so set before torch.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

SKIP = 77  # the exit status evidence.sh reads as "skipped"
H200_BF16_DENSE = 989e12  # FLOP/s: the H200's dense bf16 peak by NVIDIA's datasheet (the H100 SXM's)

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
        n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
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


def check_trainer(tiny: bool, out: Path | None) -> int:
    """LoRA and full fine-tuning on one device: 4 steps straight against 2 steps, a checkpoint and a
    resumed process for the last 2; the last step's record and the trained weights must be equal bit
    for bit. Where they are not, a second straight run tells run-to-run noise (nondeterministic
    kernels) from a resume defect: the resume passes only if it differs no more than 10 times that."""
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
        for setup in ("lora", "full"):
            t0 = time.perf_counter()
            over = {"model.lora.enabled": str(setup == "lora").lower(), "model.dtype": "float32"}
            over |= {"optim.max_steps": 4, "checkpoint.every": 2, "checkpoint.keep_last": 2}

            def cfg(name: str) -> list[str]:
                return _tiny_overrides(assets, root / f"{setup}-{name}", device, **over)  # noqa: B023

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
            passed = steps == [1, 2, 3, 4] and (
                exact
                or (
                    noise is not None
                    and max(noise.values()) > 0
                    and all(diff[k] <= 10 * max(noise[k], 1e-12) for k in diff)
                )
            )
            moved = max(float(w.abs().max()) for w in w_straight.values()) > 0
            passed = passed and moved and all(torch.isfinite(torch.tensor(r["loss"])) for r in straight)
            ok &= passed
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
    return rep.finish(ok)


# --- check 3: torchrun, FSDP2 on NCCL, the bf16 mixed-precision policy ----------------------------------


def _torchrun(config: Path, nproc: int = 1) -> tuple[int, list[str]]:
    """``torchrun --standalone --nproc-per-node N -m opsd train --config CONFIG``, its output streamed
    (``torchrun`` as this very Python's ``-m torch.distributed.run``: one on the PATH may be another's)."""
    from opsd.distributed import torchrun_command

    cmd = torchrun_command(nproc, "-m", "opsd", "train", "--config", str(config))
    print("$ " + " ".join(cmd), flush=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    return proc.wait(), lines


def check_torchrun(tiny: bool, out: Path | None) -> int:
    """`torchrun -m opsd train` on one rank: FSDP2 (NCCL on a GPU, gloo with --tiny) with model.dtype
    bfloat16, full fine-tuning (float32 masters, bf16 gathered weights, float32 gradient reduction)
    and LoRA (bf16 base, float32 adapters); 2 steps each and the final checkpoint."""
    import yaml

    rep = Report("torchrun", out)
    device = _device(tiny)
    if device is None:
        print("no CUDA device: check 3 needs one (--tiny runs it on the CPU with gloo)")
        return SKIP
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = _tiny_assets(root)
        for setup in ("full", "lora"):
            run_dir = root / f"torchrun-{setup}"
            over = _tiny_overrides(
                assets,
                run_dir,
                device,
                **{"model.lora.enabled": str(setup == "lora").lower(), "model.dtype": "bfloat16"},
                **{"optim.max_steps": 2, "checkpoint.every": 0, "teacher.frozen_copy": "device"},
            )
            tree: dict = {}
            for item in over:
                key, value = item.split("=", 1)
                node = tree
                *parents, leaf = key.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = yaml.safe_load(value)
            config = root / f"{setup}.yaml"
            config.write_text(yaml.safe_dump(tree))
            t0 = time.perf_counter()
            code, lines = _torchrun(config)
            seconds = time.perf_counter() - t0
            metrics = run_dir / "metrics.jsonl"
            recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
            precision = next((x.split("precision:", 1)[1].strip() for x in lines if "precision:" in x), "?")
            saved = sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if code == 0 else []
            finite = bool(recs) and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
            passed = code == 0 and [r["step"] for r in recs] == [1, 2] and finite and bool(saved)
            ok &= passed
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
            rep.figure(
                **{f"{setup}_exit": code, f"{setup}_steps": len(recs), f"{setup}_s": round(seconds, 1)}
            )
    return rep.finish(ok)


# --- check 4: Qwen3-1.7B's shape, random weights, LoRA and full fine-tuning, by phase ------------------


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


def _peaks(device: str) -> tuple[float | None, float | None]:
    """Peak allocated and reserved GiB since the step began (its timer reset them), on CUDA."""
    if device != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def check_qwen3(tiny: bool, out: Path | None) -> int:
    """Each step's phases, tokens/s, peak memory, the loss's share and MFU, for LoRA and full fine-tuning.

    FLOPs per step = 6 N T_student + 2 N T_teacher: N the parameters (1.72e9; the tied head once, as it
    is multiplied once per token), T the real (unpadded) tokens of the student's forward and backward
    and of the teacher's forward. Attention's own products and the rollout are not counted, and LoRA's
    backward computes no weight gradient of the frozen base (about 4 N per token, not 6 N): the LoRA
    figure overstates its work by up to 1.5x. MFU = FLOPs / (seconds x 989e12), over the training
    phases (teacher + student + loss + optimizer) and over the whole step (rollout included)."""
    from opsd import Trainer, load_config

    rep = Report("qwen3", out)
    device = _device(tiny)
    if device is None:
        print("no CUDA device: check 4 needs one (--tiny runs it on the CPU at a tiny shape)")
        return SKIP
    shape, lengths = (QWEN3_TINY, TINY_LENGTHS) if tiny else (QWEN3_1P7B, LENGTHS)
    steps = 2 if tiny else 3  # the first warms up: its times and MFU are not the mean's
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets, n_params = _qwen3_assets(root, shape, lengths, device, rep)
        rep.figure(params=n_params)
        for setup in ("lora", "full"):
            over = {
                "device": device,
                "model.path": assets["model"],
                "data.path": assets["data"],
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
                "optim.lr": 1e-5,
                "optim.max_steps": steps,
                "checkpoint.enabled": "false",
                "logging.progress": "false",
                "logging.sample_every": 0,
                "logging.step_lines": "false",
            }
            t0 = time.perf_counter()
            trainer = Trainer(load_config(None, [f"{k}={v}" for k, v in over.items()]))
            load_s = time.perf_counter() - t0
            print(f"{setup}: the Trainer built in {load_s:.1f} s", flush=True)
            records = []
            for _ in range(steps):
                out_ = trainer.step()
                rec = trainer.record(out_)
                alloc, reserved = _peaks(device)
                t_s = sum(getattr(mb, "student_real_tokens", 0) for mb in out_.batches)
                t_t = sum(getattr(mb, "teacher_real_tokens", 0) for mb in out_.batches)
                flops = 6 * n_params * t_s + 2 * n_params * t_t
                train_s = sum(rec[f"time_{p}"] for p in ("teacher", "student", "loss", "optim"))
                row = {
                    "step": rec["step"],
                    "loss": rec["loss"],
                    "step_s": rec["time_step"],
                    **{
                        f"{p}_s": rec[f"time_{p}"] for p in ("rollout", "teacher", "student", "loss", "optim")
                    },
                    "response_tokens": rec["tokens"],
                    "tokens_per_s": rec["tokens_per_s"],
                    "student_tokens": t_s,
                    "teacher_tokens": t_t,
                    "peak_alloc_gib": alloc if alloc is not None else rec["peak_mem_gb"],
                    "peak_reserved_gib": reserved,
                    "loss_share": rec["time_loss"] / rec["time_step"] if rec["time_step"] else 0.0,
                    "tflop": flops / 1e12,
                    "mfu_train": flops / (train_s * H200_BF16_DENSE) if train_s else 0.0,
                    "mfu_step": flops / (rec["time_step"] * H200_BF16_DENSE) if rec["time_step"] else 0.0,
                }
                records.append(row)
                rep.add(f"{setup} step", **row)
            trainer.close()
            del trainer, out_
            left = _left_after()
            later = records[1:] or records
            finite = all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
            ok &= finite and len(records) == steps
            mean = {
                k: sum(r[k] for r in later) / len(later)
                for k in ("step_s", "tokens_per_s", "mfu_train", "mfu_step", "loss_share")
            }
            rep.add(setup, load_s=load_s, left_after_mib=left, mean_after_first=mean, finite=finite)
            rep.figure(
                **{
                    f"{setup}_step_s": round(mean["step_s"], 2),
                    f"{setup}_tok_s": round(mean["tokens_per_s"]),
                    f"{setup}_peak_gib": round(max(r["peak_alloc_gib"] or 0.0 for r in records), 1),
                    f"{setup}_mfu_train": round(mean["mfu_train"], 4),
                    f"{setup}_loss_share": round(mean["loss_share"], 3),
                    f"{setup}_left_mib": round(left, 1),
                }
            )
            _table(setup, records)
    return rep.finish(ok)


def _table(setup: str, rows: list[dict]) -> None:
    def gib(x):
        return "-" if x is None else f"{x:.1f}"

    print(
        f"\n{setup}: | step | s | rollout | teacher | student | loss | optim | tok/s | peak alloc GiB | "
        "peak reserved GiB | loss share | MFU train | MFU step |"
    )
    for r in rows:
        print(
            f"| {r['step']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['teacher_s']:.2f} | "
            f"{r['student_s']:.2f} | {r['loss_s']:.2f} | {r['optim_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{gib(r['peak_alloc_gib'])} | {gib(r['peak_reserved_gib'])} | {r['loss_share']:.0%} | "
            f"{r['mfu_train']:.1%} | {r['mfu_step']:.1%} |",
            flush=True,
        )


CHECKS = {"trainer": check_trainer, "torchrun": check_torchrun, "qwen3": check_qwen3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=sorted(CHECKS))
    ap.add_argument("--tiny", action="store_true", help="on the CPU at a tiny shape (checks the script)")
    ap.add_argument("--out", type=Path, default=None, help="where evidence.jsonl is appended to")
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    return CHECKS[args.check](args.tiny, args.out)


if __name__ == "__main__":
    sys.exit(main())
