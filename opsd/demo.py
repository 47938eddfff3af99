"""`opsd demo`: self-distillation with privileged information, shown end to end on a laptop CPU.

The claim under test: a model that can solve a problem when handed a reference solution can teach
itself, by OPSD, to solve problems *without* it. No real model shows that on real math in minutes
on a CPU, so the demo builds a small, honest testbed and runs the production code path on it.

Task. 3-digit addition. The student sees ``437+285=`` and writes a worked column addition, units
first, each column's total with the carry included, then the answer: ``12 12 07 so 0722``
(7+5=12, 3+8+1=12, 4+2+1=07). The privileged information is the reference worked solution, in the
same notation. The grader is an exact match of the final answer (the digits after ``so``, fixed
width with the leading zero); the working is not graded. Rows use the schema ``opsd train`` reads
(problem, solution, answer); the SFT, OPSD-train and held-out problem sets are disjoint.

Base model. Character-level tokenizer (byte-level BPE with no merges, ChatML chat template), a
2-layer, 128-wide Llama (0.36M parameters), and 250 SFT steps on a 50/50 mix of bare problems and
problems with the worked solution in context. Copying from the context is learned long before
adding is, so the result reads the reference almost perfectly (~100%) but adds badly on its own
(5-20%): the imperfect student the method needs. It is cached under ``$OPSD_HOME/demo``.

OPSD. ``opsd train``'s own Trainer, loss, HF rollout engine, chat template and checkpoints, with a
``fixed`` teacher (a frozen copy of the base model) that reads the reference; full fine-tuning,
forward KL (jsd, beta=0) without clipping, one sample per problem at temperature 1, 64 problems a
step, AdamW lr 2e-3 cosine, 300 steps. Held-out accuracy is measured greedily every 25 steps.
``--control`` sets ``teacher.privileged=false``: the teacher then reads exactly what the student
reads with the initial weights, its distribution equals the student's, the gradient is zero and
the student does not move. Any gain therefore comes from the privileged information alone.

Why these choices (measured on this 2-core CPU; numbers in docs/benchmarks.md):
* Worked responses, not bare answers. With answer-only responses, copying the answer from the
  context blocked learning to add: after the same 50/50 SFT the student was at 1% after 400 steps
  (the worked format: 97%), and a model SFT'd on copying alone stayed at 0% through 400 more steps of
  plain SFT on bare problems. In the worked format every token is a local computation (two operand
  digits and the carry just written), so the student's errors are local, and the teacher corrects
  them token by token on the student's own rollouts: after a prefix with one wrong digit it still
  predicts the reference's next token 89% of the time.
* Held-out accuracy first dips for ~25 steps. Continuing plain SFT on bare problems with a fresh
  AdamW dips the same way (18% -> 3% -> 24% by step 60), so this is the optimizer restart on a
  freshly annealed tiny model, not something OPSD does; the student recovers, then climbs.
* One torch thread: the model is too small to gain from two, and a second thread fighting any
  other busy process made steps 8-40x slower.
* The teacher is a near-perfect copier, which is what a small model reading a reference can be. The
  demo shows the mechanism end to end, not that a real model's teacher is this reliable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from opsd.data import student_prompt_ids, teacher_prompt_ids
from opsd.models import opsd_home

TASK_VERSION = 2  # bump when the task or the base-model recipe changes: cached base models are keyed by it
TEACHER_TEMPLATE = "{problem}\nWorked: {solution}"
_FINAL = re.compile(r"(?:^|\s)so ([0-9]+)$")


# ----------------------------------------------------------------------------------------------
# 1. The task: d-digit addition. Generator with a seed, disjoint splits, exact-match grader.


def answer_text(a: int, b: int, digits: int) -> str:
    """The sum with ``digits + 1`` digits (leading zero kept): every answer has the same width."""
    return f"{a + b:0{digits + 1}d}"


def worked_solution(a: int, b: int, digits: int) -> str:
    """Column addition, units first: each column's total (carry in included) as two digits, then the answer.

    ``437+285`` -> ``"12 12 07 so 0722"``. It is both the student's response format and the
    privileged reference the teacher reads.
    """
    da, db = f"{a:0{digits}d}"[::-1], f"{b:0{digits}d}"[::-1]
    totals, carry = [], 0
    for x, y in zip(da, db):
        t = int(x) + int(y) + carry
        totals.append(f"{t:02d}")
        carry = t // 10
    return " ".join(totals) + f" so {answer_text(a, b, digits)}"


def make_row(a: int, b: int, digits: int) -> dict:
    """One row in the schema `opsd train` reads: problem (student), solution (privileged), answer."""
    return {
        "problem": f"{a}+{b}=",
        "solution": worked_solution(a, b, digits),
        "answer": answer_text(a, b, digits),
    }


def _operands(row: dict) -> tuple[int, int]:
    a, b = row["problem"].rstrip("=").split("+")
    return int(a), int(b)


def make_rows(n: int, seed: int, digits: int, exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """``n`` distinct problems of two ``digits``-digit numbers, none in ``exclude``; fixed by ``seed``."""
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    excluded = sum(1 for a, b in (exclude or ()) if lo <= a <= hi and lo <= b <= hi)
    free = (hi - lo + 1) ** 2 - excluded
    if n > free:
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems: only {free} are left")
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows = []
    while len(rows) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append(make_row(a, b, digits))
    return rows


def make_splits(seed: int, digits: int, n_sft: int, n_train: int, n_heldout: int) -> dict[str, list[dict]]:
    """Disjoint sets: ``sft`` builds the base model, ``train`` is OPSD's, ``heldout`` is only scored."""
    out: dict[str, list[dict]] = {}
    used: set[tuple[int, int]] = set()
    for k, (name, n) in enumerate((("heldout", n_heldout), ("train", n_train), ("sft", n_sft))):
        out[name] = make_rows(n, seed * 3 + k + 1, digits, exclude=used)
        used |= {_operands(r) for r in out[name]}
    return out


def final_answer(response: str | None) -> str | None:
    """The digits after the last ``so `` that ends the response, or None if it does not end that way."""
    if not isinstance(response, str):
        return None
    m = _FINAL.search(response.strip())
    return m.group(1) if m else None


def grade(response: str | None, answer: str) -> bool:
    """Exact match of the final answer (fixed width, leading zero included); the working is not graded."""
    got = final_answer(response)
    return got is not None and got == str(answer).strip()


# ----------------------------------------------------------------------------------------------
# 2. The tiny base model: character-level tokenizer, small Llama, brief SFT. Cached.


@dataclass
class DemoSettings:
    seed: int = 0
    digits: int = 3
    hidden: int = 128
    layers: int = 2
    sft_steps: int = 250
    sft_lr: float = 3e-3
    sft_batch: int = 64
    sft_teacher_frac: float = 0.5  # share of SFT rows with the worked solution in context
    n_sft: int = 4000
    n_train: int = 4000
    n_heldout: int = 300
    opsd_steps: int = 300
    opsd_lr: float = 2e-3
    opsd_warmup: int = 10
    prompts_per_step: int = 64
    temperature: float = 1.0
    eval_every: int = 25

    def _key(self, keys: tuple[str, ...]) -> str:
        blob = json.dumps({"version": TASK_VERSION, **{k: getattr(self, k) for k in keys}}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def base_key(self) -> str:
        """Everything the base model depends on; a change means a rebuild, never a stale cache hit."""
        return self._key(
            (
                "seed",
                "digits",
                "hidden",
                "layers",
                "sft_steps",
                "sft_lr",
                "sft_batch",
                "sft_teacher_frac",
                "n_sft",
                "n_train",
                "n_heldout",
            )
        )


def build_tokenizer():
    """Character level: a byte-level BPE with no merges, so every digit is its own token."""
    from opsd.models import CHATML_SPECIAL_TOKENS, build_tiny_tokenizer

    return build_tiny_tokenizer(
        texts=["0123456789+= so Worked:"], vocab_size=256 + len(CHATML_SPECIAL_TOKENS)
    )


def prompt_ids(tok, row: dict, *, with_solution: bool) -> list[int]:
    """The prompts training uses: the student's (problem only) or the teacher's (problem + solution)."""
    if with_solution:
        return teacher_prompt_ids(
            tok, row["problem"], row["solution"], template=TEACHER_TEMPLATE, instruction=""
        )[0]
    return student_prompt_ids(tok, row["problem"], instruction="")[0]


def sft_pairs(tok, rows: list[dict], teacher_frac: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, worked solution + eos) pairs; a ``teacher_frac`` share of prompts also hold the solution."""
    rng = random.Random(seed)
    eos = [tok.eos_token_id]
    return [
        (
            prompt_ids(tok, r, with_solution=rng.random() < teacher_frac),
            tok.encode(r["solution"], add_special_tokens=False) + eos,
        )
        for r in rows
    ]


def build_base_model(s: DemoSettings, cache: Path | None = None, progress: bool = True) -> Path:
    """Build (or load from the cache) the imperfect student; returns its HF directory."""
    from opsd.models import build_tiny_model
    from opsd.sft import sft

    out = Path(cache or opsd_home() / "demo") / f"base-{s.base_key()}"
    if (out / "demo_base.json").is_file():  # written last: its presence means the directory is complete
        return out
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=s.hidden, num_layers=s.layers, seed=s.seed)
    rows = make_splits(s.seed, s.digits, s.n_sft, s.n_train, s.n_heldout)["sft"]
    pairs = sft_pairs(tok, rows, s.sft_teacher_frac, s.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        losses = sft(
            model,
            pairs,
            steps=s.sft_steps,
            lr=s.sft_lr,
            batch_size=s.sft_batch,
            seed=s.seed,
            pad_id=tok.pad_token_id,
            progress=progress,
            desc="demo: SFT base model",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{time.time_ns()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "demo_base.json").write_text(json.dumps({**asdict(s), "sft_loss_last": losses[-1]}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------------------
# 3. Evaluation with the rollout engine (greedy), and the demo itself.


def accuracy(model, tok, rows: list[dict], *, with_solution: bool) -> float:
    """Greedy exact-match accuracy through the same HF engine and chat template as training."""
    from opsd.rollout import HFEngine, SamplingParams

    prompts = [prompt_ids(tok, r, with_solution=with_solution) for r in rows]
    width = len(rows[0]["solution"]) + 2  # one token too many shows as wrong instead of being cut off
    params = SamplingParams(temperature=0.0, max_new_tokens=width, seed=0)
    outs = HFEngine(model, tok, batch_size=512).generate(prompts, 1, params)
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    return sum(grade(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{time.time_ns()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)


def train_overrides(
    s: DemoSettings, base: Path, train_path: Path, run_dir: Path, *, control: bool, progress: bool
) -> list[str]:
    """The `opsd train` configuration of the demo, as the same dotted overrides the CLI takes."""
    width = len(worked_solution(10 ** (s.digits - 1), 10 ** (s.digits - 1), s.digits)) + 2
    return [
        f"seed={s.seed}",
        "device=cpu",
        f"model.path={base}",
        "model.lora.enabled=false",
        f"data.path={train_path}",
        "data.instruction=",
        f"data.teacher_template={json.dumps(TEACHER_TEMPLATE)}",
        "data.max_prompt_len=64",
        "data.max_teacher_prompt_len=160",
        f"rollout.prompts_per_step={s.prompts_per_step}",
        "rollout.n=1",
        f"rollout.temperature={s.temperature}",
        f"rollout.max_new_tokens={width}",
        "rollout.batch_size=256",
        "loss.mode=jsd",
        "loss.beta=0",
        "loss.clip_mode=none",
        "teacher.mode=fixed",
        f"teacher.privileged={'false' if control else 'true'}",
        f"optim.lr={s.opsd_lr}",
        "optim.grad_clip=1.0",
        f"optim.max_steps={s.opsd_steps}",
        f"optim.warmup_steps={s.opsd_warmup}",
        "optim.scheduler=cosine",
        "checkpoint.every=0",
        "checkpoint.keep_last=1",
        f"logging.run_dir={run_dir}",
        "logging.sample_every=25",
        f"logging.progress={'true' if progress else 'false'}",
    ]


def _check_run_dir(run_dir: Path) -> None:
    """Only a previous demo run is overwritten; anything else in the way is refused."""
    if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / "demo.json").is_file():
        raise FileExistsError(
            f"{run_dir} exists and is not an `opsd demo` run directory; pass another --run-dir"
        )


def run(
    s: DemoSettings,
    run_dir: Path,
    *,
    control: bool = False,
    progress: bool = True,
    cache: Path | None = None,
    plot: bool = True,
    threads: int | None = 1,
) -> dict:
    """The whole demo for one seed; returns before/after accuracies, the curve and timings.

    ``threads``: torch CPU threads while it runs (restored after). One is the default because the
    model is too small to gain from more, while a second thread competing with any other busy process
    made steps 8-40x slower on a 2-core machine; it also keeps the numbers reproducible. None: leave as is.
    """
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(s, Path(run_dir), control=control, progress=progress, cache=cache, plot=plot)
    finally:
        torch.set_num_threads(prev)


def _run(
    s: DemoSettings, run_dir: Path, *, control: bool, progress: bool, cache: Path | None, plot: bool
) -> dict:
    from opsd.config import load_config
    from opsd.models import load_model, load_tokenizer
    from opsd.trainer import Trainer

    t0 = time.time()
    _check_run_dir(run_dir)
    cache = Path(cache or opsd_home() / "demo")
    base = build_base_model(s, cache=cache, progress=progress)
    t_base = time.time() - t0

    split = make_splits(s.seed, s.digits, s.n_sft, s.n_train, s.n_heldout)
    data_dir = cache / f"data-{s.base_key()}"
    for name in ("train", "heldout"):
        if not (data_dir / f"{name}.jsonl").is_file():
            _write_jsonl(data_dir / f"{name}.jsonl", split[name])
    heldout = split["heldout"]

    _say(progress, f"evaluating the base model on {len(heldout)} held-out problems")
    tok = load_tokenizer(str(base))
    model = load_model(str(base))
    before = accuracy(model, tok, heldout, with_solution=False)
    teacher_acc = accuracy(model, tok, heldout, with_solution=True)
    del model
    _say(
        progress,
        f"student {100 * before:.1f}% (problem only), teacher {100 * teacher_acc:.1f}% (with solution)",
    )

    overrides = train_overrides(
        s, base, data_dir / "train.jsonl", run_dir, control=control, progress=progress
    )
    trainer = Trainer(load_config(None, overrides), overwrite=True)
    (run_dir / "demo.json").write_text(json.dumps({"settings": asdict(s), "control": control}, indent=2))
    curve = [(0, before)]
    with (run_dir / "eval.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": before}) + "\n")
    while trainer.step_num < s.opsd_steps:
        until = min(s.opsd_steps, trainer.step_num + s.eval_every)
        trainer.train(until_step=until)
        if trainer.step_num < until:  # Ctrl-C / SIGTERM: the trainer saved a checkpoint and returned early
            raise KeyboardInterrupt(f"stopped after OPSD step {trainer.step_num}; checkpoint in {run_dir}")
        acc = accuracy(trainer.model, tok, heldout, with_solution=False)
        curve.append((trainer.step_num, acc))
        with (run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps({"step": trainer.step_num, "eval/accuracy": acc}) + "\n")
        _say(progress, f"step {trainer.step_num}: held-out accuracy {100 * acc:.1f}%")
    after = curve[-1][1]
    result = {
        "seed": s.seed,
        "control": control,
        "student_before": before,
        "student_after": after,
        "teacher_with_solution": teacher_acc,
        "gain": after - before,
        "gap_closed": (after - before) / (teacher_acc - before) if teacher_acc > before else float("nan"),
        "curve": curve,
        "seconds": time.time() - t0,
        "seconds_base_model": t_base,
        "run_dir": str(run_dir),
        "base_model": str(base),
        "settings": asdict(s),
    }
    if plot:
        result["plot"] = str(plot_curve(run_dir, curve, control, teacher_acc))
    (run_dir / "demo_result.json").write_text(json.dumps(result, indent=2))
    return result


def _say(progress: bool, msg: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"demo: {msg}", file=sys.stderr)


def plot_curve(
    run_dir: Path, curve: list[tuple[int, float]], control: bool, teacher_acc: float | None = None
) -> Path:
    """Held-out accuracy (left axis) and the per-token divergence the loss minimises (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    fig, ax1 = plt.subplots(figsize=(7, 4.5))
    steps, accs = [c[0] for c in curve], [100 * c[1] for c in curve]
    ax1.plot(steps, accs, "o-", color="tab:blue", label="student accuracy, problem only")
    if teacher_acc is not None:
        ax1.axhline(
            100 * teacher_acc, color="tab:green", ls="--", label="teacher accuracy, with the worked solution"
        )
    ax1.set_xlabel("OPSD step")
    ax1.set_ylabel("held-out accuracy (%)")
    ax1.set_ylim(-2, 102)
    ax2 = ax1.twinx()
    ax2.plot(
        [r["step"] for r in recs],
        [r["divergence"] for r in recs],
        color="tab:red",
        alpha=0.6,
        label="mean per-token JSD (beta=0)",
    )
    ax2.set_ylabel("mean per-token JSD (beta=0: KL(teacher || student))", color="tab:red")
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    what = "WITHOUT the solution (control)" if control else "reads the worked solution"
    ax1.set_title(f"opsd demo: the teacher {what}")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = run_dir / "demo.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# 4. `opsd demo`


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control",
        action="store_true",
        help="the scientific control: no solution in the teacher's context (it should teach nothing)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=DemoSettings.opsd_steps, help="OPSD steps")
    p.add_argument("--run-dir", type=Path, default=None, help="default: runs/demo[-control]-seedN")
    p.add_argument(
        "--cache", type=Path, default=None, help="where base models are cached (default $OPSD_HOME/demo)"
    )


def format_table(r: dict) -> str:
    """The before/after table `opsd demo` prints (markdown, so it pastes into issues and docs)."""
    steps = r["settings"]["opsd_steps"]
    lines = [
        "| held-out accuracy (greedy, exact final answer) | |",
        "|---|---|",
        f"| student before OPSD (problem only) | {100 * r['student_before']:.1f}% |",
        f"| student after {steps} OPSD steps (problem only) | {100 * r['student_after']:.1f}% |",
        "| teacher: base model with the worked solution in context (reference) "
        f"| {100 * r['teacher_with_solution']:.1f}% |",
    ]
    gap = r["gap_closed"]
    lines.append(
        f"\ngain {100 * r['gain']:+.1f} points; closes {100 * gap:.0f}% of the student-teacher gap"
        if not math.isnan(gap)
        else f"\ngain {100 * r['gain']:+.1f} points"
    )
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-checkpoint "writing shards" bars would bury the demo's own
    if args.steps < 1:
        print(f"opsd demo: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    s = DemoSettings(seed=args.seed, opsd_steps=args.steps)
    run_dir = args.run_dir or Path("runs") / f"demo{'-control' if args.control else ''}-seed{args.seed}"
    what = "WITHOUT the worked solution (control)" if args.control else "reading the worked solution"
    print(
        f"opsd demo: {s.digits}-digit addition, tiny Llama ({s.layers}x{s.hidden}), seed {s.seed}; "
        f"fixed teacher {what}",
        file=sys.stderr,
    )
    try:
        r = run(s, run_dir, control=args.control, cache=args.cache)
    except (FileExistsError, ValueError) as e:
        print(f"opsd demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"opsd demo: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 130
    print()
    print(format_table(r))
    print(f"plot: {r['plot']}")
    print(
        f"run directory: {run_dir} "
        f"({r['seconds']:.0f} s, of which base model {r['seconds_base_model']:.0f} s)"
    )
    print(
        f"training alone again: opsd train --config {run_dir / 'config.yaml'} "
        "logging.run_dir=runs/opsd-demo-again"
    )
    return 0
