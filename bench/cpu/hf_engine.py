"""The HF rollout engine as training runs it: tokens/s at batch 8 and 32, and where a decode step goes.

SmolLM2-135M-Instruct with LoRA r=16 alpha=32 on q/k/v/o/gate/up/down, loaded the way the trainer
loads it (base weights frozen, and on a CPU laid out by the CPU plan's frozen layout where the opsd
being measured has it), MATH train prompts 8 onwards through the chat template, exactly
``--new-tokens`` new tokens per sample (``min_new_tokens``) at T=1.1, one ``generate`` call per batch
after a warm-up call. Two profiled generates at batch 8 (48 and 16 tokens) give the top
operators of one decode step.

``--before REV`` first measures the opsd of git revision REV (a temporary worktree) the same way,
in its own process, so the section holds before and after from one run. Each measurement runs in
a fresh process, after waiting for the 1-minute load average to drop below 0.5.

    python bench/cpu/hf_engine.py --before 4de4aab          # writes docs/results.md
    python bench/cpu/hf_engine.py --smoke                   # 2 prompts, 8 tokens; writes nothing
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/: the shared bench modules

import _common  # noqa: E402
from _md import write_section  # noqa: E402

ROOT = _common.ROOT
MATH = ROOT.parent / "shared" / "data" / "math_train.jsonl"
SECTION = "HF engine (bench/cpu/hf_engine.py)"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEMPERATURE = 1.1
LOAD_LIMIT = 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="git revision whose engine is measured first, for comparison")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="2 prompts, 8 tokens; writes nothing")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child.read_text())
        args.child.with_suffix(".result.json").write_text(json.dumps(_measure(**job)))
        return
    if args.smoke:
        args.batch_sizes, args.new_tokens, args.no_write = [2], 8, True
    if not MATH.is_file():
        sys.exit(f"{MATH} not found (the public MATH train split, see ../shared/data/README.md)")
    from opsd.fetch import cached_model_path

    model = cached_model_path("smollm2-135m-instruct")
    if model is None:
        sys.exit("SmolLM2 is not fetched: run `opsd fetch-model smollm2-135m-instruct` first")
    tmp = Path(tempfile.mkdtemp(prefix="opsd-hf-engine-"))
    roots = {}
    if args.before:
        roots[f"before ({args.before})"] = _worktree(args.before, tmp / "before")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "opsd"], cwd=ROOT, capture_output=True, text=True)
    roots[f"after ({head.stdout.strip()}{' + changes' if dirty.stdout.strip() else ''})"] = ROOT
    try:
        runs = _measure_all(roots, model, args)
    finally:
        if args.before:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=ROOT)
    body = _report(runs, args)
    print("\n" + body)
    if not args.no_write:
        write_section(args.out, SECTION, body)
        print(f"wrote {args.out}")


def _measure_all(roots: dict[str, Path], model: Path, args: argparse.Namespace) -> list[dict]:
    """One fresh process per (checkout, dtype), each after the load drops below LOAD_LIMIT."""
    tmp = Path(tempfile.mkdtemp(prefix="opsd-hf-engine-jobs-"))
    runs = []
    for label, root in roots.items():
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            _common.wait_for_idle(LOAD_LIMIT, 1800)
            job = {
                "model": str(model),
                "dtype": dtype,
                "batch_sizes": args.batch_sizes,
                "new_tokens": args.new_tokens,
                "profile": not args.smoke,
            }
            runs.append({"label": label, **job, **_run_child(job, root, tmp / f"{len(runs)}.json")})
            print(json.dumps({k: runs[-1][k] for k in ("label", "dtype", "tok_s")}), flush=True)
    return runs


def _worktree(rev: str, where: Path) -> Path:
    cmd = ["git", "worktree", "add", "--detach", str(where), rev]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True)
    if out.returncode != 0:
        sys.exit(f"--before {rev}: git worktree add failed: {out.stderr.decode().strip()}")
    return where


def _run_child(job: dict, root: Path, job_file: Path) -> dict:
    """One opsd checkout's engine in a fresh process (its own allocator, its own imports)."""
    job_file.write_text(json.dumps({**job, "root": str(root)}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    before = _common.load_avg()
    cmd = [sys.executable, __file__, "--child", str(job_file)]
    proc = subprocess.run(cmd, env=env, cwd=root)
    if proc.returncode != 0:
        sys.exit(f"the measurement with opsd from {root} failed (exit {proc.returncode})")
    result = json.loads(job_file.with_suffix(".result.json").read_text())
    return {**result, "load_before": before, "load_after": _common.load_avg()}


def _measure(
    root: str, model: str, dtype: str, batch_sizes: list[int], new_tokens: int, profile: bool
) -> dict:
    """Runs in the child: the engine of the opsd checkout at ``root``."""
    sys.path.insert(0, root)
    for name in [m for m in sys.modules if m == "opsd" or m.startswith("opsd.")]:
        del sys.modules[name]  # _common imported this checkout's opsd; measure root's
    import torch

    import opsd
    from opsd import models
    from opsd.data.prompts import student_prompt_ids
    from opsd.rollout import HFEngine, SamplingParams

    torch.manual_seed(0)
    tok = models.load_tokenizer(model)
    net = models.load_model(model, dtype=getattr(torch, dtype), attn_implementation="sdpa", device="cpu")
    lora = dict(r=16, alpha=32, dropout=0.0, target_modules=LORA_TARGETS, gradient_checkpointing=False)
    net = models.apply_lora(net, **lora)
    # The revision being measured: the CPU plan's layout (opsd.cpu.layout), or models' older home.
    layout = (
        getattr(importlib.import_module("opsd.cpu.layout"), "frozen_weights", None)
        if importlib.util.find_spec("opsd.cpu")
        else getattr(models, "frozen_weights_for_cpu", None)
    )
    moved = layout(net) if layout else 0
    rows = [json.loads(x) for x in MATH.read_text().splitlines()[8 : 8 + max(batch_sizes)]]
    prompts = [student_prompt_ids(tok, r["problem"], max_len=1024)[0] for r in rows]
    engine = HFEngine(net, tok, batch_size=max(batch_sizes))

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=TEMPERATURE, max_new_tokens=n, min_new_tokens=n, seed=0)

    engine.generate(prompts[:2], 1, params(4))  # warm-up: allocator, kernels
    tok_s = {}
    for b in batch_sizes:
        t0 = time.perf_counter()
        out = engine.generate(prompts[:b], 1, params(new_tokens))
        dt = time.perf_counter() - t0
        tok_s[b] = sum(len(c.token_ids) for c in out) / dt
        print(f"  batch {b}: {tok_s[b]:.1f} tok/s ({dt:.1f} s)", flush=True)
    top = _decode_profile(engine, prompts[:8], params) if profile else []
    return {
        "tok_s": tok_s,
        "top": top,
        "relaid_weights": moved,
        "prompt_lens": [len(p) for p in prompts],
        "opsd_file": opsd.__file__,  # which checkout was measured
        "machine": _common.describe_machine(),
    }


def _decode_profile(engine, prompts: list[list[int]], params) -> list[tuple[str, float, float]]:
    """Per decode step at batch 8: milliseconds and calls of the top operators, as the difference of
    a profiled 48-token and 16-token generate divided by 32 (the prefill and setup cancel out)."""
    from torch.profiler import profile as torch_profile

    runs = []
    for n in (16, 48):
        with torch_profile() as prof:
            engine.generate(prompts, 1, params(n))
        runs.append({e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()})
    short, long = runs
    per_step = {
        k: ((t - short.get(k, (0, 0))[0]) / 32 / 1000, (c - short.get(k, (0, 0))[1]) / 32)
        for k, (t, c) in long.items()
    }
    total = sum(ms for ms, _ in per_step.values())
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:10]
    calls = sum(c for _, c in per_step.values())
    return [("all operators", total, calls), *((k, ms, c) for k, (ms, c) in top)]


def _report(runs: list[dict], args: argparse.Namespace) -> str:
    lens = runs[0]["prompt_lens"]
    lines = [
        f"Machine: {runs[0]['machine']}.",
        "",
        "SmolLM2-135M-Instruct with LoRA r=16 on all projections (the trainer's model), MATH train prompts "
        f"8 onwards (prompt length {min(lens)}-{max(lens)} tokens, left padded), exactly {args.new_tokens} "
        f"new tokens per sample at T={TEMPERATURE}, one `generate` per batch after a warm-up; each row a "
        "fresh process started at a 1-minute load below 0.5.",
        "",
        "| engine | dtype | load before → after | "
        + " | ".join(f"batch {b} tok/s" for b in args.batch_sizes)
        + " |",
        "|---|---|---|" + "---:|" * len(args.batch_sizes),
    ]
    for r in runs:
        cells = " | ".join(f"{r['tok_s'][str(b)]:.1f}" for b in args.batch_sizes)
        load = f"{r['load_before']:.2f} → {r['load_after']:.2f}"
        lines.append(f"| {r['label']} | {r['dtype']} | {load} | {cells} |")
    if len(runs) > 1:
        for dtype in dict.fromkeys(r["dtype"] for r in runs):
            pair = [r for r in runs if r["dtype"] == dtype]
            if len(pair) == 2:
                before, after = pair[0]["tok_s"], pair[1]["tok_s"]
                sizes = args.batch_sizes
                ratios = ", ".join(f"batch {b} {after[str(b)] / before[str(b)]:.2f}×" for b in sizes)
                lines += ["", f"- {dtype}: after ÷ before: {ratios} (target: 2× at batch 8)."]
    for r in runs:
        if r["top"]:
            lines += [
                "",
                f"One decode step at batch 8, {r['label']}, {r['dtype']} (profiled 48-token minus 16-token "
                "generate, divided by 32; self CPU time, the profiler's own overhead included):",
                "",
                "| operator | ms per step | calls per step |",
                "|---|---:|---:|",
                *(f"| `{k}` | {ms:.1f} | {calls:.0f} |" for k, ms, calls in r["top"]),
            ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
