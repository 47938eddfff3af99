"""The demo's base model: a character-level tokenizer, a small Llama, and a brief SFT. Cached.

Copying from the context is learned long before adding is, so after SFT on a mix of bare problems and
problems with the worked solution in context the model reads the solution almost perfectly but adds
badly on its own: the imperfect student OPSD needs. See docs/demo.md.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from opsd.data import student_prompt_ids, teacher_prompt_ids
from opsd.demo.task import TEACHER_TEMPLATE, make_splits
from opsd.fetch import opsd_home

# Bump when the task or the base-model recipe changes: cached base models are keyed by it.
# 3: `opsd sft` uses opsd.optim's schedule (warmup, then cosine over the remaining steps).
RECIPE_VERSION = 3

# The settings a cached base model depends on (DemoSettings.base_key).
BASE_KEYS = (
    "seed",
    "digits",
    "hidden",
    "layers",
    "sft_steps",
    "sft_lr",
    "sft_batch",
    "sft_teacher_frac",
    "sft_min_lr_ratio",
    "n_sft",
    "n_train",
    "n_heldout",
)


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
    sft_min_lr_ratio: float = 0.0
    n_sft: int = 4000
    n_train: int = 4000
    n_heldout: int = 300
    opsd_steps: int = 300
    opsd_lr: float = 2e-3
    opsd_warmup: int = 10
    prompts_per_step: int = 64
    temperature: float = 1.0
    eval_every: int = 25
    grpo_n: int = 8  # `opsd demo --compare`: GRPO's samples per problem
    grpo_lr: float = 5e-5  # and its learning rate: OPSD's 2e-3 collapses GRPO (docs/demo.md)

    def base_key(self) -> str:
        """Everything the base model depends on; a change means a rebuild, never a stale cache hit."""
        blob = json.dumps(
            {"version": RECIPE_VERSION, **{k: getattr(self, k) for k in BASE_KEYS}}, sort_keys=True
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer():
    """Character level: a byte-level BPE with no merges, so every digit is its own token."""
    from opsd.models import CHATML_SPECIAL_TOKENS
    from opsd.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(
        texts=["0123456789+= so Worked:"], vocab_size=256 + len(CHATML_SPECIAL_TOKENS)
    )


def prompt_ids(tok, row: dict, *, with_solution: bool) -> list[int]:
    """The prompts training uses: the student's (problem only) or the teacher's (problem + worked
    solution)."""
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
    from opsd.sft import sft
    from opsd.tiny import build_tiny_model

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
            min_lr_ratio=s.sft_min_lr_ratio,
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
