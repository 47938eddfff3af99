"""Clean exits: run `torchrun --nproc-per-node 2 -m opsd train` on the tiny model N times (CPU, gloo).

Not a timing benchmark: it counts runs that exit non-zero or print a traceback or a C++ abort
("terminate called ...") although training finished. A scheduler retries or pages on such a run.
Each run is 3 steps with two checkpoints, like the suite's torchrun test. Writes its section of
docs/results.md with the machine and the load before and after.

    python bench/torchrun_exits.py            # 20 runs, about 10 minutes on 2 cores
    python bench/torchrun_exits.py --runs 5 --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import _common
import yaml
from _md import write_section

from opsd.distributed import torchrun_command
from opsd.procs import run_owned

ROOT = _common.ROOT
BAD_MARKERS = ("Traceback", "terminate called", "SIGABRT", "Signal 6", "core dumped")


def write_assets(root: Path) -> Path:
    """The tiny student model, 8 addition problems and a 3-step config; returns the config path."""
    import json

    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    pairs = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2), (4, 5), (6, 1)]
    rows = [
        {"problem": f"What is {a} + {b}?", "solution": f"{a} + {b} = {a + b}.", "answer": str(a + b)}
        for a, b in pairs
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "device": "cpu",
        "model": {"path": str(root / "model"), "dtype": "float32", "lora": {"r": 4, "alpha": 8}},
        "data": {"path": str(root / "train.jsonl"), "max_prompt_len": 256},
        "rollout": {"prompts_per_step": 2, "n": 2, "max_new_tokens": 6, "temperature": 1.0},
        "loss": {"clip_mode": "none"},
        "optim": {"lr": 0.01, "max_steps": 3},
        "checkpoint": {"every": 2},
        "logging": {"run_dir": str(root / "run"), "progress": False, "sample_every": 0},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def one_run(config: Path, run_dir: Path) -> tuple[int, str]:
    """Exit status and combined output of one two-rank launch."""
    cmd = torchrun_command(2, "-m", "opsd", "train", "--config", str(config), "--overwrite")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # _common put ROOT on PYTHONPATH
    res = run_owned(cmd, capture=True, timeout_s=600, env=env)  # both ranks end with this script
    return res.status, (res.stdout or "") + (res.stderr or "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/results.md alone")
    args = ap.parse_args()
    load_before = _common.load_avg()
    bad: list[str] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        config = write_assets(Path(tmp))
        for i in range(1, args.runs + 1):
            rc, out = one_run(config, Path(tmp) / "run")
            marks = [m for m in BAD_MARKERS if m in out]
            finished = "run directory:" in out
            ok = rc == 0 and not marks and finished
            print(f"run {i}: exit {rc}, finished={finished}, markers={marks}", flush=True)
            if not ok:
                bad.append(f"run {i}: exit {rc}, markers {marks}: ...{out[-600:]!r}")
    wall = time.monotonic() - start
    load_after = _common.load_avg()
    good = args.runs - len(bad)
    body = (
        f"`python bench/torchrun_exits.py --runs {args.runs}`: two-rank `torchrun -m opsd train` (tiny "
        f"model, gloo, 3 steps, 2 checkpoints) **{good} of {args.runs} runs exited 0 with no traceback or "
        f"abort** ({wall:.0f} s in all: a count, not a timing).\n\n"
        f"Machine: {_common.describe_machine(threads=False)}. 1-minute load before {load_before:.2f}, after "
        f"{load_after:.2f} (a reliability count, not a timing: load does not invalidate it).\n"
    )
    if bad:
        body += "\nFailures:\n\n" + "\n".join(f"- {b}" for b in bad) + "\n"
    print(body)
    if not args.no_write:
        write_section(ROOT / "docs" / "results.md", "Clean exits of two-rank torchrun runs", body)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
