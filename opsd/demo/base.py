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
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

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
    """Train the base model of ``s`` here (:func:`demo_sft`, the loop the shipped
    bases were written by); returns (tokenizer, model, SFT losses).

    Deterministic on one CPU with one torch thread; other CPUs' float32 kernels give other weights."""
    from opsd.tiny import build_tiny_model

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=s.hidden, num_layers=s.layers, seed=s.seed)
    rows = make_splits(s.seed, s.digits, s.n_sft, s.n_train, s.n_heldout)["sft"]
    pairs = sft_pairs(tok, rows, s.sft_teacher_frac, s.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        losses = demo_sft(model, pairs, s, pad_id=tok.pad_token_id, progress=progress)
    return tok, model.eval(), losses


# ----------------------------------------------------------------------------------------------
# The base's SFT loop (demo_sft's docstring: why it is the demo's own)


def _summed_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = 1024) -> Tensor:
    """Summed CE of ``hidden @ weight.T`` against ``targets``, in fp32, one chunk of logits at a time."""

    def piece(h: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy((h @ weight.t()).float(), y, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(piece, hidden[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
    return total


def _batch_loss(
    model: nn.Module, batch: list[tuple[list[int], list[int]]], pad_id: int, bucket: bool
) -> Tensor:
    """The token-mean cross-entropy of one batch's responses after their prompts."""
    from opsd.data.batching import pad_right, response_positions
    from opsd.models import final_hidden, head_weight

    device = next(model.parameters()).device
    seqs = [p + r for p, r in batch]
    ids, mask = pad_right(seqs, pad_id, device, bucket)
    resp = [len(r) for _, r in batch]
    pos = response_positions([len(s) for s in seqs], resp, ids.shape[1])
    targets = torch.tensor([t for _, r in batch for t in r], device=device)
    hidden = final_hidden(model, ids, mask, pos)
    return _summed_cross_entropy(hidden, head_weight(model), targets) / len(targets)


def demo_sft(
    model: nn.Module,
    pairs: list[tuple[list[int], list[int]]],
    s: DemoSettings,
    *,
    pad_id: int,
    progress: bool = True,
    warmup: int = 20,
    callback: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place on ``s.sft_batch`` random rows of ``pairs`` a step for ``s.sft_steps``
    steps at ``s.sft_lr`` (``warmup`` linear steps, then ``s.sft_schedule``: :func:`opsd.optim.lr_factor`,
    as `opsd train`'s), gradient norm clipped at 1; returns the per-step mean token loss.
    ``callback(step, loss)`` is called after every step.

    The demo base model's own SFT loop, kept apart from `opsd sft` (which trains through the trainer's
    ``objective: sft``) for one reason: the shipped bases (opsd/demo/bases/, checked by SHA-256) are the
    bytes this loop writes. Its batches (rows drawn with replacement from ``random.Random(seed)``), its
    padding and its cross-entropy (``F.cross_entropy`` on float32 logits, a chunk of rows at a time under
    activation checkpointing) are the float32 operations those files depend on; the trainer's solution
    cross-entropy (:func:`opsd.objectives.solution_cross_entropy`, the fused head kernel) and its data order
    round differently, so `scripts/build_demo_bases.py --check` would no longer reproduce them. A base
    trained afresh (any unshipped seed or recipe) uses it too, so that every base follows one recipe."""
    from opsd.config import OptimConfig
    from opsd.cpu import default_plan
    from opsd.optim import make_optimizer

    if not pairs:
        raise ValueError("sft: no (prompt, response) pairs to train on")
    params = [p for p in model.parameters() if p.requires_grad]
    optim = OptimConfig(lr=s.sft_lr, warmup_steps=warmup, max_steps=s.sft_steps, scheduler=s.sft_schedule)
    opt, sched = make_optimizer(params, optim)
    first = next(model.parameters())
    # Widths in buckets where the CPU's bf16 attention keeps a kernel per length (the CPU plan's).
    bucket = default_plan(first.device, first.dtype).row_widths().bucket
    rng = random.Random(s.seed)
    model.train()
    losses = []
    hide = None if progress else True
    bar = tqdm(
        range(s.sft_steps),
        desc="demo: SFT base model",
        disable=hide,
        leave=False,
        file=sys.stderr,
        unit="step",
    )
    for step in bar:
        loss = _batch_loss(
            model, [pairs[rng.randrange(len(pairs))] for _ in range(s.sft_batch)], pad_id, bucket
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        if callback is not None:
            callback(step + 1, losses[-1])
            model.train()
    return losses


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
