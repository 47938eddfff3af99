"""The sections of the training signal: the distillation ``loss``, its ``teacher``, and the
objectives' own (``grpo``, ``rlsd``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from opsd.config.base import Section
from opsd.errors import UserError
from opsd.loss.spec import CLIP_MODES, MODES, REDUCTIONS, DistillSpec


class LossConfig(Section):
    """The distillation loss between the student's and the teacher's next-token distributions.

    Which clip: `entry` (the paper's code) can turn a token's step away from its teacher. Forward KL,
    clip 0.05, teacher P = [0.6, 0.3, 0.1], student S = [0.2, 0.4, 0.4]: unclipped, the gradient on the
    student's logits is [-0.40, +0.10, +0.30] and one SGD step (lr 1) raises S's mass on the teacher's
    top token from 0.20 to 0.31; under `entry` that token's term (0.6 log 3 = 0.66) is clipped, it
    keeps the softmax coupling from the others, the gradient is [+0.08, -0.14, +0.06] and the mass
    falls to 0.18 (the step raises the token's divergence by 0.028 to first order); under `token` the
    token teaches nothing. `scale` and `none` step every token down its own divergence
    (tests/loss/test_loss.py, the descent property, which records `entry` as failing). The run's start
    prints the clip mode and whether it keeps descent. The default is `none`: on the arithmetic comparison
    of docs/studies/arith.md
    (SmolLM2-135M, 400 test problems) no clip and `scale` 0.05 both end at the base's 2.75%, and
    `entry` 0.05 falls below it (0.25% at step 20, -2.50 points [-4.18, -0.82]; from step 40 the
    student answers in one token); the demo's gain runs with no clip. The paper recipe
    (examples/qwen3-1.7b-reference.yaml) keeps `entry`."""

    mode: Literal[MODES] = Field(
        "jsd",
        description="jsd: the beta-mixture Jensen-Shannon divergence over the vocabulary; topk: the same "
        "over the teacher's top-k tokens; sampled: a reverse-KL estimate from the sampled token alone.",
    )
    beta: float = Field(
        0.0, ge=0, le=1, description="The mixture weight of jsd: 0 forward KL(P||S), 1 reverse KL(S||P)."
    )
    temperature: float | None = Field(
        None,
        gt=0,
        description="The temperature of both distributions; null: rollout.temperature (1 for greedy "
        "rollouts).",
    )
    clip_mode: Literal[CLIP_MODES] = Field(
        "none",
        description="entry: each vocabulary entry's term clamped at clip (no gradient past it; can turn a "
        "token's step away from the teacher, the paper's code); token: each token's divergence clamped (a "
        "clipped token teaches nothing); scale: each token's gradient scaled by min(1, clip / its "
        "divergence), the loss reported unclipped (bounds the step, keeps its direction); none: no clipping.",
    )
    clip: float = Field(0.05, ge=0, description="The clamp of clip_mode.")
    sft_coef: float = Field(
        0.0,
        ge=0,
        description="Add this times the token-mean SFT loss on each step's reference solutions (the "
        "solution the teacher reads, with its end token), logged as sft_loss; 0: none. An anchor for "
        "format and stopping.",
    )
    end_token: Literal["distill", "skip", "floor"] = Field(
        "distill",
        description="distill: the end tokens are distilled like any other; skip (objective=opsd): the end "
        "token that closes a stopped response weighs 0; floor (mode=jsd): at every response token the "
        "teacher's end-token mass is raised to the student's own where it is lower, the rest of its "
        "distribution scaled to fit, so that the loss never lowers the student's chance of ending. A "
        "teacher that reads the solution and sees a wrong answer would rather go on and correct it; the "
        "student, without the solution, learns that only as not stopping (docs/studies/arith.md).",
    )
    topk: int = Field(
        0, ge=0, description="mode=topk: the teacher's most likely tokens the loss is taken over."
    )
    reduction: Literal[REDUCTIONS] = Field(
        "token",
        description="token: every response token of a step weighs the same; sequence: each response "
        "averages its tokens first.",
    )
    chunk_size: int | None = Field(
        None,
        ge=1,
        description="Rows of logits computed at a time; null: 256 (fewer for a vocabulary over 262,144 "
        "tokens; 128 on a CPU with the HF engine).",
    )
    products: Literal["auto", "float32"] = Field(
        "auto",
        description="The dtype of the loss's matrix products: auto bf16 (accumulated in float32) where the "
        "model computes in bf16 on a device with bf16 matrix units, else float32; float32: always float32.",
    )

    @model_validator(mode="after")
    def _spec(self) -> LossConfig:
        # DistillSpec holds the combination rules (opsd/loss/spec.py); restating them here would drift.
        try:
            self.to_spec(1.0)
        except UserError as e:
            raise ValueError(str(e)) from None
        if self.end_token == "floor" and self.mode != "jsd":
            raise ValueError(
                f"end_token=floor needs mode=jsd (the full distributions), got mode={self.mode!r}"
            )
        return self

    def to_spec(self, rollout_temperature: float) -> DistillSpec:
        """The loss's spec; the temperature defaults to the rollout's sampling one (1.0 for greedy)."""
        return DistillSpec(
            mode=self.mode,
            beta=self.beta,
            temperature=self.temperature or rollout_temperature or 1.0,
            clip_mode=self.clip_mode,
            clip=self.clip,
            topk=self.topk,
            reduction=self.reduction,
        )


class TeacherConfig(Section):
    """The teacher whose next-token distributions the student is distilled towards."""

    mode: Literal["fixed", "ema", "live", "external"] = Field(
        "fixed",
        description="fixed: the initial model (with LoRA the base with the adapter off); ema: a moving "
        "average of the student; live: the current student, no gradient; external: another model.",
    )
    ema_decay: float = Field(
        0.999, gt=0, lt=1, description="mode=ema: each step the teacher keeps this share of its weights."
    )
    path: str | None = Field(
        None, description="mode=external: the teacher model (its tokenizer must be the student's)."
    )
    privileged: bool = Field(True, description="Put the reference solution in the teacher's prompt.")
    solution_source: Literal["own", "other", "wrong_answer"] = Field(
        "own",
        description="own: each problem's solution; other: the solution of the nearest following row whose "
        "solution differs, wrapping around (control B; refused when every row has the same one); "
        "wrong_answer: its own "
        "with the final answer (`#### N`, `\\boxed{N}`, the last worked line's result) replaced by N + 1, "
        "the gold answer unchanged; rows without a detectable final answer are refused and counted "
        "(data_report.json: wrong_answer_refused).",
    )
    frozen_copy: Literal["device", "cpu", "none"] = Field(
        "device",
        description="Full fine-tuning with mode=fixed: where the frozen copy lives, on the device or in "
        "CPU memory (under torchrun FSDP-sharded like the student either way); none: no copy.",
    )


class GRPOConfig(Section):
    """objective=grpo: the reinforcement-learning baseline on the same rollouts, data and loss kernel."""

    grader: str = Field(
        "math",
        description="The reward's grader: a name from opsd.grading.GRADERS (math, lenient, last_number, "
        "answer_is, contains, exact) or `package.module:function`.",
    )
    scale_rewards: bool = Field(
        False, description="Divide advantages by the group's standard deviation (off, as in Dr. GRPO)."
    )
    distill_coef: float = Field(
        0.0,
        ge=0,
        description="> 0: add this times the distillation loss against the configured, privileged teacher; "
        "0: GRPO alone, with no teacher and no solutions.",
    )
    tis_cap: float = Field(
        2.0,
        ge=0,
        description="Truncated importance sampling where the engine reports log-probs (vLLM): each token's "
        "weight times min(S(y) / the engine's S(y), tis_cap); 0: off, else >= 1.",
    )

    @field_validator("tis_cap")
    @classmethod
    def _tis_cap(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("must be 0 (off) or >= 1: a cap below 1 scales every gradient down")
        return v


class RLSDConfig(Section):
    """objective=rlsd: GRPO (the grpo section's grader, scaling and tis_cap) whose sign comes from the
    verifier's sequence advantage A, the privileged teacher reweighting only each token's magnitude (the
    OPSD authors' RLSD): w_t = clip(exp(sign(A) (log P(y_t) - log S(y_t))), 1 - epsilon_w, 1 + epsilon_w)
    at the loss temperature, and A_t = A ((1 - lambda) + lambda w_t). The teacher never turns a token's
    sign; logged as rlsd_lambda, rlsd_weight_mean and rlsd_weight_clip_frac."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, serialize_by_alias=True)

    lambda_: float = Field(
        0.5,
        ge=0,
        le=1,
        alias="lambda",
        description="The teacher's share of each token's advantage at the first step: 0 is GRPO, 1 the "
        "teacher's weight alone.",
    )
    lambda_decay_steps: int = Field(
        50,
        ge=0,
        description="The share falls linearly from lambda to 0 over this many optimizer steps, and the "
        "steps after are GRPO (the teacher still scores them); 0: it stays at lambda.",
    )
    epsilon_w: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Each token's teacher weight is clipped to [1 - epsilon_w, 1 + epsilon_w]: how far the "
        "teacher may scale one token's credit or blame.",
    )
