"""One OPSD training step on SmolLM2-135M-Instruct on the CPU, broken down by phase.

The setup (issue: the OPSD trainer, benchmark section): LoRA r=16 on all projections, fp32,
8 prompts per step from MATH train in file order (rows 0-7 warm up, rows 8-31 are the three
measured steps), 1 rollout each of at most 128 new tokens, the solution as privileged
information, the reference loss (forward KL, entry clip 0.05). Reports the per-step time split
into rollout / teacher / student fwd+bwd / loss / optimizer, the time outside generation per
completion token, and the peak RSS of the whole process. Writes docs/benchmarks.md.

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
    """The benchmark's run config (the issue's setting); exits with a line if the model or data is missing."""
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
    return load_config(
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=MATH)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "overrides", nargs="*", help="extra config overrides, e.g. model.gradient_checkpointing=true"
    )
    args = ap.parse_args()

    from opsd.trainer import Trainer

    cfg = bench_config(args.data, args.overrides)
    load_before = _common.load_avg()
    print(f"load before: {load_before:.2f} (a timed result needs < 0.5)", flush=True)
    trainer = Trainer(cfg)
    recs = trainer.train()
    print(f"load after: {_common.load_avg():.2f}", flush=True)
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
        "optimizer (s) | outside generation (s) | ms / completion token outside generation |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    per_tok = []
    for r in measured:
        outside = r["time_step"] - r["time_rollout"]
        ms = 1000 * outside / r["tokens"]
        per_tok.append(ms)
        cells = " | ".join(f"{r.get(f'time_{p}', 0.0):.2f}" for p in phases)
        lines.append(f"| {r['step']} | {r['tokens']} | {cells} | {outside:.2f} | {ms:.2f} |")
    med = statistics.median(per_tok)
    lines += [
        "",
        f"- Median time outside generation: **{med:.2f} ms per completion token** (target <= 6.7).",
        f"- Peak RSS of the whole process (model load included): **{peak_rss:.2f} GiB** (target <= 2 GiB).",
        "- For comparison (issue figures, TRL 1.16, same work, same machine type): SDFTTrainer 26.6-28.8 "
        "ms/token and 7.6 GiB; DistillationTrainer 13.4-15.4 ms/token and 8.0 GiB; GKDTrainer 20-25 "
        "ms/token and 10.6 GiB.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(args.out, "Train step (bench/train_step.py)", body)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
