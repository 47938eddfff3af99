"""Soak test: 1,000 OPSD steps of a demo-sized model, resident memory every 50 steps, one resume.

Not a unit test. Checks that resident memory after step 100 grows by less than 5% and that
``metrics.jsonl`` holds exactly one line per step although the run is stopped and resumed half way
(the trainer drops lines an interrupted run wrote after its last checkpoint). Writes its section
of docs/results.md.

    python bench/soak.py             # about 10-20 minutes on an idle 2-core CPU
    python bench/soak.py --steps 200 # a shorter check
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import _common
from _md import write_section

ROOT = _common.ROOT


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    load_before = _common.load_avg()
    print(f"load before: {load_before:.2f}", flush=True)

    from opsd import Trainer, load_config
    from opsd.demo.task import TEACHER_TEMPLATE, make_rows
    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="opsd-soak-"))
    rows = make_rows(256, seed=0, digits=3)
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=64, seed=0).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    half = args.steps // 2

    def cfg(max_steps: int):
        return load_config(
            None,
            [
                f"model.path={tmp / 'model'}",
                f"data.path={tmp / 'rows.jsonl'}",
                f"logging.run_dir={tmp / 'run'}",
                "data.instruction=",
                f"data.teacher_template={json.dumps(TEACHER_TEMPLATE)}",
                "model.lora.enabled=false",
                "teacher.frozen_copy=device",
                "rollout.prompts_per_step=8",
                "rollout.max_new_tokens=24",
                "rollout.temperature=1.0",
                "optim.lr=1e-4",
                f"optim.max_steps={max_steps}",
                "checkpoint.every=100",
                "logging.progress=false",
                "logging.sample_every=0",
                "device=cpu",
            ],
        )

    samples: list[tuple[int, float]] = []
    t0 = time.time()
    for resume in (False, True):
        tr = Trainer(cfg(args.steps), resume=resume)
        until = half if not resume else args.steps
        while tr.step_num < until:
            tr.train(until_step=min(until, tr.step_num + args.every))
            samples.append((tr.step_num, rss_mib()))
            print(f"step {tr.step_num:>5}  rss {samples[-1][1]:.0f} MiB  {time.time() - t0:.0f}s", flush=True)
        if not resume:  # 7 more steps whose metrics are written but never checkpointed: then a "crash"
            for _ in range(7):
                tr.metrics.write(tr.record(tr.step()))
        del tr
    steps = [json.loads(x)["step"] for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    one_line_per_step = steps == list(range(1, args.steps + 1))
    after100 = [r for s, r in samples if s >= 100]
    growth = (after100[-1] / after100[0] - 1) * 100 if len(after100) > 1 else float("nan")
    load_after = _common.load_avg()
    print(f"load after: {load_after:.2f}")
    print(f"RSS growth after step 100: {growth:+.1f}%  one line per step: {one_line_per_step}")
    table = "\n".join(f"| {s} | {r:.0f} |" for s, r in samples)
    body = (
        f"`python bench/soak.py --steps {args.steps}`: a demo-sized model (full fine-tuning, frozen teacher "
        "copy), 8 prompts x 24 new tokens per step; the first half writes metrics for 7 steps past its last "
        "checkpoint, then stops without saving (a crash), and the second half resumes.\n\n"
        f"Machine: {_common.describe_machine()}; load before/after (wall time is only a speed figure at load "
        f"< 0.5) {load_before:.2f}/{load_after:.2f}; wall {time.time() - t0:.0f} s.\n\n"
        f"- resident memory growth from step 100 to the end: **{growth:+.1f}%** (target < 5%)\n"
        f"- `metrics.jsonl` has exactly one line per step across the resume: **{one_line_per_step}**\n\n"
        "| step | RSS (MiB) |\n|---|---|\n" + table + "\n"
    )
    if not args.no_write:
        write_section(args.out, "Soak: 1,000 steps with a resume", body)


if __name__ == "__main__":
    main()
