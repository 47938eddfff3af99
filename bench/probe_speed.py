"""`opsd probe` on arith at 100 problems, timed against its 5-minute target; writes docs/results.md.

The section holds the wall time, where it goes (the probe's ``phase_seconds``) and the probe's figures.

Each probe runs as the `opsd probe` command in a fresh process, so its wall time includes the
interpreter start, the imports, loading the model and starting the engine. It waits for an idle
machine first (a timed run starts alone). ``--whole`` also runs the probe as it was before the answer
cut and the controls' limit (``--no-cut --control-limit`` = ``--limit``), for the same figures side by
side. Needs ../shared/data/arith and the fetched SmolLM2-135M-Instruct; skips with one line without.

    python bench/probe_speed.py            # about 5 minutes on an idle 2-core CPU
    python bench/probe_speed.py --whole    # and the probe without the cut: about 10 minutes more
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _common
from _md import write_section

ROOT = _common.ROOT
HEADING = "## Probe wall time (bench/probe_speed.py)"
CONFIG = "examples/arith.yaml"
DATA = ROOT.parent / "shared" / "data" / "arith"
TARGET_S = 300.0
PHASES = ("setup", "student", "ceilings", "sampled", "token_stats", "reference_end")


def missing() -> str | None:
    """Why the probe cannot run here (its data or its model is not there), or None."""
    from opsd.fetch import cached_model_path

    if not (DATA / "test.jsonl").exists():
        return f"{DATA / 'test.jsonl'} not found (arith's held-out problems)"
    if cached_model_path("smollm2-135m-instruct") is None:
        return "SmolLM2-135M-Instruct is not fetched; run `opsd fetch-model smollm2-135m-instruct`"
    return None


def run_probe(name: str, out: Path, limit: int, control_limit: int, cut: bool) -> dict:
    """One `opsd probe` in a subprocess; its probe.json with the wall time, the load around it and the
    engine it ran on."""
    from opsd.procs import run_owned

    run = out / name
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    shown = [
        "opsd",
        "probe",
        "--config",
        CONFIG,
        "--limit",
        str(limit),
        "--control-limit",
        str(control_limit),
    ]
    shown += [] if cut else ["--no-cut"]
    cmd = [sys.executable, "-m", "opsd.cli", *shown[1:], "--out", str(run)]
    load_before = _common.load_avg()
    t0 = time.time()
    log = run / "probe.log"
    with log.open("w") as f:  # a child that ends with this script (opsd.procs)
        status = run_owned(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).status
    wall = time.time() - t0
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {status}; see {log}")
    p = json.loads((run / "probe.json").read_text())
    engine = re.search(r"^rollout engine: (.+)$", log.read_text(), re.M)
    p.update(
        name=name,
        command=" ".join(shown),
        wall_s=wall,
        load_before=load_before,
        load_after=_common.load_avg(),
        engine=engine[1] if engine else "not recorded",
    )
    print(f"{name}: {wall:.0f} s, verdict {p['verdict']} ({', '.join(_phases(p))})", flush=True)
    return p


def _phases(p: dict) -> list[str]:
    return [f"{k} {p['phase_seconds'].get(k, 0):.0f} s" for k in PHASES]


def _pct(a: dict | None) -> str:
    """An accuracy with its interval and problem count, "-" where the set was not measured."""
    if a is None:
        return "-"
    lo, hi = a.get("interval") or (a["accuracy"], a["accuracy"])
    return f"{a['accuracy']:.1%} [{lo:.1%}, {hi:.1%}] of {a.get('problems', '?')}"


def _minutes(s: float) -> str:
    return f"{int(s // 60)} min {s % 60:.0f} s"


def render(runs: list[dict], started: str) -> str:
    """The section: how it was run, then one row per probe."""
    lines = [
        f"Run {started}. Machine: {_common.describe_machine(threads=False)}; the probe runs in a child "
        "process. Command: `python bench/probe_speed.py`, which runs, alone on the machine:",
        "",
        *[f"- `{r['command']}` (engine: {r['engine']})" for r in runs],
        "",
        "Wall time is the whole command (interpreter, imports, model and engine start included); "
        "`phase_seconds` splits it. The greedy answers stop at their first complete `answer_is` answer "
        "where the answer cut is on (the probe's docstring says what that keeps).",
        "",
        "| probe | wall (target <= 5 min) | setup / student / ceilings / sampled / token stats / reference "
        "end | load before -> after | student greedy | ceiling | control B | wrong answer | headroom "
        "[95%] | stopped after their answer: student / ceiling | sampled graded otherwise by a cut | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        gain, lo, hi = r["headroom"]
        met = "met" if r["wall_s"] <= TARGET_S else "missed"
        phases = " / ".join(f"{r['phase_seconds'].get(k, 0):.0f}" for k in PHASES)
        cut = r.get("cut") or {}
        sampled = cut.get("sampled")
        changed = f"{sampled['changed']} of {sampled['stopped']}" if sampled else "-"
        lines.append(
            f"| {r['name']} | {_minutes(r['wall_s'])} ({met}) | {phases} s | {r['load_before']:.2f} -> "
            f"{r['load_after']:.2f} | {_pct(r['student'])} | {_pct(r['ceiling'])} | "
            f"{_pct(r['ceiling_other'])} | {_pct(r['ceiling_wrong_answer'])} | {100 * gain:+.1f} "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}] | {r['student'].get('cut', 0):.0%} / "
            f"{r['ceiling'].get('cut', 0):.0%} | {changed} | {r['verdict']} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=100, help="problems probed (the probe's --limit)")
    ap.add_argument(
        "--control-limit", type=int, default=None, help="the probe's --control-limit (default: its own)"
    )
    ap.add_argument("--whole", action="store_true", help="also time the probe without the cut and limit")
    ap.add_argument("--max-load", type=float, default=0.5, help="wait for a 1-minute load below this")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-probe", help="the probes' outputs")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()

    why = missing()
    if why:
        print(f"SKIP: {why}")
        return 0
    from opsd.probe import CONTROL_LIMIT

    control_limit = args.control_limit or CONTROL_LIMIT
    started = time.strftime("%Y-%m-%d %H:%M")
    _common.wait_for_idle(args.max_load, timeout_s=3600, poll_s=10)
    runs = [run_probe("cut", args.out, args.limit, control_limit, cut=True)]
    if args.whole:
        _common.wait_for_idle(args.max_load, timeout_s=3600, poll_s=10)
        runs.append(run_probe("whole", args.out, args.limit, args.limit, cut=False))
    body = render(runs, started)
    if args.no_write:
        print(body)
    else:
        write_section(args.md, HEADING, body)
        print(f"wrote {HEADING} in {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
