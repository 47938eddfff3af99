"""`opsd demo`: self-distillation with privileged information, shown end to end on a laptop CPU.

DESIGN (draft, being tuned)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from opsd.data import student_prompt_ids, teacher_prompt_ids
from opsd.models import opsd_home

TASK_VERSION = 1  # bump when the task or the base-model recipe changes: cached base models are keyed by it
TEACHER_TEMPLATE = "{problem}\nWorked: {solution}"
_DIGITS = re.compile(r"[0-9]+")


# ----------------------------------------------------------------------------------------------
# 1. The task: d-digit addition. Generator with a seed, disjoint splits, exact-match grader.


def answer_text(a: int, b: int, digits: int) -> str:
    """The sum with ``digits + 1`` digits (leading zero kept): every answer has the same width."""
    return f"{a + b:0{digits + 1}d}"


def worked_solution(a: int, b: int, digits: int) -> str:
    """Column addition from the units up, each column with its carry in, ending in the answer."""
    da, db = f"{a:0{digits}d}"[::-1], f"{b:0{digits}d}"[::-1]
    steps, carry = [], 0
    for x, y in zip(da, db):
        s = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return " ".join(steps) + f" so {answer_text(a, b, digits)}"


def make_row(a: int, b: int, digits: int) -> dict:
    """One row in the JSONL schema `opsd train` reads: problem, solution (privileged), answer."""
    return {"problem": f"{a}+{b}=", "solution": worked_solution(a, b, digits), "answer": answer_text(a, b, digits)}


def _operands(row: dict) -> tuple[int, int]:
    a, b = row["problem"].rstrip("=").split("+")
    return int(a), int(b)


def make_rows(n: int, seed: int, digits: int, exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """``n`` distinct problems with ``digits``-digit operands, none in ``exclude``; deterministic in ``seed``."""
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    free = (hi - lo + 1) ** 2 - len(exclude or ())
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
    """Disjoint problem sets: ``sft`` builds the base model, ``train`` is OPSD's, ``heldout`` is never trained on."""
    out: dict[str, list[dict]] = {}
    used: set[tuple[int, int]] = set()
    for k, (name, n) in enumerate((("heldout", n_heldout), ("train", n_train), ("sft", n_sft))):
        out[name] = make_rows(n, seed * 3 + k + 1, digits, exclude=used)
        used |= {_operands(r) for r in out[name]}
    return out


def grade(response: str | None, answer: str) -> bool:
    """Exact match of the final answer: the response (whitespace stripped) is the answer's digits, nothing else."""
    if not isinstance(response, str):
        return False
    text = response.strip()
    return _DIGITS.fullmatch(text) is not None and text == str(answer).strip()


# ----------------------------------------------------------------------------------------------
# 2. The tiny base model: character-level tokenizer, small Llama, brief SFT. Cached.


@dataclass
class DemoSettings:
    seed: int = 0
    digits: int = 3
    hidden: int = 128
    layers: int = 2
    sft_steps: int = 150
    sft_lr: float = 3e-3
    sft_batch: int = 64
    sft_teacher_frac: float = 1.0  # share of SFT rows with the worked solution in context
    n_sft: int = 4000
    n_train: int = 4000
    n_heldout: int = 300
    opsd_steps: int = 200
    opsd_lr: float = 3e-3
    opsd_warmup: int = 10
    opsd_scheduler: str = "cosine"
    prompts_per_step: int = 64
    temperature: float = 1.0
    eval_every: int = 25

    def base_key(self) -> str:
        keys = ("seed", "digits", "hidden", "layers", "sft_steps", "sft_lr", "sft_batch", "sft_teacher_frac", "n_sft")
        blob = json.dumps({"version": TASK_VERSION, **{k: getattr(self, k) for k in keys}}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer():
    """Character level: a byte-level BPE with no merges, so every digit is its own token."""
    from opsd.models import CHATML_SPECIAL_TOKENS, build_tiny_tokenizer

    return build_tiny_tokenizer(texts=["0123456789+= so Worked:"], vocab_size=256 + len(CHATML_SPECIAL_TOKENS))


def prompt_ids(tok, row: dict, *, with_solution: bool) -> list[int]:
    """The exact prompts training uses: the student's (problem only) or the teacher's (problem + solution)."""
    if with_solution:
        return teacher_prompt_ids(tok, row["problem"], row["solution"], template=TEACHER_TEMPLATE, instruction="")[0]
    return student_prompt_ids(tok, row["problem"], instruction="")[0]


def sft_pairs(tok, rows: list[dict], teacher_frac: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer + eos) pairs; a ``teacher_frac`` share of the prompts carry the worked solution."""
    rng = random.Random(seed)
    eos = [tok.eos_token_id]
    return [
        (prompt_ids(tok, r, with_solution=rng.random() < teacher_frac), tok.encode(r["answer"], add_special_tokens=False) + eos)
        for r in rows
    ]


def build_base_model(s: DemoSettings, cache: Path | None = None, progress: bool = True, log=None) -> Path:
    """Build (or load from the cache) the imperfect student; returns its HF directory."""
    from opsd.models import build_tiny_model
    from opsd.sft import sft

    out = Path(cache or opsd_home() / "demo") / f"base-{s.base_key()}"
    if (out / "config.json").is_file() and (out / "demo_base.json").is_file():
        return out
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=s.hidden, num_layers=s.layers, seed=s.seed)
    rows = make_splits(s.seed, s.digits, s.n_sft, s.n_train, s.n_heldout)["sft"]
    pairs = sft_pairs(tok, rows, s.sft_teacher_frac, s.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        losses = sft(model, pairs, steps=s.sft_steps, lr=s.sft_lr, batch_size=s.sft_batch, seed=s.seed,
                     pad_id=tok.pad_token_id, progress=progress, desc="demo: SFT base model", callback=log)
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
    width = len(rows[0]["answer"]) + 2  # room for one extra digit: a too-long answer must show as wrong
    outs = HFEngine(model, tok, batch_size=512).generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=width, seed=0))
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    return sum(grade(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


def run(s: DemoSettings, run_dir: Path, *, control: bool = False, progress: bool = True,
        cache: Path | None = None, plot: bool = True) -> dict:
    """The whole demo for one seed; returns before/after accuracies and the curve."""
    from opsd.config import load_config
    from opsd.models import load_model, load_tokenizer
    from opsd.trainer import Trainer

    t0 = time.time()
    base = build_base_model(s, cache=cache, progress=progress)
    t_base = time.time() - t0
    run_dir = Path(run_dir)
    data_dir = run_dir.parent / f"{run_dir.name}-data"
    data_dir.mkdir(parents=True, exist_ok=True)
    split = make_splits(s.seed, s.digits, s.n_sft, s.n_train, s.n_heldout)
    for name in ("train", "heldout"):
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split[name]))
    heldout = split["heldout"]

    tok = load_tokenizer(str(base))
    model = load_model(str(base))
    before = accuracy(model, tok, heldout, with_solution=False)
    teacher_acc = accuracy(model, tok, heldout, with_solution=True)
    del model

    width = len(heldout[0]["answer"]) + 2
    overrides = [
        f"seed={s.seed}", "device=cpu", f"model.path={base}", "model.lora.enabled=false",
        f"data.path={data_dir / 'train.jsonl'}", "data.instruction=", f"data.teacher_template={json.dumps(TEACHER_TEMPLATE)}",
        "data.max_prompt_len=64", "data.max_teacher_prompt_len=160",
        f"rollout.prompts_per_step={s.prompts_per_step}", "rollout.n=1", f"rollout.temperature={s.temperature}",
        f"rollout.max_new_tokens={width}", "rollout.batch_size=256",
        "loss.mode=jsd", "loss.beta=0", "loss.clip_mode=none",
        "teacher.mode=fixed", f"teacher.privileged={'false' if control else 'true'}",
        f"optim.lr={s.opsd_lr}", "optim.grad_clip=1.0", f"optim.max_steps={s.opsd_steps}",
        f"optim.warmup_steps={s.opsd_warmup}", f"optim.scheduler={s.opsd_scheduler}",
        "checkpoint.every=0", "checkpoint.keep_last=1", f"logging.run_dir={run_dir}", "logging.sample_every=0",
        f"logging.progress={'true' if progress else 'false'}",
    ]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, overwrite=True)
    curve = [(0, before)]
    eval_path = run_dir / "eval.jsonl"
    eval_path.write_text(json.dumps({"step": 0, "eval/accuracy": before}) + "\n")
    while trainer.step_num < s.opsd_steps:
        trainer.train(until_step=min(s.opsd_steps, trainer.step_num + s.eval_every))
        acc = accuracy(trainer.model, tok, heldout, with_solution=False)
        curve.append((trainer.step_num, acc))
        with eval_path.open("a") as f:
            f.write(json.dumps({"step": trainer.step_num, "eval/accuracy": acc}) + "\n")
    after = curve[-1][1]
    result = {
        "seed": s.seed, "control": control, "student_before": before, "student_after": after,
        "teacher_with_solution": teacher_acc, "curve": curve, "seconds": time.time() - t0,
        "seconds_base_model": t_base, "run_dir": str(run_dir), "settings": asdict(s),
    }
    if plot:
        result["plot"] = str(plot_curve(run_dir, curve, control))
    (run_dir / "demo_result.json").write_text(json.dumps(result, indent=2))
    return result


def plot_curve(run_dir: Path, curve: list[tuple[int, float]], control: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot([c[0] for c in curve], [100 * c[1] for c in curve], "o-", color="tab:blue", label="held-out accuracy")
    ax1.set_xlabel("OPSD step")
    ax1.set_ylabel("held-out accuracy without solution (%)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot([r["step"] for r in recs], [r["divergence"] for r in recs], color="tab:red", alpha=0.6, label="mean JSD")
    ax2.set_ylabel("mean per-token divergence", color="tab:red")
    ax1.set_title("opsd demo" + (" (control: no privileged information)" if control else ""))
    fig.tight_layout()
    path = run_dir / "demo.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", action="store_true", help="remove the solution from the teacher's context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=DemoSettings.opsd_steps, help="OPSD steps")
    p.add_argument("--run-dir", type=Path, default=None, help="default: runs/demo[-control]-seedN")
    p.add_argument("--cache", type=Path, default=None, help="where the base model is cached (default $OPSD_HOME/demo)")


def run_demo(args: argparse.Namespace) -> int:
    s = DemoSettings(seed=args.seed, opsd_steps=args.steps)
    run_dir = args.run_dir or Path("runs") / f"demo{'-control' if args.control else ''}-seed{args.seed}"
    r = run(s, run_dir, control=args.control, cache=args.cache)
    print(r)
    return 0
