"""Resident memory that CPU attention keeps per sequence length it has seen (bf16 against float32).

PyTorch's CPU ``scaled_dot_product_attention`` in bf16 builds a matrix-multiply kernel for each new
sequence length and keeps it for the life of the process; float32 keeps none. This script runs
causal attention at SmolLM2-135M's shape (9 query heads, 3 key/value heads, head size 64, 2 rows)
over a range of lengths, every length once and then again, and prints the process's resident set
after each pass: all lengths from 100 on, then only the bucket widths among them (what opsd pads to
on a CPU in bf16: ``opsd.cpu.buckets.bucket_width``, ``opsd.cpu.CpuPlan.bucket_widths``), each in a
fresh process. Memory does not depend on the
machine's load; the times are not results.

    python bench/cpu/sdpa_lengths.py                       # bf16 and float32, forward only
    python bench/cpu/sdpa_lengths.py --backward            # forward and backward
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/: the shared bench modules

import _common  # noqa: E402


def child(dtype_name: str, which: str, top: int, backward: bool) -> None:
    import psutil
    import torch
    import torch.nn.functional as F

    from opsd.cpu.buckets import bucket_width

    dtype = getattr(torch, dtype_name)
    proc = psutil.Process()
    lengths = list(range(100, top + 1))
    if which == "buckets":
        lengths = sorted({bucket_width(n) for n in lengths})
    before = proc.memory_info().rss
    after = []
    for _ in range(2):
        for n in lengths:
            q = torch.randn(2, 9, n, 64, dtype=dtype, requires_grad=backward)
            k = torch.randn(2, 3, n, 64, dtype=dtype, requires_grad=backward)
            v = torch.randn(2, 3, n, 64, dtype=dtype, requires_grad=backward)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if backward:
                out.sum().backward()
        after.append(proc.memory_info().rss)
    mib = 2**20
    grown = (after[0] - before) / mib
    print(
        f"| {dtype_name} | {'every length' if which == 'all' else 'bucket widths'} 100-{top} "
        f"| {len(lengths)} | {grown:.0f} | {(after[1] - after[0]) / mib:.0f} | {grown / len(lengths):.2f} |",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=1300, help="longest sequence length")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("DTYPE", "WHICH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.top, args.backward)
        return
    print(_common.describe_machine())
    passes = "forward and backward" if args.backward else "forward"
    print(f"causal attention, 2 x 9 heads x length x 64, {passes}")
    print("| dtype | lengths | count | MiB kept after one pass | MiB more after a second | MiB per length |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in ("bfloat16", "float32"):
        for which in ("all", "buckets"):
            cmd = [sys.executable, __file__, "--child", dtype, which, "--top", str(args.top)]
            subprocess.run(cmd + (["--backward"] if args.backward else []), check=True)


if __name__ == "__main__":
    main()
