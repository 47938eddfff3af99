"""Peak RSS per phase of bench/train_step.py's run (2 steps): where a CPU training step's memory goes.

A thread samples the process's resident set every 20 ms and keeps the maximum per phase (model
build, rollouts, teacher scoring, the micro-batch loop) and per step; the phases are marked by
wrapping the trainer's own methods. Memory does not depend on the machine's load, so this can run
beside other work; its wall times are not results.

    python bench/step_memory.py                                   # the defaults
    python bench/step_memory.py --steps 4                         # bench/train_step.py's length
    python bench/step_memory.py optim.max_tokens_per_microbatch=728   # another setting
    MALLOC_MMAP_THRESHOLD_=131072 python bench/step_memory.py     # glibc settings come from the env
"""

from __future__ import annotations

import argparse
import functools
import resource
import threading
import time
from pathlib import Path

import _common
import psutil
from train_step import MATH, bench_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=MATH)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()

    import opsd.rollout.queue
    import opsd.setup
    import opsd.teacher
    import opsd.trainer

    phase = ["import"]
    step = [0]
    peak: dict[str, int] = {}
    per_step: dict[int, int] = {}
    proc = psutil.Process()

    def sample() -> None:
        while True:
            rss = proc.memory_info().rss
            peak[phase[-1]] = max(peak.get(phase[-1], 0), rss)
            if step[0]:
                per_step[step[0]] = max(per_step.get(step[0], 0), rss)
            time.sleep(0.02)

    def marked(owner, name: str, label: str) -> None:
        """Count ``owner.name`` (a method or a module's function) as the phase ``label`` while it runs."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            phase.append(label)
            try:
                return fn(*a, **kw)
            finally:
                phase.pop()

        setattr(owner, name, wrapper)

    marked(opsd.rollout.queue.RolloutQueue, "next", "rollouts")
    marked(opsd.setup, "forward_backward", "forward_backward")  # the micro-batch loop setup builds
    train_step = opsd.trainer.Trainer.step

    def counted_step(self):
        step[0] += 1
        return train_step(self)

    opsd.trainer.Trainer.step = counted_step
    marked(opsd.teacher.Teacher, "score", "score")
    threading.Thread(target=sample, daemon=True).start()
    cfg = bench_config(args.data, [f"optim.max_steps={args.steps}", *args.overrides])
    phase.append("build")
    trainer = opsd.trainer.Trainer(cfg)
    phase[-1] = "other (train loop)"
    trainer.train()
    time.sleep(0.1)
    print(f"Machine: {_common.describe_machine()}. Settings: {' '.join(args.overrides) or 'defaults'}.")
    for name, rss in peak.items():
        print(f"  peak RSS in {name:20s} {rss / 2**30:.2f} GiB")
    for k, rss in per_step.items():
        print(f"  peak RSS in step {k:<15d} {rss / 2**30:.2f} GiB")
    whole = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"  ru_maxrss (whole process)       {whole:.2f} GiB")


if __name__ == "__main__":
    main()
