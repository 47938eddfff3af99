"""The student pass at 1 and 8 rows per micro-batch, under three OpenMP waiting policies.

opsd's CPU default (a 512 MiB activation budget) runs the student's forward + backward one sample
per micro-batch, and every operator of a pass is an OpenMP parallel region: eight one-row passes
dispatch eight times the operators of one eight-row pass for the same FLOPs. This script times the
same work (8 student rows of SmolLM2-135M-Instruct with LoRA r=16 on all seven projections, 270
tokens each, the last 128 as response positions, forward to the final hidden states and backward)
at 1 and at 8 rows per micro-batch, under:

* ``passive``: ``OMP_WAIT_POLICY=PASSIVE``, no spinning (the benchmarks' rule): a thread
  sleeps at the end of each region and the next one wakes it;
* ``short-spin``: ``OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000``: about 1,000 pauses, then sleep;
* ``default``: neither set (libgomp spins ~300,000 times before it sleeps).

Each (policy, rows) is its own process, started at a 1-minute load below 0.5 (``--wait-idle``);
the load and the float32 product rate are read before and after. It also counts the operators one
pass dispatches (an untimed pass under a dispatch counter). Here the policy is a variable, so the
rule's ``PASSIVE`` is not forced on the other two.

    python bench/cpu/omp_wait.py --wait-idle          # writes docs/results.md
    python bench/cpu/omp_wait.py --smoke              # 2 rows of 32 tokens, 1 repeat; writes nothing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/: the shared bench modules

import _common  # noqa: E402
from _md import write_section  # noqa: E402

SECTION = "OpenMP waiting and the student pass (bench/cpu/omp_wait.py)"
LOAD_LIMIT = 0.5
POLICIES = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "short-spin": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
    "default": {},
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=270)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over all rows, after one warm-up")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--wait-idle", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=_common.ROOT / "docs" / "results.md")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # rows per micro-batch
    ap.add_argument("--policy", choices=POLICIES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.seq_len, args.response, args.repeats, args.no_write = 2, 32, 8, 1, True
    if args.child:
        # Before torch loads OpenMP; importing _common set the rule's PASSIVE, which this run may not want.
        for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            os.environ.pop(key, None)
        os.environ.update(POLICIES[args.policy])
        print(json.dumps(_child(args.rows, args.child, args.seq_len, args.response, args.repeats)))
        return

    from opsd.fetch import cached_model_path  # light: no torch

    if cached_model_path("smollm2-135m-instruct") is None:
        sys.exit("SmolLM2 is not fetched: run `opsd fetch-model smollm2-135m-instruct` first")
    if bad := [p for p in args.policies.split(",") if p not in POLICIES]:
        sys.exit(f"--policies: {bad} not among {', '.join(POLICIES)}")
    runs = []
    for name in args.policies.split(","):
        for per_mb in (1, args.rows):
            if args.wait_idle and _common.wait_for_idle(LOAD_LIMIT) >= LOAD_LIMIT:
                print("this run counts as under load", flush=True)
            runs.append(_run(name, per_mb, args))
            r = runs[-1]
            print(f"{name} rows/mb {per_mb}: {r['times']} s, load {r['load_before']:.2f}", flush=True)
    body = _report(runs, args)
    print("\n" + body)
    if args.no_write:
        return
    if any(r["load_before"] >= LOAD_LIMIT for r in runs):
        print("NOT RECORDED: a run started at a 1-minute load >= 0.5 (use --wait-idle)")
        return
    write_section(args.out, SECTION, body)
    print(f"wrote {args.out}")


def _run(policy: str, per_mb: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--child", str(per_mb), "--policy", policy, "--rows", str(args.rows)]
    cmd += ["--seq-len", str(args.seq_len), "--response", str(args.response), "--repeats", str(args.repeats)]
    load_before = _common.load_avg()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        sys.exit(f"the {policy} run at {per_mb} rows per micro-batch failed (exit {proc.returncode})")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    load_after = _common.load_avg()
    return {"policy": policy, "per_mb": per_mb, **res, "load_before": load_before, "load_after": load_after}


def _child(rows: int, per_mb: int, seq_len: int, response: int, repeats: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from opsd import models
    from opsd.cpu.layout import frozen_weights

    rate_before = _common.matmul_rate(torch.float32)
    model = models.load_model("smollm2-135m-instruct")
    model = models.apply_lora(
        model, r=16, alpha=32, dropout=0.0, target_modules=LORA_TARGETS, gradient_checkpointing=False
    )
    frozen_weights(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq_len), generator=gen)
    mask = torch.ones_like(ids)

    def one_pass() -> None:
        for i in range(0, rows, per_mb):
            n = min(per_mb, rows - i)
            positions = torch.cat([torch.arange(seq_len - response, seq_len) + j * seq_len for j in range(n)])
            hidden = models.final_hidden(model, ids[i : i + n], mask[i : i + n], positions)
            hidden.square().mean().backward()

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    one_pass()  # warm-up
    with Count():
        one_pass()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        times.append(round(time.perf_counter() - t0, 2))
    return {
        "times": times,
        "operators": Count.n,
        "rate_before": rate_before,
        "rate_after": _common.matmul_rate(torch.float32),
        "env": {k: os.environ.get(k, "") for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
    }


def _report(runs: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Machine: {_common.describe_machine(threads=False)}.",
        "",
        f"{args.rows} student rows of {args.seq_len} tokens (the last {args.response} are response "
        "positions), SmolLM2-135M-Instruct in float32 with LoRA r=16 on q/k/v/o/gate/up/down, forward to "
        "the final hidden states and backward (the loss is the hidden states' mean square: the fused loss "
        f"is not timed here). One warm-up pass, then {args.repeats} timed passes over all rows; each row "
        "of the table is its own process. Operators: what one pass over all rows dispatches (counted in "
        "an untimed pass).",
        "",
        "| policy | rows per micro-batch | operators per pass | pass (s), each repeat | median (s) "
        "| load before → after | float32 product before → after (GFLOP/s) |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for r in runs:
        times = ", ".join(f"{t:.2f}" for t in r["times"])
        lines.append(
            f"| {r['policy']} | {r['per_mb']} | {r['operators']:,} | {times} "
            f"| {statistics.median(r['times']):.2f} | {r['load_before']:.2f} → {r['load_after']:.2f} "
            f"| {r['rate_before']:.0f} → {r['rate_after']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
