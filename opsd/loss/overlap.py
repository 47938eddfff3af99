"""The overlap mass of the teacher's and the student's top-k sets: a cheap health metric of distillation.

arXiv 2604.13016 finds that successful on-policy distillation keeps 97-99% of the teacher's probability
on the tokens both models rank in their top 16; a mass that falls says the two distributions are
parting where the student samples. The loss kernels compute it per chunk beside the top-1 agreement
(``LossStats.overlap``), and ``opsd probe`` per response: one definition for both.
"""

from __future__ import annotations

import torch
from torch import Tensor

OVERLAP_K = 16  # the top-k of the overlap mass (arXiv 2604.13016: successful OPD keeps 97-99% there)


@torch.no_grad()
def topk_overlap_mass(student_logits: Tensor, teacher_logprobs: Tensor, k: int = OVERLAP_K) -> Tensor:
    """Per row, the teacher's probability mass on the intersection of the two top-``k`` token sets.

    ``student_logits``: ``[N, V]`` tempered logits or log-probabilities (a shift per row leaves the
    top-k as it is); ``teacher_logprobs``: ``[N, V]`` normalized log-probabilities at the same
    temperature. Only ``[N, k]`` blocks are made beside the inputs: the two top-k and a ``[N, k, k]``
    comparison, no ``[N, V]`` mask. Returns ``[N]`` values in ``[0, 1]``.
    """
    k = min(k, student_logits.shape[-1])
    mine = student_logits.topk(k, dim=-1).indices
    top_p, theirs = teacher_logprobs.topk(k, dim=-1)
    shared = (theirs[:, :, None] == mine[:, None, :]).any(-1)
    return (top_p.exp() * shared).sum(-1)
