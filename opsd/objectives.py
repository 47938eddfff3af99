"""What varies per training objective, behind one small interface the trainer's step calls.

- :class:`Distillation` (``objective: opsd``): the student matches the privileged teacher's
  next-token distribution at each of its own tokens (the fused divergence kernels).
- :class:`GRPO` (``objective: grpo``): the RL baseline, ``-A log S(y)`` with group-relative reward
  advantages. With ``grpo.distill_coef > 0`` it adds that coefficient times the distillation loss
  against the configured (privileged) teacher: reward and distillation together, as slime's
  ``--opd-kl-coef`` and verl's distillation coefficient do.
- :class:`RLSD` (``objective: rlsd``): GRPO whose sign the verifier sets, each token's magnitude
  reweighted by the privileged teacher (the OPSD authors' ``rlsd_trainer.py``).
- :class:`SFT` (``objective: sft``): supervised fine-tuning on the reference solutions, which the
  step's queue hands it in place of rollouts (:class:`opsd.rollout.queue.SolutionQueue`); no teacher.

An objective says what it needs (``uses_teacher``: the teacher scores every micro-batch;
``needs_answers``: rows must carry a gradable answer), reads the step's rollouts once
(:meth:`score`: advantages and metric sums), computes each micro-batch's loss (:meth:`loss`) and
turns the all-reduced sums into metrics (:meth:`metrics`). The trainer holds no objective branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from opsd.loss import (
    LossStats,
    fused_linear_distill,
    fused_linear_policy_gradient,
    paired_token_logprobs,
    token_logprobs,
)
from opsd.loss.spec import DistillSpec
from opsd.rewards import flat_group_fraction, group_advantages, make_reward

if TYPE_CHECKING:
    from opsd.config import Config
    from opsd.data.batching import MicroBatch
    from opsd.rollout import Completion


@dataclass
class Scores:
    """What an objective read from one step's rollouts on this rank: an advantage per sample (each
    non-empty response, in order) and the sums its metrics are made of (summed over ranks)."""

    advantages: list[float] | None = None
    sums: dict[str, float] = field(default_factory=dict)
    teacher_share: float = 0.0  # RLSD: the step's lambda, the teacher's share of each token's advantage


class Objective(Protocol):
    uses_teacher: bool
    needs_answers: bool

    def score(
        self, completions: list[Completion], answers: list[str], decode: Callable, *, step: int
    ) -> Scores: ...

    def loss(
        self,
        s_hidden: Tensor,
        t_hidden: Tensor | None,
        t_head: Tensor | None,
        mb: MicroBatch,
        scores: Scores,
        *,
        head: Tensor,
        matmul_dtype: torch.dtype | None,
    ) -> tuple[Tensor, LossStats]: ...

    def metrics(self, sums: dict[str, float]) -> dict[str, float]: ...


class PerToken:
    """An objective that reads nothing from the step's rollouts as a whole (no rewards, no groups) and
    adds no metrics of its own: its loss is all per token."""

    def score(
        self, completions: list[Completion], answers: list[str], decode: Callable, *, step: int
    ) -> Scores:
        return Scores()

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {}


@dataclass
class Distillation(PerToken):
    """On-policy self-distillation: the divergence of :class:`DistillSpec` against the teacher's
    hidden states, a chunk of logits at a time. ``sampling_temperature``: the rollout's, which the
    engine's log-probs (``rollout.logprob_check``) are tempered by."""

    spec: DistillSpec
    chunk_size: int | None
    sampling_temperature: float
    slab_elements: int | None = None  # the CPU plan's (opsd.cpu.CpuPlan.loss_slab_elements)
    uses_teacher: bool = True
    needs_answers: bool = False

    def loss(self, s_hidden, t_hidden, t_head, mb, scores, *, head, matmul_dtype):
        # The check's log S(y) comes from the loss's own logits when they are tempered alike.
        same_t = self.spec.temperature == self.sampling_temperature
        mine = None
        if mb.rollout_logprobs is not None and same_t:
            mine = torch.full_like(mb.rollout_logprobs, float("nan"))
        loss, stats = fused_linear_distill(
            s_hidden,
            head,
            t_hidden,
            t_head,
            mb.weights,
            mb.targets,
            self.spec,
            chunk_size=self.chunk_size,
            slab_elements=self.slab_elements,
            matmul_dtype=matmul_dtype,
            target_logprobs=mine,
        )
        check_rollout_logprobs(stats, mb, s_hidden, head, mine, self.sampling_temperature, self.chunk_size)
        return loss, stats


@dataclass
class GRPO:
    """Group-relative policy gradient from graded rewards (fully on-policy: one optimizer step per
    rollout batch, so no importance ratio), plus ``distill_coef`` times :class:`Distillation`'s
    loss when it is positive (the teacher then scores every micro-batch, with privileged context)."""

    reward: Callable[[str, str], float]
    scale_rewards: bool
    temperature: float
    chunk_size: int | None
    distill: Distillation
    distill_coef: float = 0.0
    tis_cap: float = 0.0
    needs_answers: bool = True

    @property
    def uses_teacher(self) -> bool:
        return self.distill_coef > 0

    def score(
        self, completions: list[Completion], answers: list[str], decode: Callable, *, step: int
    ) -> Scores:
        """Each response's reward (its grade against its problem's answer) minus its group's mean, one
        per sample; the sums of the step's mean reward and flat-group fraction."""
        rewards = [self.reward(decode(c.token_ids), answers[c.prompt_index]) for c in completions]
        groups = [c.prompt_index for c in completions]
        adv = group_advantages(rewards, groups, scale=self.scale_rewards)
        n_groups = len(set(groups))
        sums = {
            "reward_sum": sum(rewards),
            "reward_count": len(rewards),
            "flat_groups": flat_group_fraction(rewards, groups) * n_groups,
            "groups": n_groups,
        }
        return Scores([a for a, c in zip(adv, completions) if c.token_ids], sums)

    def token_advantages(self, mb: MicroBatch, scores: Scores) -> Tensor:
        """Each token's response advantage, in the micro-batch's row order (zeros for a zero-weight
        padding micro-batch: torchrun gives every rank as many, each with one dummy row)."""
        if not mb.sample_indices:
            return torch.zeros_like(mb.weights)
        lens = zip(mb.sample_indices, mb.response_lens)
        return mb.weights.new_tensor([scores.advantages[i] for i, n in lens for _ in range(n)])

    def policy_gradient(
        self, s_hidden: Tensor, head: Tensor, mb: MicroBatch, adv: Tensor, mine: Tensor | None = None
    ) -> tuple[Tensor, LossStats, Tensor | None]:
        """``-sum w A log S(y)`` over the micro-batch with per-token advantages ``adv``, and the trainer's
        ``log S(y)`` at the sampling temperature where truncated importance sampling read it (``mine``:
        those values already at hand, every row finite)."""
        coef = mb.weights * adv
        if self.tis_cap and mb.rollout_logprobs is not None:
            # The engine sampled from its own policy (one step older with rollout.overlap, and other
            # kernels): weigh each token by min(S(y) / S_engine(y), cap), as verl and slime do.
            if mine is None:
                t = self.distill.sampling_temperature
                mine = token_logprobs(s_hidden, head, mb.targets, temperature=t, chunk_size=self.chunk_size)
            ratio = (mine - mb.rollout_logprobs).exp().clamp(max=self.tis_cap)
            coef = coef * ratio.to(coef.dtype)
        loss, stats = fused_linear_policy_gradient(
            s_hidden,
            head,
            mb.targets,
            coef,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
        )
        return loss, stats, mine

    def loss(self, s_hidden, t_hidden, t_head, mb, scores, *, head, matmul_dtype):
        loss, stats, mine = self.policy_gradient(s_hidden, head, mb, self.token_advantages(mb, scores))
        if not self.uses_teacher:
            t = self.distill.sampling_temperature
            check_rollout_logprobs(stats, mb, s_hidden, head, mine, t, self.chunk_size)
            return loss, stats
        # The distillation term's statistics (divergence, clipping, agreement) are the step's.
        distill_loss, stats = self.distill.loss(
            s_hidden, t_hidden, t_head, mb, scores, head=head, matmul_dtype=matmul_dtype
        )
        return loss + self.distill_coef * distill_loss, stats

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {
            "reward_mean": sums["reward_sum"] / max(1.0, sums["reward_count"]),
            "flat_group_frac": sums["flat_groups"] / max(1.0, sums["groups"]),
        }


def rlsd_token_advantages(adv: Tensor, log_ratio: Tensor, lam: float, epsilon: float) -> Tensor:
    """RLSD's token advantages ``A_t = A ((1 - lam) + lam w_t)``, ``w_t = clip(exp(sign(A) log_ratio_t),
    1 - epsilon, 1 + epsilon)``, with ``A`` each token's sequence advantage and ``log_ratio`` the teacher's
    ``log P(y_t)`` minus the student's ``log S(y_t)``.

    The verifier alone sets the sign; the teacher only scales each token's share of it, within
    ``1 +- epsilon``: in a rewarded response the tokens the teacher finds likelier than the student does
    get more credit, in a penalized one the tokens it finds less likely get more blame. Rows where
    ``A = 0`` give 0 whatever ``log_ratio`` is (NaN included: a row the loss does not read)."""
    w = (adv.sign() * log_ratio).exp().clamp(1 - epsilon, 1 + epsilon)
    credit = adv * ((1 - lam) + lam * w)
    return torch.where(adv != 0, credit, torch.zeros_like(credit))


@dataclass
class RLSD:
    """Reward-signed teacher credit (RLSD, ``objective: rlsd``): :class:`GRPO`'s loss, grading and group
    advantages, with each token's advantage reweighted by the privileged teacher
    (:func:`rlsd_token_advantages`); the teacher's share ``lam`` falls linearly to 0 over
    ``decay_steps`` optimizer steps (0: it stays), after which the step is plain GRPO.

    The teacher scores every micro-batch (with privileged context); the step's statistics (divergence
    as the sampled estimate, agreement, overlap) are the teacher's against the student on its own
    tokens, at the loss temperature."""

    grpo: GRPO
    lam: float
    decay_steps: int
    epsilon: float
    uses_teacher: bool = True
    needs_answers: bool = True

    def teacher_share(self, step: int) -> float:
        """``lam`` at optimizer step ``step`` (0 the first)."""
        if not self.decay_steps:
            return self.lam
        return self.lam * max(0.0, 1.0 - step / self.decay_steps)

    def score(
        self, completions: list[Completion], answers: list[str], decode: Callable, *, step: int
    ) -> Scores:
        """GRPO's scores, the step's teacher share and the sums the loss adds its weights to (every
        rank holds the same keys in the same order: the metrics are one all-reduce)."""
        scores = self.grpo.score(completions, answers, decode, step=step)
        scores.teacher_share = self.teacher_share(step)
        scores.sums |= {"rlsd_lambda": scores.teacher_share, "rlsd_ranks": 1.0}
        scores.sums |= {"rlsd_weight_sum": 0.0, "rlsd_weight_clipped": 0.0, "rlsd_weight_tokens": 0.0}
        return scores

    def credit(
        self, s_hidden: Tensor, t_hidden: Tensor, t_head: Tensor, mb: MicroBatch, scores: Scores, head: Tensor
    ) -> tuple[Tensor, Tensor, LossStats]:
        """Each token's advantage, the student's ``log S(y)`` at the loss temperature (NaN on rows of
        weight 0) and the teacher-student statistics; the weights' sums go into ``scores.sums``."""
        g = self.grpo
        t = g.temperature
        log_s, log_p, stats = paired_token_logprobs(
            s_hidden, head, t_hidden, t_head, mb.targets, mb.weights, temperature=t, chunk_size=g.chunk_size
        )
        adv = g.token_advantages(mb, scores).to(log_s.dtype)
        log_ratio = log_p - log_s
        credit = rlsd_token_advantages(adv, log_ratio, scores.teacher_share, self.epsilon)
        credit = credit.masked_fill(mb.weights == 0, 0.0)  # rows the pass skipped hold NaN
        read = (adv != 0) & (mb.weights != 0)
        w = (adv.sign() * log_ratio)[read].exp()
        scores.sums["rlsd_weight_sum"] += float(w.clamp(1 - self.epsilon, 1 + self.epsilon).sum())
        scores.sums["rlsd_weight_clipped"] += float(((w < 1 - self.epsilon) | (w > 1 + self.epsilon)).sum())
        scores.sums["rlsd_weight_tokens"] += float(read.sum())
        return credit, log_s, stats

    def loss(self, s_hidden, t_hidden, t_head, mb, scores, *, head, matmul_dtype):
        g = self.grpo
        credit, log_s, stats = self.credit(s_hidden, t_hidden, t_head, mb, scores, head)
        t = g.distill.sampling_temperature
        # The loss temperature's log S(y) serves the importance ratio and the check where they agree.
        mine = log_s if g.temperature == t and not bool(log_s.isnan().any()) else None
        loss, _, mine = g.policy_gradient(s_hidden, head, mb, credit.to(mb.weights.dtype), mine)
        check_rollout_logprobs(stats, mb, s_hidden, head, mine, t, g.chunk_size)
        return loss, stats

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(1.0, sums["rlsd_weight_tokens"])
        return self.grpo.metrics(sums) | {
            "rlsd_lambda": sums["rlsd_lambda"] / max(1.0, sums["rlsd_ranks"]),
            "rlsd_weight_mean": sums["rlsd_weight_sum"] / tokens,
            "rlsd_weight_clip_frac": sums["rlsd_weight_clipped"] / tokens,
        }


def solution_cross_entropy(
    s_hidden: Tensor, head: Tensor, mb: MicroBatch, chunk_size: int | None = None
) -> tuple[Tensor, LossStats]:
    """The SFT loss on one micro-batch of reference solutions: ``-sum w log S(y)``, which with the
    batching layer's weights (1 over the global token count) is the token-mean cross-entropy; the
    fused head kernel, so no ``[tokens, vocab]`` logits. :class:`SFT` and the SFT anchor
    (:mod:`opsd.anchor`) both take it."""
    return fused_linear_policy_gradient(s_hidden, head, mb.targets, mb.weights, chunk_size=chunk_size)


@dataclass
class SFT(PerToken):
    """Supervised fine-tuning (``objective: sft``): the token-mean cross-entropy of each drawn row's
    reference solution, its end token included (:func:`solution_cross_entropy`). The responses are the
    solutions themselves, so nothing is generated for training and no teacher scores them."""

    chunk_size: int | None = None
    uses_teacher: bool = False
    needs_answers: bool = False

    def loss(self, s_hidden, t_hidden, t_head, mb, scores, *, head, matmul_dtype):
        return solution_cross_entropy(s_hidden, head, mb, self.chunk_size)


def check_rollout_logprobs(
    stats: LossStats,
    mb: MicroBatch,
    s_hidden: Tensor,
    head: Tensor,
    mine: Tensor | None,
    temperature: float,
    chunk_size: int | None,
) -> None:
    """The train/inference mismatch: the engine's log S(y) against the trainer's, summed into
    ``stats``. ``mine``: the trainer's values if a loss kernel already filled them (rows it skipped,
    at weight 0, stay NaN and are recomputed here with one more head product)."""
    if mb.rollout_logprobs is None:
        return
    if mine is None or bool(mine.isnan().any()):
        mine = token_logprobs(s_hidden, head, mb.targets, temperature=temperature, chunk_size=chunk_size)
    stats.logprob_gap = float((mine - mb.rollout_logprobs).abs().sum())
    stats.logprob_tokens = float(mine.numel())


def make_distillation(cfg: Config, chunk_size: int | None, slab_elements: int | None = None) -> Distillation:
    """The loss section as a :class:`Distillation` (OPSD's objective, GRPO's distillation term and the
    held-out divergence); ``chunk_size``: ``loss.chunk_size`` or the CPU plan's, ``slab_elements``: the
    CPU plan's."""
    return Distillation(
        spec=cfg.loss.to_spec(cfg.rollout.temperature),
        chunk_size=chunk_size,
        sampling_temperature=cfg.rollout.temperature,
        slab_elements=slab_elements,
    )


def floor_end_tokens(objective: Objective, end_ids: tuple[int, ...]) -> Objective:
    """``objective`` with ``loss.end_token=floor``'s end tokens in its distillation's spec
    (:func:`opsd.loss.reference.floor_end`): they are known only once the tokenizer and the model
    are, after the objective is built."""
    if isinstance(objective, Distillation):
        return replace(objective, spec=replace(objective.spec, end_ids=end_ids))
    if isinstance(objective, RLSD):
        return replace(objective, grpo=floor_end_tokens(objective.grpo, end_ids))
    if isinstance(objective, SFT):  # no distillation term to floor
        return objective
    return replace(objective, distill=floor_end_tokens(objective.distill, end_ids))


def make_objective(cfg: Config, chunk_size: int | None, slab_elements: int | None = None) -> Objective:
    """``cfg.objective`` as an object, its options bound once (``chunk_size``, ``slab_elements``: as
    :func:`make_distillation` takes them)."""
    if cfg.objective == "sft":
        return SFT(chunk_size)
    distill = make_distillation(cfg, chunk_size, slab_elements)
    if cfg.objective == "opsd":
        return distill
    grpo = GRPO(
        reward=make_reward(cfg.grpo.grader),
        scale_rewards=cfg.grpo.scale_rewards,
        temperature=distill.spec.temperature,
        chunk_size=chunk_size,
        distill=distill,
        distill_coef=cfg.grpo.distill_coef if cfg.objective == "grpo" else 0.0,
        tis_cap=cfg.grpo.tis_cap,
    )
    if cfg.objective == "grpo":
        return grpo
    r = cfg.rlsd
    return RLSD(grpo, lam=r.lambda_, decay_steps=r.lambda_decay_steps, epsilon=r.epsilon_w)
