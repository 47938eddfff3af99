"""The loss's options, declared and validated once, and the statistics it returns.

Light on purpose: ``opsd.config`` imports the option tuples from here, and ``import opsd.config``
must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from opsd.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

MODES = ("jsd", "topk", "sampled")
CLIP_MODES = ("none", "entry", "token", "scale")
# Whether a clip mode's gradient keeps, on every token, a descent direction of that token's unclipped
# divergence (``tests/loss/test_loss_descent.py``, the descent property). ``entry`` does not: a clipped
# entry loses its own term's gradient but keeps the softmax coupling from the others, so its logit is
# pushed down, and the clipped entries are those where the teacher is confident and the student is not.
KEEPS_DESCENT = {"none": True, "entry": False, "token": True, "scale": True}
REDUCTIONS = ("token", "sequence")


@dataclass(frozen=True)
class DistillSpec:
    """What to compute: divergence ``mode``, mixture ``beta``, ``temperature``, clipping, top-k, reduction.

    ``reduction`` is how the caller normalizes per-token weights (``token``: every response token of
    the optimizer step weighs the same; ``sequence``: each sequence averages its tokens first); the
    loss functions take the weights themselves. Invalid combinations raise :class:`UserError` at
    construction, before any compute is spent; :meth:`check_vocab` adds the check that needs V.
    """

    mode: str = "jsd"
    beta: float = 0.0
    temperature: float = 1.0
    clip_mode: str = "none"
    clip: float = 0.0
    topk: int = 0
    reduction: str = "token"
    # loss.end_token=floor: the end tokens whose total teacher probability is raised to the student's own
    # where it is lower (:func:`opsd.loss.reference.floor_end`); empty: the teacher as it is.
    end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"loss mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise UserError(f"beta must be in [0, 1], got {self.beta}")
        if not self.temperature > 0:
            raise UserError(f"temperature must be > 0, got {self.temperature}")
        if self.clip_mode not in CLIP_MODES:
            raise UserError(f"clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.clip_mode != "none" and not self.clip >= 0:
            raise UserError(f"clip must be >= 0 when clip_mode={self.clip_mode!r}, got {self.clip}")
        if self.clip_mode == "scale" and not self.clip > 0:
            raise UserError(
                f"clip must be > 0 when clip_mode='scale' (0 scales every gradient to 0), got {self.clip}"
            )
        if self.mode == "sampled" and self.clip_mode != "none":
            raise UserError("mode=sampled needs clip_mode=none (there is no per-entry divergence)")
        if self.mode == "topk" and self.topk < 1:
            raise UserError(f"mode=topk needs topk >= 1, got {self.topk}")
        if self.end_ids and self.mode != "jsd":
            raise UserError(
                f"loss.end_token=floor needs loss.mode=jsd (the full distributions), got mode={self.mode!r}"
            )
        if self.reduction not in REDUCTIONS:
            raise UserError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")

    def describe(self) -> str:
        """One line for a run's start: the divergence, the temperature, the clip and whether its
        gradient keeps a descent direction of every token's divergence (:data:`KEEPS_DESCENT`)."""
        what = {
            "jsd": f"jsd beta={self.beta}",
            "topk": f"topk {self.topk} beta={self.beta}",
            "sampled": "sampled",
        }
        clip = (
            "clip_mode=none" if self.clip_mode == "none" else f"clip_mode={self.clip_mode} clip={self.clip}"
        )
        if KEEPS_DESCENT[self.clip_mode]:
            keeps = "keeps descent on every token"
        else:
            keeps = "does not keep descent: a clipped entry's logit can be pushed away from the teacher"
        floor = ", the teacher's end-token mass floored at the student's" if self.end_ids else ""
        return f"{what[self.mode]} at T={self.temperature}, {clip}{floor} ({keeps})"

    def check_vocab(self, vocab_size: int) -> None:
        """The one check that needs the vocabulary size: top-k cannot exceed it."""
        if self.mode == "topk" and self.topk > vocab_size:
            raise UserError(f"topk={self.topk} exceeds the vocabulary size V={vocab_size}")


@dataclass
class LossStats:
    """Sums over tokens, so micro-batches and ranks can be added before dividing."""

    tokens: float = 0.0
    divergence: float = 0.0  # unclipped per-token divergence (sampled: log S(y) - log P(y))
    clipped: float = 0.0  # clipped tokens (token and scale modes) or entries (entry mode)
    clip_total: float = 0.0  # what ``clipped`` is a fraction of
    entropy_student: float = 0.0
    entropy_teacher: float = 0.0
    agree: float = 0.0  # teacher and student top-1 agree
    overlap: float = 0.0  # the teacher's mass on the two top-16 sets' intersection (opsd.loss.overlap)
    logprob_gap: float = 0.0  # sum over checked tokens of |rollout engine's log S(y) - trainer's log S(y)|
    logprob_tokens: float = 0.0  # tokens checked (0: no check this step)

    def add(self, other: LossStats) -> LossStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def materialize(self) -> LossStats:
        """Sums a kernel kept as device tensors while it walked its chunks, as floats, read back in
        one host synchronization (a ``float()`` per statistic per chunk stalled a GPU five times a chunk)."""
        import torch

        names = [f.name for f in fields(self) if torch.is_tensor(getattr(self, f.name))]
        if names:
            values = torch.stack([getattr(self, n).double().reshape(()) for n in names]).tolist()
            for name, value in zip(names, values):
                setattr(self, name, value)
        return self

    def as_tensor(self) -> Tensor:
        import torch

        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: Tensor) -> LossStats:
        return cls(*[float(x) for x in t.tolist()])

    def means(self) -> dict[str, float]:
        """Per-token means; ``logprob_gap`` only when tokens were checked."""
        n = max(self.tokens, 1.0)
        gap = {"logprob_gap": self.logprob_gap / self.logprob_tokens} if self.logprob_tokens else {}
        return gap | {
            "divergence": self.divergence / n,
            "clip_frac": self.clipped / max(self.clip_total, 1.0),
            "entropy_student": self.entropy_student / n,
            "entropy_teacher": self.entropy_teacher / n,
            "agreement": self.agree / n,
            "overlap_mass": self.overlap / n,
        }
