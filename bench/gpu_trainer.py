"""The whole `opsd train` on the GPUs at Qwen3-1.7B's shape: the real Trainer, random weights, no hub.

What `bench/gpu_step.py` times is the step's micro-batch loop on synthetic batches; this runs the
trainer itself: rollouts through the HF engine, the teacher, the fused loss, backward, AdamW, a
checkpoint save and an exact resume, for LoRA and full fine-tuning, in one process and under
`torchrun` over every visible GPU. Everything is built offline: a Qwen3-1.7B-shaped model with
random weights (saved to a temporary directory), a word-level tokenizer whose vocabulary covers the
model's (every sampled id decodes), and synthetic problems whose prompts have realistic lengths.

It prints, per setup, the trainer's own step metrics (phase times, response tokens/s, peak GPU
memory allocated, and reserved where one process ran it, the loss's share of the step), averaged
over the steps after the first. Stops starting new
setups after 7 minutes and says which it skipped.

    python bench/gpu_trainer.py          # CUDA; after `pip install -e .`, nothing else
    python bench/gpu_trainer.py --tiny   # a tiny config on the CPU: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
import yaml
from gpu_step import LENGTHS, QWEN3_1P7B, TINY, TINY_LENGTHS

BUDGET_S = 7 * 60
SETUPS = ("lora", "full")


def build_tokenizer(vocab_size: int):
    """Word-level: ``w0 .. wN`` plus ChatML's special tokens, exactly ``vocab_size`` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from opsd.fetch import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE

    specials = ["<unk>", *CHATML_SPECIAL_TOKENS]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    vocab = {tok: i for i, tok in enumerate([*words, *specials])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
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


def write_assets(root: Path, shape: dict, lengths: dict, rows: int = 64) -> dict:
    """The model directory (random weights, float32 so full fine-tuning keeps masters), the data file."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = build_tokenizer(shape["vocab_size"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(**shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        dtype=torch.float32,
    )
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    del model
    g = torch.Generator().manual_seed(1)
    words = shape["vocab_size"] - 16

    def text(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, words, (n,), generator=g))

    solution_len = max(1, lengths["teacher_prompt"] - lengths["prompt"])
    data = [
        {"problem": text(lengths["prompt"]), "solution": text(solution_len), "answer": "w1"}
        for _ in range(rows)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return {"model": str(root / "model"), "data": str(root / "train.jsonl")}


def config(assets: dict, run_dir: Path, setup: str, lengths: dict, steps: int, device: str) -> dict:
    return {
        "device": device,
        "model": {
            "path": assets["model"],
            "dtype": "auto",
            "lora": {"enabled": setup == "lora", "r": 64, "alpha": 128},
        },
        "teacher": {"frozen_copy": "device"},
        "data": {
            "path": assets["data"],
            "max_prompt_len": lengths["prompt"] + 64,
            "max_teacher_prompt_len": lengths["teacher_prompt"] + 128,
        },
        "rollout": {
            "engine": "hf",
            "prompts_per_step": 8,
            "n": 1,
            "max_new_tokens": lengths["response"],
            "temperature": 1.1,
            "batch_size": 8,
        },
        "optim": {"lr": 5e-6, "max_steps": steps},
        "checkpoint": {"every": steps - 1, "keep_last": 1},
        "logging": {"run_dir": str(run_dir), "progress": False, "sample_every": 0, "step_lines": False},
    }


def run_setup(
    assets: dict, tmp: Path, setup: str, lengths: dict, steps: int, nproc: int, device: str
) -> dict:
    """``steps - 1`` steps and a checkpoint, then a resume for the last step (one process), or
    `torchrun -m opsd train` for all steps (several); the trainer's metrics come back."""
    run_dir = tmp / f"{setup}-{nproc}"
    cfg = config(assets, run_dir, setup, lengths, steps, device)
    path = tmp / f"{setup}-{nproc}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    reserved = None
    if nproc == 1:
        from opsd import Trainer, load_config

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        Trainer(load_config(path)).train(until_step=steps - 1)
        resumed = Trainer(load_config(path), resume=True)
        assert resumed.step_num == steps - 1, resumed.step_num
        resumed.train()
        if torch.cuda.is_available():  # what the caching allocator held at its peak, over both trainers
            reserved = torch.cuda.max_memory_reserved() / 2**30
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "opsd",
            "train",
            "--config",
            str(path),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)  # _common put ROOT on PYTHONPATH
        if res.returncode != 0:
            raise RuntimeError(f"torchrun failed ({res.returncode}): {res.stderr[-2000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = recs[1:] or recs
    times = {
        k: statistics.mean(r.get(f"time_{k}", 0.0) for r in measured)
        for k in ("rollout", "teacher", "student", "loss", "optim")
    }
    step_s = statistics.mean(r["time_step"] for r in measured)
    tokens = statistics.mean(r["tokens"] for r in measured)
    return {
        "setup": f"{setup}, {nproc} process{'es' if nproc > 1 else ''}",
        "steps": len(recs),
        "step_s": step_s,
        **times,
        "tok_s": tokens / step_s,
        "peak_gb": max(r.get("peak_mem_gb") or 0.0 for r in measured),
        "reserved_gb": reserved,
        "loss_share": times["loss"] / step_s,
    }


def render(rows: list[dict], skipped: list[str], machine: str) -> str:
    out = [
        machine,
        "",
        "| setup | steps | step s | rollout s | teacher s | student s | loss s | optim s | "
        "response tok/s | peak allocated GB | peak reserved GB | loss share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reserved = "-" if r["reserved_gb"] is None else f"{r['reserved_gb']:.1f}"
        out.append(
            f"| {r['setup']} | {r['steps']} | {r['step_s']:.2f} | {r['rollout']:.2f} | {r['teacher']:.2f} | "
            f"{r['student']:.2f} | {r['loss']:.2f} | {r['optim']:.2f} | {r['tok_s']:.0f} | "
            f"{r['peak_gb']:.1f} | {reserved} | {r['loss_share']:.0%} |"
        )
    if skipped:
        out += ["", f"Skipped (time budget): {', '.join(skipped)}."]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny config on the CPU, to check the script")
    ap.add_argument("--steps", type=int, default=3, help="steps per setup (the last after a resume)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench/gpu_trainer.py needs a CUDA GPU (none visible); --tiny checks the script on the CPU")
        return 0
    shape, lengths = (TINY, TINY_LENGTHS) if args.tiny else (QWEN3_1P7B, LENGTHS)
    gpus = torch.cuda.device_count() if cuda else 0
    device = "cuda" if cuda else "cpu"
    start, rows, skipped = time.perf_counter(), [], []
    plan = [(s, 1) for s in SETUPS] + ([(s, gpus) for s in SETUPS] if gpus > 1 else [])
    if args.tiny and not cuda:
        plan.append(("lora", 2))  # torchrun's path, on 2 gloo ranks
    with tempfile.TemporaryDirectory() as tmp:
        assets = write_assets(Path(tmp), shape, lengths)
        for setup, nproc in plan:
            if time.perf_counter() - start > BUDGET_S:
                skipped.append(f"{setup} x{nproc}")
                continue
            rows.append(run_setup(assets, Path(tmp), setup, lengths, args.steps, nproc, device))
            if cuda:
                torch.cuda.empty_cache()
    visible = f"{gpus} visible GPU{'' if gpus == 1 else 's'}{' (--tiny)' if args.tiny else ''}"
    machine = f"{_common.describe_machine()}; {visible}; {time.perf_counter() - start:.0f} s in all"
    print(render(rows, skipped, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
