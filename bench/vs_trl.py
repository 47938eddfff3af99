"""opsd against TRL's SDFTTrainer on the same work, in fp32 and in bf16, one after the other.

The work (`bench/train_step.py`'s): SmolLM2-135M-Instruct, LoRA r=16 alpha=32 on
q/k/v/o/gate/up/down, 8 MATH train prompts per step in file order (rows 0-7 warm up, rows 8-31 are
the three measured steps), 1 response each of at most 128 new tokens at T=1.1, the reference solution
as privileged information, forward KL over the full vocabulary, the teacher is the base model (the
LoRA adapter disabled). The settings are bench/train_step.py's: T=1.1 for sampling and the
loss, opsd's per-entry clip 0.05 and per-token reduction (TRL's loss has no such clip). opsd uses its
default engine (``rollout.engine: auto``: vLLM where installed, else HF), TRL its default generation
(HF ``generate``); the report names both. Both sides see the same prompt token ids: opsd's teacher
template is set to the text TRL's default `teacher_prompt_template` produces, and the TRL process
checks the ids against opsd's prompt builder before training.

Each run is its own process, so its peak RSS (ru_maxrss, model load included) is its own; the
parent imports no torch. Per run it reports the per-phase times (rollout / teacher / student
fwd+bwd / loss / optimizer), ms per completion token outside generation, the whole step, rollout
tokens/s, peak RSS, and the 1-minute load average before and after. A benchmark runs alone: a run
that starts at load >= 0.5 is marked "under load" and the results are not written to
docs/results.md (`--wait-idle` waits for the load to drop before every run).

    pip install -e '.[bench]'                      # trl
    opsd fetch-model smollm2-135m-instruct
    python bench/vs_trl.py --wait-idle             # fp32 (and bf16 on bf16 units), writes docs/results.md
    python bench/vs_trl.py --smoke                 # 2 rows, 8 new tokens, 1 measured step; writes nothing
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import _common  # before anything imports torch (the children do): OMP_WAIT_POLICY
from _md import write_section
from _vs_trl_children import ENTRY_CLIP, GRAD_CLIP, LR, PHASES, TEMPERATURE, Work

ROOT = _common.ROOT
MATH = ROOT.parent / "shared" / "data" / "math_train.jsonl"
SECTION = "opsd vs TRL SDFT (bench/vs_trl.py)"  # one section: the latest run, its engine named inside
SIDES = ("opsd", "trl")
LOAD_LIMIT = 0.5  # 1-minute load average at or above which a timed run is "under load"


# --------------------------------------------------------------------------------------------------
# The parent: one child per run, load checks, the report; the children: bench/_vs_trl_children.py


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=MATH)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check the script end to end: 2 rows, 8 new tokens, 1 measured step; writes nothing",
    )
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated; default float32, plus bfloat16 on a CPU with bf16 units (emulated bf16 "
        "is ~25x slower and says nothing about either trainer)",
    )
    ap.add_argument("--opsd-engine", default="auto", choices=("auto", "hf", "vllm"))
    ap.add_argument(
        "--opsd-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an opsd config override on top of the shared settings, e.g. model.compile=true (repeatable)",
    )
    ap.add_argument("--sides", default="opsd,trl", help="which trainers to run (comma-separated)")
    ap.add_argument("--repeats", type=int, default=1, help="run each (side, dtype) this many times")
    ap.add_argument("--rows-per-step", type=int, default=8)
    ap.add_argument("--measured-steps", type=int, default=3, help="after one warm-up step")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--trl-bf16",
        choices=("weights", "autocast"),
        default="weights",
        help="TRL's bf16 run: model weights in bf16 like opsd's model.dtype=bfloat16 (default), "
        "or fp32 weights under TrainingArguments(bf16=True) autocast",
    )
    ap.add_argument(
        "--wait-idle",
        action="store_true",
        help=f"before every run, wait until the 1-minute load average is below {LOAD_LIMIT}",
    )
    ap.add_argument(
        "--idle-timeout", type=float, default=3600.0, help="give up waiting after this many seconds"
    )
    ap.add_argument(
        "--record-under-load",
        action="store_true",
        help="write docs/results.md even if a run started under load (such runs are marked)",
    )
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args()


def _child(args: argparse.Namespace) -> None:
    """A child's whole run: its trainer on the work in ``args.work``, its result into ``args.result``."""
    import torch
    from _vs_trl_children import run_opsd, run_trl

    work = Work(**json.loads(args.work.read_text()))
    # The float32 product rate before and after: a rate that moved means the VM's share of its host
    # moved during the run, which the load average inside the VM does not show.
    rate_before = _common.matmul_rate(torch.float32)
    steps, info = (run_opsd if args.child == "opsd" else run_trl)(work)
    rates = {"rate_before": rate_before, "rate_after": _common.matmul_rate(torch.float32)}
    args.result.write_text(json.dumps({"steps": steps, **info, **rates}))


def _dtypes(args: argparse.Namespace) -> list[str]:
    """The dtypes to run: ``--dtypes``, else float32 and, on a CPU with bf16 units, bfloat16."""
    if args.dtypes is None:
        from opsd.devices import cpu_isa  # light: no torch

        args.dtypes = "float32" if "no bf16" in cpu_isa() else "float32,bfloat16"
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16")]:
        sys.exit(f"--dtypes: {bad} not among float32, bfloat16")
    return dtypes


def _rows_file(args: argparse.Namespace, n_rows: int, tmp: Path) -> Path:
    """The first ``n_rows`` MATH train rows, written where the children read them."""
    rows = [json.loads(x) for x in args.data.read_text().splitlines()[:n_rows]]
    if len(rows) < n_rows:
        sys.exit(f"{args.data} has {len(rows)} rows, the run needs {n_rows}")
    rows_file = tmp / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows_file


def _all_runs(args: argparse.Namespace, dtypes: list[str], model: str, rows_file: Path) -> list[dict]:
    """Every side at every dtype, ``--repeats`` times, one child each (after waiting for an idle
    machine with ``--wait-idle``)."""
    tmp = rows_file.parent
    runs = []
    for rep in range(args.repeats):
        for dtype in dtypes:
            for side in [x for x in SIDES if x in args.sides.split(",")]:
                work = Work(
                    side=side,
                    dtype=dtype,
                    model=model,
                    rows_file=str(rows_file),
                    rows_per_step=args.rows_per_step,
                    measured_steps=args.measured_steps,
                    max_new_tokens=args.max_new_tokens,
                    run_dir=str(tmp / f"{side}-{dtype}-{rep}"),
                    trl_bf16=args.trl_bf16,
                    opsd_engine=args.opsd_engine,
                    opsd_set=args.opsd_set,
                )
                if args.wait_idle:
                    if _common.wait_for_idle(LOAD_LIMIT, args.idle_timeout) >= LOAD_LIMIT:
                        print("this run counts as under load", flush=True)
                runs.append(_run_child(work, tmp))
                print(_run_line(runs[-1]), flush=True)
    return runs


def main() -> None:
    args = _parse_args()
    if args.child:
        _child(args)
        return

    if args.smoke:
        args.rows_per_step, args.measured_steps, args.max_new_tokens, args.no_write = 1, 1, 8, True
    dtypes = _dtypes(args)
    model = _model_path()
    if not args.data.is_file():
        sys.exit(f"{args.data} not found (the public MATH train split, see ../shared/data/README.md)")
    if importlib.util.find_spec("trl") is None:  # find, not import: trl would import torch here
        sys.exit("trl is not installed: pip install -e '.[bench]'")

    n_rows = args.rows_per_step * (1 + args.measured_steps)
    rows_file = _rows_file(args, n_rows, Path(tempfile.mkdtemp(prefix="opsd-vs-trl-")))
    runs = _all_runs(args, dtypes, model, rows_file)

    body = _report(runs, args, n_rows)
    print("\n" + body)
    under_load = [r for r in runs if r["under_load"]]
    if args.no_write:
        return
    if under_load and not args.record_under_load:
        print(
            f"\nNOT RECORDED: {len(under_load)} of {len(runs)} runs started at a 1-minute load average "
            f">= {LOAD_LIMIT}. Rerun on an idle machine with --wait-idle (or --record-under-load)."
        )
        return
    write_section(args.out, SECTION, body)
    print(f"wrote {args.out}")


def _model_path() -> str:
    from opsd.fetch import cached_model_path  # light: no torch

    model = cached_model_path("smollm2-135m-instruct")
    if model is None:
        sys.exit("SmolLM2 is not fetched: run `opsd fetch-model smollm2-135m-instruct` first")
    return str(model)


def _run_child(work: Work, tmp: Path) -> dict:
    """One side at one dtype in a fresh process; its ru_maxrss is this run's peak RSS."""
    stem = tmp / f"{work.side}-{work.dtype}-{len(list(tmp.glob('*.work.json')))}"
    work_file, result_file = stem.with_suffix(".work.json"), stem.with_suffix(".result.json")
    work_file.write_text(json.dumps(asdict(work)))
    env = {
        **os.environ,
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    load_before = _common.load_avg()
    print(f"--- {work.side} {work.dtype}: load before {load_before:.2f}", flush=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            work.side,
            "--work",
            str(work_file),
            "--result",
            str(result_file),
        ],
        env=env,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    if proc.returncode != 0:
        sys.exit(f"the {work.side} {work.dtype} run failed (exit {proc.returncode}); its output is above")
    load_after = _common.load_avg()
    res = json.loads(result_file.read_text())
    return {
        "side": work.side,
        "dtype": work.dtype,
        **res,
        "peak_rss_gib": usage.ru_maxrss / 2**20,
        "load_before": load_before,
        "load_after": load_after,
        "under_load": load_before >= LOAD_LIMIT,
    }


def _summary(run: dict) -> dict:
    """Medians over the measured steps, and rollout tokens/s over all of them."""
    steps = run["steps"]
    med = {p: statistics.median(s[f"time_{p}"] for s in steps) for p in (*PHASES, "step")}
    ms_tok = statistics.median(
        1000 * (s["time_step"] - s["time_rollout"]) / max(1, s["tokens"]) for s in steps
    )
    gen_tok_s = sum(s["tokens"] for s in steps) / max(1e-9, sum(s["time_rollout"] for s in steps))
    return {
        "phases": med,
        "ms_per_token": ms_tok,
        "step_s": med["step"],
        "rollout_tok_s": gen_tok_s,
        "tokens": sum(s["tokens"] for s in steps),
    }


def _run_line(run: dict) -> str:
    s = _summary(run)
    return (
        f"--- {run['side']} {run['dtype']}: {s['ms_per_token']:.2f} ms/token outside generation, step "
        f"{s['step_s']:.2f} s, rollout {s['rollout_tok_s']:.1f} tok/s, peak RSS {run['peak_rss_gib']:.2f} "
        f"GiB, load {run['load_before']:.2f} -> {run['load_after']:.2f}, float32 product "
        f"{_rates(run)} GFLOP/s"
    )


def _rates(run: dict) -> str:
    """The child's float32 product rate before -> after its run (SmolLM2's MLP shape)."""
    return f"{run.get('rate_before', float('nan')):.0f} → {run.get('rate_after', float('nan')):.0f}"


def _report(runs: list[dict], args: argparse.Namespace, n_rows: int) -> str:
    lines = [
        f"Machine: {_machine(runs[0])}.",
        "",
        _work_text(runs, args, n_rows),
        "",
        "| run | dtype | load before → after | completion tokens | rollout (s) | teacher (s) | student "
        "fwd+bwd (s) | loss (s) | optimizer (s) | whole step (s) | ms / completion token outside generation "
        "| rollout tokens/s | peak RSS (GiB) | float32 product before → after (GFLOP/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = _summary(r)
        name = ("opsd" if r["side"] == "opsd" else "TRL SDFT") + (
            " **(under load)**" if r["under_load"] else ""
        )
        cells = " | ".join(f"{s['phases'][p]:.2f}" for p in PHASES)
        lines.append(
            f"| {name} | {r['dtype']} | {r['load_before']:.2f} → {r['load_after']:.2f} | {s['tokens']} | "
            f"{cells} | {s['step_s']:.2f} | {s['ms_per_token']:.2f} | {s['rollout_tok_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {_rates(r)} |"
        )
    lines += [
        "",
        "TRL ÷ opsd (above 1: opsd is better; medians over repeats; targets in brackets):",
        "",
        *_ratio_lines(runs),
        "",
        "Phases are not cut at the same places: TRL's teacher and student forwards include the LM head "
        "(full logits), which opsd computes inside its fused loss; the sums outside generation compare "
        "like with like. TRL's rollout is `model.generate` on the unmerged LoRA model.",
    ]
    return "\n".join(lines)


def _work_text(runs: list[dict], args: argparse.Namespace, n_rows: int) -> str:
    """The report's paragraph on the work both sides do and how each is set up."""
    info = runs[0]
    steps = args.measured_steps
    teacher_prompt = '"{prompt}\\n\\n{privileged_context}"'
    trl_bf16 = {
        "weights": "loads the model in bf16",
        "autocast": "autocasts fp32 weights (bf16=True)",
    }[args.trl_bf16]
    opsd_set = f", with {', '.join(f'`{x}`' for x in args.opsd_set)}" if args.opsd_set else ""
    return (
        "Same work on both sides (`python bench/vs_trl.py`): SmolLM2-135M-Instruct, LoRA r=16 alpha=32 on "
        f"q/k/v/o/gate/up/down, {args.rows_per_step} prompts per step (MATH train rows "
        f"{args.rows_per_step}-{n_rows - 1} in file order, rows 0-{args.rows_per_step - 1} warm up), 1 "
        f"response each of <= {args.max_new_tokens} new tokens at T={TEMPERATURE}, the reference solution as "
        f"privileged information in TRL's default teacher prompt ({teacher_prompt}; opsd renders the same "
        f"ids: {_prompt_check(runs)}), forward KL over the full vocabulary at T={TEMPERATURE} (opsd: "
        f"per-entry clip {ENTRY_CLIP} and per-token reduction, bench/train_step.py's; TRL has no per-entry "
        f"clip), the base model as teacher, no gradient checkpointing, AdamW lr {LR}, grad clip {GRAD_CLIP}; "
        f"1 warm-up step, {steps} measured. TRL {info.get('trl', '?')} `SDFTTrainer` "
        "(distillation_mode=full_logits, distillation_alpha=0, teacher_model_kind=base, "
        f"per_device_train_batch_size={args.rows_per_step}, "
        f"num_generations=1, use_cpu); its bf16 run {trl_bf16}. opsd at its default micro-batch "
        f"budget{opsd_set}. Each run is its own process; peak RSS includes loading. Times are medians "
        "over the measured steps; the sides sample different responses, so compare per token. Rollout "
        f"engines: {_engines(runs)}."
    )


def _ratio_lines(runs: list[dict]) -> list[str]:
    """Per dtype that both sides ran: TRL's figures over opsd's, medians over repeats."""
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        by = {
            side: [
                _summary(r) | {"rss": r["peak_rss_gib"]}
                for r in runs
                if r["side"] == side and r["dtype"] == dtype
            ]
            for side in SIDES
        }
        if not all(by.values()):
            continue
        m = {
            side: {
                k: statistics.median(x[k] for x in xs)
                for k in ("ms_per_token", "step_s", "rollout_tok_s", "rss")
            }
            for side, xs in by.items()
        }
        o, t = m["opsd"], m["trl"]
        outside_target = "1.5" if dtype == "bfloat16" else "2"
        lines.append(
            f"- {dtype}: whole step **{t['step_s'] / o['step_s']:.2f}×** (≥ 2), "
            f"outside generation **{t['ms_per_token'] / o['ms_per_token']:.2f}×** (≥ {outside_target}), "
            f"rollout tokens/s {o['rollout_tok_s'] / t['rollout_tok_s']:.2f}×, "
            f"peak RSS {t['rss'] / o['rss']:.2f}× (opsd {o['rss']:.2f} GiB); "
            f"opsd {o['ms_per_token']:.2f} ms per completion token outside generation."
        )
    return lines


def _engines(runs: list[dict]) -> str:
    """Which engine each side generated with, as the children reported it."""
    seen = dict.fromkeys(f"{r['side']} {r['dtype']}: {r.get('engine', '?')}" for r in runs)
    return "; ".join(seen)


def _prompt_check(runs: list[dict]) -> str:
    checks = [r["prompt_mismatches"] for r in runs if r.get("prompt_mismatches") is not None]
    if not checks:
        return "not checked"
    return "checked, identical" if not any(checks) else f"**{max(checks)} prompts differ**"


def _machine(info: dict) -> str:
    """The children's machine line (this process imports no torch), their library versions, and how
    their OpenMP threads wait (the same for both sides; recorded because it can move CPU timings)."""
    waiting = ", ".join(
        f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ
    )
    return (
        f"{info['machine']}, transformers {info['transformers']}, peft {info['peft']}; both sides {waiting}"
    )


if __name__ == "__main__":
    main()
