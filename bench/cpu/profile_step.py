"""Where the time of an OPSD step goes on this CPU, and what bounds it: torch.profiler over one step.

The bench/train_step.py setting (SmolLM2-135M-Instruct, LoRA r=16, 8 MATH prompts, 128 new tokens,
fp32). One warm-up step, then one profiled step. Reports the step's phases, the operators with the
most self CPU time, the matrix products' achieved GFLOP/s (the profiler's FLOP counts), and this
machine's matrix-product rate at SmolLM2's shapes in float32 and bfloat16, which is the bound: the
step is made of those products. Writes the "Step profile (bench/cpu/profile_step.py)" section of
docs/results.md. Run it alone (it waits for the 1-minute load average to fall below 0.5).

    python bench/cpu/profile_step.py
    python bench/cpu/profile_step.py model.dtype=bfloat16 --no-write
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/: the shared bench modules

import _common  # noqa: E402
import torch  # noqa: E402
from _md import write_section  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from train_step import MATH, ROOT, bench_config  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=MATH)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()
    from opsd.trainer import Trainer

    cfg = bench_config(args.data, ["optim.max_steps=2", *args.overrides])
    _common.wait_for_idle(0.5, timeout_s=math.inf, poll_s=10)
    before = _common.load_avgs(2)
    rate32, rate16 = _common.matmul_rate(torch.float32), _common.matmul_rate(torch.bfloat16)
    trainer = Trainer(cfg)
    trainer.train(until_step=1)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        (rec,) = trainer.train(until_step=2)
    after = _common.load_avgs(2)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    mm = [e for e in events if e.key in MATMULS]
    mm_us, mm_flops = sum(e.self_cpu_time_total for e in mm), sum(e.flops for e in mm)
    phases = ["rollout", "teacher", "student", "loss", "optim"]
    outside = rec["time_step"] - rec["time_rollout"]
    lines = [
        f"Machine: {_common.describe_machine()}. Load average (1/5/15 min) before {before}, after {after}. "
        f"`{' '.join(['python bench/cpu/profile_step.py', *args.overrides])}`.",
        "",
        f"One profiled step after one warm-up step, bench/train_step.py's setting ({cfg.model.dtype}). "
        f"Step {rec['time_step']:.1f} s for {rec['tokens']} completion tokens: "
        + ", ".join(f"{p} {rec['time_' + p]:.1f} s" for p in phases)
        + f"; outside generation {1000 * outside / rec['tokens']:.1f} ms per completion token.",
        f"Real-token fraction of the forwards: teacher {rec['real_token_frac_teacher']:.2f}, student "
        f"{rec['real_token_frac_student']:.2f}; micro-batch budget {trainer.run.mb_tokens} padded tokens. "
        "Peak "
        "RSS of the process (model load and profiler included): "
        f"**{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB**.",
        "",
        f"- Matrix products (`{'`, `'.join(MATMULS)}`): **{100 * mm_us / total_us:.0f}%** of the step's self "
        f"CPU time, at **{mm_flops / max(mm_us, 1) / 1e3:.0f} GFLOP/s** achieved.",
        "- This machine's product rate at SmolLM2's MLP shape ([1024, 576] x [576, 1536]): float32 "
        f"**{rate32:.0f} GFLOP/s**, bfloat16 **{rate16:.0f} GFLOP/s** "
        f"({'no bf16 matrix units: bf16 is emulated' if rate16 < rate32 else 'bf16 faster'}).",
        "",
        "| operator | self CPU (s) | share | calls |",
        "|---|---|---|---|",
    ]
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        lines.append(
            f"| `{e.key}` | {e.self_cpu_time_total / 1e6:.2f} | "
            f"{100 * e.self_cpu_time_total / total_us:.1f}% | {e.count} |"
        )
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(args.out, "Step profile (bench/cpu/profile_step.py)", body)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
