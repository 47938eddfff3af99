"""HF rollout engine throughput vs a plain per-sample `model.generate` loop (SmolLM2-135M, CPU).

Every sample is forced to exactly --new-tokens tokens (min_new_tokens), so tokens/s compares equal
work. Results go to the "Rollout (bench/rollout.py)" section of docs/results.md.

    python bench/rollout.py                 # batch sizes 1, 8, 32; 128 new tokens
    python bench/rollout.py --quick         # smoke run: tiny settings, prints only
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import _common
import torch
from _md import write_section

from opsd.fetch import fetch_model
from opsd.models import load_model, load_tokenizer
from opsd.rollout import HFEngine, SamplingParams

REPO = _common.ROOT
DATA = REPO.parent / "shared" / "data" / "math_train.jsonl"
HEADING = "Rollout (bench/rollout.py)"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def load_prompts(tok, k: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """k chat-formatted math problems (real MATH problems when ../shared/data is present)."""
    rng = random.Random(seed)
    if DATA.is_file():
        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
        problems = [r["problem"] for r in rng.sample(rows, k)]
        source = f"{k} random problems from ../shared/data/math_train.jsonl"
    else:
        problems = [f"What is {rng.randint(10, 999)} * {rng.randint(10, 999)}?" for _ in range(k)]
        source = f"{k} synthetic arithmetic problems (../shared/data absent)"
    prompts = []
    for p in problems:
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"{p}\n{INSTRUCTION}"}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    return prompts, source


@dataclass
class Timing:
    tokens: int
    wall_s: float
    cpu_s: float  # process CPU time, all threads: robust to other jobs taking CPU share

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tpcs(self) -> float:
        return self.tokens / self.cpu_s


def engine_tps(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> Timing:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, seed=0)
    t0, c0 = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, 1, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    produced = sum(len(c.token_ids) for c in out)
    assert produced == len(prompts) * new_tokens, (produced, len(prompts), new_tokens)
    return Timing(produced, dt, cpu)


@torch.inference_mode()
def loop_tps(model, tok, prompts: list[list[int]], new_tokens: int) -> Timing:
    """The baseline: one `generate` call per sample, no batching."""
    produced, t0, c0 = 0, time.perf_counter(), time.process_time()
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id,
        )
        produced += out.shape[1] - ids.shape[1]
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert produced == len(prompts) * new_tokens
    return Timing(produced, dt, cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--loop-samples", type=int, default=8, help="per-sample loop is timed on this many (max)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; does not write docs")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch_sizes, args.new_tokens, args.loop_samples = [1, 4], 8, 2
    if args.model == "smollm2-135m-instruct":
        fetch_model(args.model)
    tok, model = load_tokenizer(args.model), load_model(args.model).eval()
    prompts, source = load_prompts(tok, max(args.batch_sizes))
    info = f"{_common.describe_machine()}; load average at start: {_common.load_avgs()}"
    print(info, flush=True)

    engine_tps(HFEngine(model, tok, batch_size=2), prompts[:2], 4)  # warm-up (allocator, kernels)
    rows = []
    for bs in args.batch_sizes:
        eng = engine_tps(HFEngine(model, tok, batch_size=bs), prompts[:bs], args.new_tokens)
        # Baseline timed right after, on the same prompts: on a shared machine the load drifts, so
        # each row compares two measurements taken minutes apart at most.
        k = min(bs, args.loop_samples)
        base = loop_tps(model, tok, prompts[:k], args.new_tokens)
        rows.append((bs, eng, base, k))
        print(
            f"batch {bs}: engine {eng.tps:.1f} tok/s ({eng.wall_s:.1f}s, {eng.tpcs:.1f} tok/CPU-s); "
            f"per-sample loop {base.tps:.1f} tok/s ({k} samples, {base.wall_s:.1f}s, {base.tpcs:.1f} "
            f"tok/CPU-s); {eng.tps / base.tps:.1f}x wall, {eng.tpcs / base.tpcs:.1f}x CPU",
            flush=True,
        )

    lens = [len(p) for p in prompts]
    table = [
        "| batch size | HF engine tok/s | engine wall s | per-sample loop tok/s | loop samples timed "
        "| speed-up (wall) | speed-up (CPU time) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for bs, eng, base, k in rows:
        table.append(
            f"| {bs} | {eng.tps:.1f} | {eng.wall_s:.1f} | {base.tps:.1f} | {k} "
            f"| {eng.tps / base.tps:.1f}x | {eng.tpcs / base.tpcs:.1f}x |"
        )
    target = next((eng.tps / base.tps for bs, eng, base, _ in rows if bs == 32), None)
    verdict = (
        f"Target (>= 4x the per-sample loop at batch 32, wall clock): {'met' if target >= 4 else 'NOT met'} "
        f"({target:.1f}x)."
        if target is not None
        else ""
    )
    body = "\n".join(
        [
            f"Model: {args.model} (fp32, sdpa attention), sampling at temperature 1, exactly "
            f"{args.new_tokens} new tokens per sample (`min_new_tokens`), prompts: {source} through the chat "
            f"template (prompt length {min(lens)}-{max(lens)} tokens, left padded within a batch).",
            "",
            f"Machine: {info}.",
            "",
            *table,
            "",
            "Baseline: a plain `model.generate` call per prompt (batch 1, same sampling settings), timed "
            f"right after each engine row on the first min(batch size, {args.loop_samples}) of that row's "
            "prompts; its tokens/s does not depend on the batch size, so a subset extrapolates. The "
            "CPU-time speed-up divides tokens per second of process CPU time (all threads); unlike wall "
            "clock it barely moves when other jobs share the cores.",
            verdict,
            "",
            "Reproduce: `python bench/rollout.py` (after `opsd fetch-model smollm2-135m-instruct`).",
        ]
    )
    print("\n" + "\n".join(table))
    if not args.quick:
        write_section(args.out, HEADING, body)
        print(f"\nwrote section '{HEADING}' to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
