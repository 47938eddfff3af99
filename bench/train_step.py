"""One OPSD training step on SmolLM2-135M-Instruct on the CPU, broken down by phase.

The setup: LoRA r=16 on all projections, fp32,
8 prompts per step from MATH train in file order (rows 0-7 warm up, rows 8-31 are the three
measured steps), 1 rollout each of at most 128 new tokens, the solution as privileged
information, the reference loss (forward KL, entry clip 0.05). Reports the per-step time split
into rollout / teacher / student fwd+bwd / loss / optimizer, the time outside generation per
completion token, and the peak RSS of the whole process. Writes docs/results.md. It first waits
(up to an hour) for the 1-minute load average to fall below 0.5 and records the load before and after.

    opsd fetch-model smollm2-135m-instruct
    python bench/train_step.py
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import _common
from _md import write_section

ROOT = _common.ROOT
MATH = ROOT.parent / "shared" / "data" / "math_train.jsonl"


def bench_config(data: Path, overrides: list[str]):
    """The benchmark's run config (the setup above); exits with a line if the model or data is missing."""
    from opsd.config import load_config
    from opsd.fetch import cached_model_path

    model = cached_model_path("smollm2-135m-instruct")
    if model is None:
        sys.exit("SmolLM2 is not fetched: run `opsd fetch-model smollm2-135m-instruct` first")
    if not data.is_file():
        sys.exit(f"{data} not found (the public MATH train split, see ../shared/data/README.md)")
    rows = [json.loads(x) for x in data.read_text().splitlines()[:32]]
    tmp = Path(tempfile.mkdtemp(prefix="opsd-bench-"))
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The `opsd` command's defaults for the process it owns (cpu.tune_malloc), as `opsd train` runs.
    from opsd.cpu import command_defaults

    return command_defaults(
        load_config(
            None,
            [
                f"model.path={model}",
                "model.dtype=float32",
                "model.lora.r=16",
                "model.lora.alpha=32",
                f"data.path={tmp / 'rows.jsonl'}",
                "data.shuffle=false",
                "data.max_prompt_len=1024",
                "data.max_teacher_prompt_len=2048",
                "rollout.prompts_per_step=8",
                "rollout.n=1",
                "rollout.max_new_tokens=128",
                "rollout.temperature=1.1",
                "loss.mode=jsd",
                "loss.beta=0",
                "loss.clip_mode=entry",
                "loss.clip=0.05",
                "optim.max_steps=4",
                "optim.lr=5e-6",
                "optim.grad_clip=0.1",
                "checkpoint.enabled=false",
                f"logging.run_dir={tmp / 'run'}",
                "logging.sample_every=0",
                "device=cpu",
                *overrides,
            ],
        )
    )


def count_step_tokens(trainer) -> list[tuple[int, int]]:
    """Per step, the student and teacher tokens its forwards read (wraps the trainer's packing)."""
    seen: list[tuple[int, int]] = []
    pack = trainer.microbatches

    def counted(samples):
        seen.append((sum(len(s.student_ids) for s in samples), sum(len(s.teacher_ids) for s in samples)))
        return pack(samples)

    trainer.microbatches = counted
    return seen


def step_flops(model, student_tokens: int, teacher_tokens: int, completion_tokens: int) -> float:
    """Matrix-product FLOPs of one exact OPSD step with a frozen base: 2 P per teacher token (forward),
    4 P per student token (forward and the input gradient; LoRA's own products are in P), and the fused
    loss's three [tokens, H] x [H, V] products (student and teacher logits, the hidden-state gradient).
    P: the decoder's linear weights (the head excluded)."""
    import torch

    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    p = sum(m.weight.numel() for m in linears)
    v, h = model.get_output_embeddings().weight.shape
    return 2 * p * teacher_tokens + 4 * p * student_tokens + 3 * 2 * h * v * completion_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=MATH)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "overrides", nargs="*", help="extra config overrides, e.g. model.gradient_checkpointing=true"
    )
    args = ap.parse_args()

    import torch

    from opsd.trainer import Trainer

    cfg = bench_config(args.data, args.overrides)
    load_before = _common.wait_for_idle(0.5, timeout_s=3600, poll_s=10)  # a timed run starts alone
    print(f"load before: {load_before:.2f} (a timed result needs < 0.5)", flush=True)
    rate = _common.matmul_rate(torch.float32)  # before the run, alone
    trainer = Trainer(cfg)
    lens = count_step_tokens(trainer)
    recs = trainer.train()
    print(f"load after: {_common.load_avg():.2f}", flush=True)
    rate_after = _common.matmul_rate(torch.float32)  # the same product again: the host's share moved?
    measured = recs[1:]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    phases = ["rollout", "teacher", "student", "loss", "optim"]
    lines = [
        f"Machine: {_common.describe_machine()}.",
        "",
        "SmolLM2-135M-Instruct, LoRA r=16 (all projections), fp32, 8 prompts/step (MATH train rows 8-31 in "
        "file order, rows 0-7 warm up), 1 rollout each, <= 128 new tokens at T=1.1, solution as privileged "
        "information, forward KL with entry clip 0.05. 1 warm-up step, 3 measured. Extra settings: "
        f"{' '.join(args.overrides) or 'none'}. Load average before: {load_before:.2f}; at the end: "
        f"{_common.load_avgs()} (above 2 means other jobs shared the cores).",
        "",
        "| step | completion tokens | rollout (s) | teacher (s) | student fwd+bwd (s) | loss (s) | "
        "optimizer (s) | outside generation (s) | ms / completion token outside generation | "
        "arithmetic floor (ms / token) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    per_tok, floors = [], []
    for r, (student, teacher) in zip(measured, lens[1:]):
        outside = r["time_step"] - r["time_rollout"]
        ms = 1000 * outside / r["tokens"]
        floor = (
            1000 * step_flops(trainer.run.model, student, teacher, r["tokens"]) / (rate * 1e9) / r["tokens"]
        )
        per_tok.append(ms)
        floors.append(floor)
        cells = " | ".join(f"{r.get(f'time_{p}', 0.0):.2f}" for p in phases)
        lines.append(f"| {r['step']} | {r['tokens']} | {cells} | {outside:.2f} | {ms:.2f} | {floor:.2f} |")
    med = statistics.median(per_tok)
    lines += [
        "",
        f"- Median time outside generation: **{med:.2f} ms per completion token** (target <= 6.7).",
        f"- Arithmetic floor: the step's matrix-product FLOPs (teacher forward, student forward and input "
        f"gradient, the three head products of the fused loss; attention scores and elementwise work left "
        f"out) at this machine's float32 product rate, {rate:.0f} GFLOP/s at SmolLM2's MLP shape, measured "
        f"alone before the run: the products alone take a median {statistics.median(floors):.2f} ms per "
        "completion token at that rate; the rest is attention, elementwise work and overheads. The same "
        f"product after the run: {rate_after:.0f} GFLOP/s (a rate that moved means the machine's share of "
        "its host moved during the run, which a load average inside a VM does not show).",
        f"- Peak RSS of the whole process (model load included): **{peak_rss:.2f} GiB** (target <= 2 GiB).",
        "- TRL's `SDFTTrainer` on the same work, side by side with opsd: `bench/vs_trl.py`.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(args.out, "Train step (bench/train_step.py)", body)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
