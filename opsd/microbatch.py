"""The micro-batch loop of a step: per micro-batch, the teacher scores the response (no grad), the
student reads it, the loss, backward. The trainer's step and the held-out divergence run it; no other
copy of this loop exists."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from opsd import metrics
from opsd.loss import LossStats
from opsd.objectives import Scores
from opsd.parallel import forward_hidden
from opsd.teacher import Teacher


def forward_backward(
    model,
    teacher: Teacher | None,
    batches: list,
    loss_fn,
    *,
    scores: Scores | None = None,
    autocast=nullcontext,
    timer=None,
    backward: bool = True,
) -> tuple[Tensor, LossStats]:
    """The micro-batch loop of a step: per micro-batch, the teacher's hidden states (no grad) -> the
    student's -> ``loss_fn(s_hidden, t_hidden, t_head, mb, scores)`` -> backward. Returns the summed
    loss (float64, this rank's) and the loss statistics. ``backward=False`` computes the same numbers
    without gradients (held-out divergence); ``teacher=None``: an objective without a teacher (GRPO
    alone); ``scores``: what the objective read from the rollouts, handed to ``loss_fn``;
    ``autocast``: a context for the forwards (one process's bf16 compute)."""
    timer = timer or metrics.StepTimer(sync=False)
    loss_sum = torch.zeros((), dtype=torch.float64)
    stats = LossStats()
    with torch.enable_grad() if backward else torch.no_grad():
        for mb in batches:
            t_hidden, t_head = None, None
            if teacher is not None:
                with timer("teacher"), autocast():
                    t_hidden, t_head = teacher.score(
                        mb.teacher_ids, mb.teacher_mask, mb.teacher_pos, mb.teacher_rows
                    )
            with timer("student"), autocast():
                s_hidden = forward_hidden(
                    model, mb.student_ids, mb.student_mask, mb.student_pos, mb.student_rows
                )
            with timer("loss"):
                loss, st = loss_fn(s_hidden, t_hidden, t_head, mb, scores)
            if backward:
                with timer("student"):
                    loss.backward()
            loss_sum += loss.detach().double().cpu()
            # A zero-weight padding micro-batch adds nothing.
            stats.add(st if mb.sample_indices else LossStats())
    if teacher is not None:
        # A sharded teacher network never runs backward, when FSDP would free its root.
        teacher.release()
    return loss_sum, stats
