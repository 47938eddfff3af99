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
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import _common  # before anything imports torch (the children do): OMP_WAIT_POLICY
from _md import write_section

ROOT = _common.ROOT
MATH = ROOT.parent / "shared" / "data" / "math_train.jsonl"
SECTION = "opsd vs TRL SDFT (bench/vs_trl.py)"  # one section: the latest run, its engine named inside
SIDES = ("opsd", "trl")
PHASES = ("rollout", "teacher", "student", "loss", "optim")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_PROMPT_LEN = 1024  # TRL's max_prompt_length cuts student and teacher prompts alike
LOAD_LIMIT = 0.5  # 1-minute load average at or above which a timed run is "under load"
# TRL's default teacher prompt is "{prompt}\n\n{privileged_context}" with the prompt being the last user
# message (problem + instruction); this opsd template renders the same text.
OPSD_TEACHER_TEMPLATE = "{problem}\n\n{instruction}\n\n{solution}"
LR, GRAD_CLIP, SEED = 5e-6, 0.1, 0
TEMPERATURE, ENTRY_CLIP = 1.1, 0.05  # bench/train_step.py's


@dataclass
class Work:
    """What one run does; written to JSON for the child process."""

    side: str
    dtype: str  # float32 | bfloat16
    model: str
    rows_file: str
    rows_per_step: int
    measured_steps: int
    max_new_tokens: int
    run_dir: str
    trl_bf16: (
        str  # weights: load the model in bf16 (as opsd's model.dtype); autocast: fp32 weights, bf16=True
    )
    opsd_engine: str  # rollout.engine for opsd (auto: vLLM where installed, else HF)
    opsd_set: list[str]  # extra opsd config overrides (--opsd-set), after the shared settings


# --------------------------------------------------------------------------------------------------
# The parent: one child per run, load checks, the report


def main() -> None:
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
    args = ap.parse_args()

    if args.child:
        import torch

        work = Work(**json.loads(args.work.read_text()))
        # The float32 product rate before and after: a rate that moved means the VM's share of its host
        # moved during the run, which the load average inside the VM does not show.
        rate_before = _common.matmul_rate(torch.float32)
        steps, info = (_run_opsd if args.child == "opsd" else _run_trl)(work)
        rates = {"rate_before": rate_before, "rate_after": _common.matmul_rate(torch.float32)}
        args.result.write_text(json.dumps({"steps": steps, **info, **rates}))
        return

    if args.smoke:
        args.rows_per_step, args.measured_steps, args.max_new_tokens, args.no_write = 1, 1, 8, True
    if args.dtypes is None:
        from opsd.devices import cpu_isa  # light: no torch

        args.dtypes = "float32" if "no bf16" in cpu_isa() else "float32,bfloat16"
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16")]:
        sys.exit(f"--dtypes: {bad} not among float32, bfloat16")
    model = _model_path()
    if not args.data.is_file():
        sys.exit(f"{args.data} not found (the public MATH train split, see ../shared/data/README.md)")
    if importlib.util.find_spec("trl") is None:  # find, not import: trl would import torch here
        sys.exit("trl is not installed: pip install -e '.[bench]'")

    n_rows = args.rows_per_step * (1 + args.measured_steps)
    rows = [json.loads(x) for x in args.data.read_text().splitlines()[:n_rows]]
    if len(rows) < n_rows:
        sys.exit(f"{args.data} has {len(rows)} rows, the run needs {n_rows}")
    tmp = Path(tempfile.mkdtemp(prefix="opsd-vs-trl-"))
    rows_file = tmp / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))

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
    info = runs[0]
    steps = args.measured_steps
    teacher_prompt = '"{prompt}\\n\\n{privileged_context}"'
    trl_bf16 = {
        "weights": "loads the model in bf16",
        "autocast": "autocasts fp32 weights (bf16=True)",
    }[args.trl_bf16]
    opsd_set = f", with {', '.join(f'`{x}`' for x in args.opsd_set)}" if args.opsd_set else ""
    lines = [
        f"Machine: {_machine(info)}.",
        "",
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
        f"engines: {_engines(runs)}.",
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
    ]
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
    lines += [
        "",
        "Phases are not cut at the same places: TRL's teacher and student forwards include the LM head "
        "(full logits), which opsd computes inside its fused loss; the sums outside generation compare "
        "like with like. TRL's rollout is `model.generate` on the unmerged LoRA model.",
    ]
    return "\n".join(lines)


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


# --------------------------------------------------------------------------------------------------
# The children: one trainer each, timed per phase


def _run_opsd(w: Work) -> tuple[list[dict], dict]:
    """opsd's Trainer; the phase times are its own metrics.jsonl."""
    from opsd.config import load_config
    from opsd.cpu import command_defaults
    from opsd.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"model.path={w.model}",
            f"model.dtype={w.dtype}",
            "model.attn_implementation=sdpa",
            "model.gradient_checkpointing=false",
            "model.lora.r=16",
            "model.lora.alpha=32",
            "model.lora.dropout=0",
            f"model.lora.target_modules={json.dumps(LORA_TARGETS)}",
            f"data.path={w.rows_file}",
            "data.shuffle=false",
            f"data.max_prompt_len={MAX_PROMPT_LEN}",
            f"data.max_teacher_prompt_len={MAX_PROMPT_LEN}",
            f"data.teacher_template={json.dumps(OPSD_TEACHER_TEMPLATE)}",
            f"rollout.engine={w.opsd_engine}",
            f"rollout.prompts_per_step={w.rows_per_step}",
            "rollout.n=1",
            f"rollout.max_new_tokens={w.max_new_tokens}",
            f"rollout.temperature={TEMPERATURE}",
            "rollout.top_p=1.0",
            "rollout.top_k=0",
            "loss.mode=jsd",
            "loss.beta=0",
            "loss.clip_mode=entry",
            f"loss.clip={ENTRY_CLIP}",
            "loss.reduction=token",
            f"loss.temperature={TEMPERATURE}",
            "teacher.mode=fixed",
            f"optim.max_steps={1 + w.measured_steps}",
            f"optim.lr={LR}",
            f"optim.grad_clip={GRAD_CLIP}",
            "optim.scheduler=constant",
            "checkpoint.enabled=false",
            f"logging.run_dir={w.run_dir}",
            "logging.progress=false",
            "logging.sample_every=0",
            "device=cpu",
            f"seed={SEED}",
            *w.opsd_set,
        ],
    )
    cfg = command_defaults(cfg)  # the `opsd` command's defaults (cpu.tune_malloc), as `opsd train` runs
    trainer = Trainer(cfg)
    engine = type(trainer.run.engine).__name__
    trainer.train()
    recs = [json.loads(x) for x in (Path(w.run_dir) / "metrics.jsonl").read_text().splitlines()]
    keys = ("tokens", "time_step", *(f"time_{p}" for p in PHASES))
    return [{k: r[k] for k in keys} for r in recs[1:]], {**_versions(), "engine": engine}


def _run_trl(w: Work) -> tuple[list[dict], dict]:
    """TRL's SDFTTrainer with timers around its own methods; its computation is untouched."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    from opsd.data.prompts import DEFAULT_INSTRUCTION

    class TimedSDFT(SDFTTrainer):
        """Adds up wall-clock time per phase into ``bench_steps[-1]``."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.bench_steps: list[dict] = []
            backward = self.accelerator.backward

            def timed_backward(loss, **kwargs):
                with self._phase("student"):
                    return backward(loss, **kwargs)

            self.accelerator.backward = timed_backward

        @contextmanager
        def _phase(self, name: str):
            t = time.perf_counter()
            try:
                yield
            finally:
                self.bench_steps[-1][f"time_{name}"] += time.perf_counter() - t

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.bench_steps.append(
                {"tokens": 0, "t0": time.perf_counter(), **{f"time_{p}": 0.0 for p in PHASES}}
            )
            out = super().training_step(model, inputs, num_items_in_batch)
            self.bench_steps[-1]["t_train_end"] = time.perf_counter()
            return out

        def _generate(self, prompt_ids):
            with self._phase("rollout"):
                prompt_ids, completions = super()._generate(prompt_ids)
            self.bench_steps[-1]["tokens"] += sum(len(c) for c in completions)
            return prompt_ids, completions

        def _forward_logits(self, model, input_ids, attention_mask, logits_to_keep):
            with self._phase("student" if torch.is_grad_enabled() else "teacher"):
                return super()._forward_logits(model, input_ids, attention_mask, logits_to_keep)

        def _compute_self_distillation_loss(self, model, inputs, distillation_logits):
            with self._phase("loss"):
                return super()._compute_self_distillation_loss(model, inputs, distillation_logits)

    class StepEnd(TrainerCallback):
        """Clip, optimizer step, schedule and zero_grad run between training_step and on_step_end."""

        def on_step_end(self, args, state, control, **kwargs):
            rec = trainer.bench_steps[-1]
            now = time.perf_counter()
            rec["time_optim"] += now - rec.pop("t_train_end")
            rec["time_step"] = now - rec.pop("t0")

    rows = [json.loads(x) for x in Path(w.rows_file).read_text().splitlines()]
    examples = [
        {
            "prompt": [{"role": "user", "content": f"{r['problem']}\n\n{DEFAULT_INSTRUCTION}"}],
            "privileged_context": r["solution"],
        }
        for r in rows
    ]
    autocast = w.dtype == "bfloat16" and w.trl_bf16 == "autocast"
    weights = torch.bfloat16 if w.dtype == "bfloat16" and not autocast else torch.float32
    args = SDFTConfig(
        output_dir=w.run_dir,
        per_device_train_batch_size=w.rows_per_step,
        gradient_accumulation_steps=1,
        num_generations=1,
        distillation_mode="full_logits",
        distillation_alpha=0.0,
        teacher_model_kind="base",
        max_prompt_length=MAX_PROMPT_LEN,
        max_completion_length=w.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        use_cpu=True,
        gradient_checkpointing=False,
        bf16=autocast,
        model_init_kwargs={"dtype": weights, "attn_implementation": "sdpa"},
        max_steps=1 + w.measured_steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=GRAD_CLIP,
        optim="adamw_torch",
        seed=SEED,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    trainer = TimedSDFT(
        model=w.model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        peft_config=lora,
        callbacks=[StepEnd()],
    )
    mismatches = _compare_prompts(trainer, examples, rows)
    trainer.train()
    engine = "vLLM" if args.use_vllm else "HF generate"
    return trainer.bench_steps[1:], {**_versions(), "prompt_mismatches": mismatches, "engine": engine}


def _compare_prompts(trainer, examples: list[dict], rows: list[dict]) -> int | None:
    """How many student or teacher prompts TRL tokenizes differently from opsd (0 is the point)."""
    from opsd.data.prompts import student_prompt_ids, teacher_prompt_ids

    try:  # TRL's own (private) prompt path, exactly as its training step uses it
        prompts, contexts = [e["prompt"] for e in examples], [e["privileged_context"] for e in examples]
        trl_student = trainer._tokenize_prompts(prompts)
        trl_teacher = trainer._tokenize_prompts(
            [trainer.teacher_context_builder._compose_teacher_prompt(p, c) for p, c in zip(prompts, contexts)]
        )
    except AttributeError as err:  # a TRL version whose internals moved
        print(f"prompt check skipped: {err}", file=sys.stderr)
        return None
    tok, bad = trainer._tokenizer, 0
    for r, s, t in zip(rows, trl_student, trl_teacher):
        bad += student_prompt_ids(tok, r["problem"], max_len=MAX_PROMPT_LEN)[0] != list(s)
        bad += teacher_prompt_ids(
            tok, r["problem"], r["solution"], template=OPSD_TEACHER_TEMPLATE, max_len=MAX_PROMPT_LEN
        )[0] != list(t)
    return bad


def _versions() -> dict:
    import peft
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {
        "machine": _common.describe_machine(),  # torch's version and this child's thread count
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "trl": trl_version,
    }


if __name__ == "__main__":
    main()
