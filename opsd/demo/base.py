"""The demo's base model: a character-level tokenizer, a small Llama, and a brief SFT.

Copying from the context is learned long before adding is, so after SFT on a mix of bare problems and
problems with the worked solution in context the model reads the solution almost perfectly but adds
badly on its own: the imperfect student OPSD needs. See docs/demo.md.

The bases of the seeds in ``SHIPPED`` come with the package (``opsd/demo/bases/seedN.safetensors``,
written by scripts/build_demo_bases.py): the SFT amplifies the last bit of float32 rounding, which
differs between CPUs' vector paths, so a base trained afresh reads differently on every CPU. Those
seeds load the shipped weights (checked against the SHA-256 below); any other seed or recipe is
trained here and cached.
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
from opsd.errors import UserError
from opsd.fetch import opsd_home

# Bump when the task or the base-model recipe changes: cached base models are keyed by it.
# 3: `opsd sft` uses opsd.optim's schedule (warmup, then cosine over the remaining steps).
# 4: a constant SFT learning rate after the warmup (``sft_schedule``), 350 steps.
RECIPE_VERSION = 4

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
    "sft_schedule",
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
    sft_steps: int = 350
    sft_lr: float = 3e-3
    # "constant" after the warmup, not annealed: a base annealed to lr 0 sits where OPSD's first
    # AdamW steps throw it out (62% -> 5% in 5 steps at lr 2e-3, -11 points at 3e-4; docs/demo.md)
    sft_schedule: str = "constant"
    sft_batch: int = 64
    sft_teacher_frac: float = 0.5  # share of SFT rows with the worked solution in context
    n_sft: int = 4000
    n_train: int = 4000
    n_heldout: int = 300
    opsd_steps: int = 100
    # below the base's SFT rate (3e-3); 2e-3 also ends at 98% but swings by up to 19 points on the way
    opsd_lr: float = 1e-3
    opsd_warmup: int = 10
    prompts_per_step: int = 64
    temperature: float = 1.0
    eval_every: int = 10
    grpo_n: int = 8  # `opsd demo --compare`: GRPO's samples per problem
    grpo_lr: float = 5e-5  # and its learning rate: OPSD's collapses GRPO (docs/demo.md)

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


def train_base_model(s: DemoSettings, progress: bool = True):
    """Train the base model of ``s`` here (`opsd sft`'s loop); returns (tokenizer, model, SFT losses).

    Deterministic on one CPU with one torch thread; other CPUs' float32 kernels give other weights."""
    from opsd.sft import sft
    from opsd.tiny import build_tiny_model

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
            schedule=s.sft_schedule,
            batch_size=s.sft_batch,
            seed=s.seed,
            pad_id=tok.pad_token_id,
            progress=progress,
            desc="demo: SFT base model",
        )
    return tok, model.eval(), losses


# ----------------------------------------------------------------------------------------------
# Shipped bases

# Seed -> SHA-256 of opsd/demo/bases/seed{N}.safetensors, the base of DemoSettings(seed=N) as
# scripts/build_demo_bases.py wrote it (its docstring: how; docs/demo.md: on which CPU).
SHIPPED: dict[int, str] = {
    0: "a65181563e0b517dd0f14146510f3646295f6ecb026a51e537fb78bed61efdcb",
    1: "8c48d9715e5128834de09f222ccadb1a0da44585d573bfba0c1656ef1cb24f18",
    2: "f4dca17018a8f137612a081809fcff34fda8229181af83c3923e8f7cf047dc1f",
}
SHIPPED_DTYPE = torch.float16  # storage only: loaded into float32, the weights are these values exactly


def shipped_path(seed: int) -> Path:
    return Path(__file__).with_name("bases") / f"seed{seed}.safetensors"


def is_shipped(s: DemoSettings) -> bool:
    """Whether ``s`` asks for a shipped base: a seed in SHIPPED with every other base setting the default."""
    default = DemoSettings(seed=s.seed)
    return s.seed in SHIPPED and all(getattr(s, k) == getattr(default, k) for k in BASE_KEYS)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_shipped_weights(seed: int, path: Path | None = None) -> dict[str, torch.Tensor]:
    """The shipped state dict of ``seed`` in float32, after checking the file's SHA-256."""
    from safetensors.torch import load_file

    path = path or shipped_path(seed)
    if not path.is_file():
        raise UserError(f"the shipped demo base {path} is missing; reinstall opsd")
    got, want = file_sha256(path), SHIPPED[seed]
    if got != want:
        raise UserError(
            f"the shipped demo base {path} has SHA-256 {got[:16]}..., expected {want[:16]}...: the file is "
            "damaged or from another version; reinstall opsd, or rebuild it (scripts/build_demo_bases.py)"
        )
    return {k: v.float() for k, v in load_file(str(path)).items()}


def shipped_model(s: DemoSettings, path: Path | None = None):
    """(tokenizer, model) of a shipped base: the architecture from ``s``, the weights from the file."""
    from opsd.tiny import build_tiny_model

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=s.hidden, num_layers=s.layers, seed=s.seed)
    model.load_state_dict(load_shipped_weights(s.seed, path), strict=True)
    return tok, model.eval()


def build_base_model(s: DemoSettings, cache: Path | None = None, progress: bool = True) -> Path:
    """The imperfect student as an HF directory in the cache: the shipped weights for a shipped seed
    (no training), otherwise trained here (or loaded from the cache)."""
    shipped = is_shipped(s)
    # a shipped base is keyed by its file's hash too: another version's file never meets a stale copy
    name = f"base-{s.base_key()}" + (f"-shipped-{SHIPPED[s.seed][:12]}" if shipped else "")
    out = Path(cache or opsd_home() / "demo") / name
    if (out / "demo_base.json").is_file():  # written last: its presence means the directory is complete
        return out
    if shipped:
        tok, model = shipped_model(s)
        info = {"source": str(shipped_path(s.seed)), "sha256": SHIPPED[s.seed]}
    else:
        tok, model, losses = train_base_model(s, progress)
        info = {"source": "trained on this machine", "sft_loss_last": losses[-1]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{time.time_ns()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "demo_base.json").write_text(json.dumps({**asdict(s), **info}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
