"""Distillation losses between a student and a teacher next-token distribution.

Conventions (shared with the seed PR, the paper's code and TRL):

* ``S = softmax(z_s / T)``, ``P = softmax(z_t / T)``; the teacher is always a constant.
* ``mode="jsd"`` with ``beta`` in [0, 1]: ``M = (1-beta) S + beta P`` and
  ``JSD_beta = beta KL(P||M) + (1-beta) KL(S||M)``. The endpoints are special cases:
  ``beta=0`` is forward ``KL(P||S)``, ``beta=1`` is reverse ``KL(S||P)``.
* ``mode="topk"``: the same divergence over the teacher's top-k entries, both distributions
  renormalized over them. Entries outside the top-k get no gradient.
* ``mode="sampled"``: the sampled-token estimator. With ``A = log P(y) - log S(y)`` detached,
  ``loss = -A log S(y)``; its gradient with respect to ``z_s`` is ``A (S - onehot(y)) / T``.

Clipping (``clip_mode`` with value ``clip = tau``), and what it does to the gradient:

* ``"entry"`` (the paper's code): every vocabulary entry's pointwise term ``l_i`` is clamped at
  ``tau`` before the vocabulary sum. An entry with ``l_i > tau`` contributes ``tau`` and no
  gradient; the others keep theirs. Because forward-KL terms ``P_i log(P_i/S_i)`` can be
  negative, the clipped per-token loss can be negative.
* ``"token"`` (the seed PR): the vocabulary-summed divergence is clamped at ``tau``. A token
  whose divergence exceeds ``tau`` contributes ``tau`` and exactly zero gradient.
* ``"scale"``: each token's gradient is scaled by ``min(1, tau / D_t)``, ``D_t`` its divergence; the
  loss is reported unclipped. It bounds a token's step without turning it, so the step stays a
  descent direction of every token's divergence.
* ``"none"``.

``entry`` and ``token`` change the direction of a token's gradient or drop it; ``entry`` can turn it
*away* from the teacher: a clipped entry loses its own term's gradient but keeps the softmax coupling
from the others, so a logit where the teacher is confident and the student is not is pushed down
(``spec.KEEPS_DESCENT``; the counter-example is in docs/configuration.md).

Reduction is expressed by per-token ``weights``: ``loss = sum_n w_n L_n``. Normalizing the weights
by the *global* token count (``reduction="token"``) or by each sequence's length and the global
sequence count (``"sequence"``) makes gradient accumulation and data parallelism give the gradient
of one big batch; the batching layer computes them.

All options travel in one frozen :class:`DistillSpec` (``spec.py``), validated when it is built.
Two implementations, each a table keyed by mode:

* :func:`distill_loss_dense` (``reference.py``, ``DENSE``) -- the oracle: autograd over ``[N, V]``
  logits.
* :func:`fused_linear_distill` (``fused.py``; its chunk kernels, ``KERNELS``, in ``kernels.py``) --
  what training uses: takes final hidden states and lm_head weights, walks rows in chunks, never
  holds more than one chunk of logits per model, and computes analytic gradients (no autograd graph
  over ``[N, V]``).

The seed's vocab-parallel kernel (logits sharded over a tensor-parallel group) is not here: opsd
shards with FSDP2, whose gathered head is whole on every rank, so nothing would call it.

And the GRPO objective's :func:`fused_linear_policy_gradient` (``policy_gradient.py``), the
sampled-token kernel with a given advantage; and :func:`topk_overlap_mass` (``overlap.py``), the
teacher's mass on the two top-16 sets' intersection, which the kernels sum per chunk.

Only ``spec.py`` is imported eagerly (``opsd.config`` uses it and must not import torch); the
others load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from opsd.loss.spec import CLIP_MODES, KEEPS_DESCENT, MODES, REDUCTIONS, DistillSpec, LossStats

if TYPE_CHECKING:
    from opsd.loss.fused import auto_chunk_size, fused_linear_distill
    from opsd.loss.overlap import OVERLAP_K, topk_overlap_mass
    from opsd.loss.policy_gradient import fused_linear_policy_gradient, paired_token_logprobs, token_logprobs
    from opsd.loss.reference import distill_loss_dense, per_token_loss_dense

_LAZY = {
    "fused_linear_distill": "fused",
    "auto_chunk_size": "fused",
    "distill_loss_dense": "reference",
    "per_token_loss_dense": "reference",
    "fused_linear_policy_gradient": "policy_gradient",
    "token_logprobs": "policy_gradient",
    "paired_token_logprobs": "policy_gradient",
    "OVERLAP_K": "overlap",
    "topk_overlap_mass": "overlap",
}

__all__ = [
    "CLIP_MODES",
    "KEEPS_DESCENT",
    "MODES",
    "OVERLAP_K",
    "REDUCTIONS",
    "DistillSpec",
    "LossStats",
    "auto_chunk_size",
    "fused_linear_policy_gradient",
    "distill_loss_dense",
    "fused_linear_distill",
    "paired_token_logprobs",
    "per_token_loss_dense",
    "token_logprobs",
    "topk_overlap_mass",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"opsd.loss.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'opsd.loss' has no attribute {name!r}")
