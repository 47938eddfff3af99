"""The training configuration of `opsd train` (:class:`Config`): its top-level keys, one section per
part of the run, and the cross-section checks, all here (keys valid alone but not together, each check
naming the keys it reads). The commands' own schemas (:mod:`opsd.config.commands`) take the same
sections and the checks that apply to them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opsd.config.base import DeviceSetting, Section
from opsd.config.cpu import CpuTuning
from opsd.config.data import DataConfig
from opsd.config.eval import EvalConfig, GuardConfig
from opsd.config.loss import GRPOConfig, LossConfig, RLSDConfig, TeacherConfig
from opsd.config.model import ModelConfig
from opsd.config.optim import CheckpointConfig, LoggingConfig, OptimConfig, ParallelConfig
from opsd.config.rollout import RolloutConfig


class RunKeys(Section):
    """The top-level keys every command's configuration shares: the seed and the device."""

    seed: int = Field(0, description="Seeds the data order, LoRA's initial weights and sampling.")
    device: DeviceSetting = Field(
        "auto",
        description="auto, cpu, cuda or cuda:N; auto: CUDA where available (under torchrun each rank's own "
        "GPU), else the CPU.",
    )


class Config(RunKeys):
    """The training configuration of `opsd train`: the keys below, and one section per part of the run."""

    objective: Literal["opsd", "grpo", "rlsd", "sft"] = Field(
        "opsd",
        description="opsd: on-policy self-distillation; grpo: the RL baseline (same rollouts, data and loss "
        "kernel); rlsd: GRPO with each token's advantage reweighted by the privileged teacher (the rlsd "
        "section); sft: supervised fine-tuning on each drawn row's data.solution_key with its end token "
        "(a GSM8K `#### N` ending written as \\boxed{N}), the loss.reduction mean of its cross-entropy, "
        "rollout.prompts_per_step rows a step; nothing is generated but the held-out evaluation and no "
        "teacher scores.",
    )
    grpo: GRPOConfig = GRPOConfig()
    rlsd: RLSDConfig = RLSDConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    loss: LossConfig = LossConfig()
    teacher: TeacherConfig = TeacherConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    guard: GuardConfig = GuardConfig()
    parallel: ParallelConfig = ParallelConfig()
    cpu: CpuTuning = CpuTuning()

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        """Keys that are valid alone but not together, refused when the config loads rather than
        minutes into a run (:func:`check_combinations`)."""
        check_combinations(self)
        return self

    def reads_teacher(self) -> bool:
        """Whether the objective runs the teacher on the rollouts (GRPO only with a distillation term)."""
        return self.objective in ("opsd", "rlsd") or (self.objective == "grpo" and self.grpo.distill_coef > 0)


def check_combinations(cfg: Config) -> None:
    """Every cross-section check of `opsd train`'s configuration, in the order a reader meets them."""
    if not cfg.data.path:
        raise ValueError(
            "data.path is required: a JSONL/JSON/Parquet/CSV file, a saved dataset dir or a hub name"
        )
    check_teacher(cfg)
    check_objective(cfg)
    check_horizon(cfg.rollout)
    check_reuse(cfg)
    check_overlap(cfg)
    check_engine(cfg.rollout)
    check_eval(cfg)


def check_teacher(cfg: Config) -> None:
    """The teacher needs memory for a frozen copy, and a path only when it is another model."""
    t = cfg.teacher
    if t.mode == "fixed" and not cfg.model.lora.enabled and t.frozen_copy == "none":
        raise ValueError(
            "teacher.mode=fixed with full fine-tuning needs a frozen copy of the initial model, but "
            "teacher.frozen_copy=none leaves no memory for it: use model.lora.enabled=true (the "
            "teacher is then the base model with the adapter disabled), teacher.frozen_copy=cpu, "
            "or teacher.mode=live/ema"
        )
    if t.mode == "external" and not t.path:
        raise ValueError("teacher.mode=external needs teacher.path (the teacher model)")
    if t.mode != "external" and t.path:
        raise ValueError(f"teacher.path is only used with teacher.mode=external, not {t.mode!r}")


def check_objective(cfg: Config) -> None:
    """What each objective grades against or reads: groups, answers and reference solutions."""
    t = cfg.teacher
    if cfg.objective in ("grpo", "rlsd"):
        if cfg.rollout.n < 2:
            raise ValueError(
                f"objective={cfg.objective} needs rollout.n >= 2 (advantages are relative to a group)"
            )
        if not cfg.data.answer_key:
            raise ValueError(
                f"objective={cfg.objective} needs data.answer_key (the field the reward is graded against)"
            )
    if cfg.objective == "rlsd" and cfg.grpo.distill_coef > 0:
        raise ValueError(
            "grpo.distill_coef adds a distillation term to objective=grpo; objective=rlsd's teacher "
            "reweights the advantages instead: set it to 0"
        )
    if cfg.objective == "sft":
        check_sft(cfg)
    elif cfg.data.sft_targets == "teacher":
        raise ValueError("data.sft_targets=teacher chooses objective=sft's targets: set objective=sft")
    if cfg.reads_teacher() and t.privileged and cfg.data.solution_key is None:
        raise ValueError(
            "teacher.privileged=true needs data.solution_key (the field holding the reference solution)"
        )
    if cfg.loss.sft_coef > 0 and not (t.privileged and cfg.data.solution_key):
        raise ValueError(
            "loss.sft_coef > 0 trains on the reference solutions: it needs data.solution_key and "
            "teacher.privileged=true"
        )


def check_sft(cfg: Config) -> None:
    """objective=sft trains on each row's own target, drawn rather than generated."""
    r = cfg.rollout
    d = cfg.data
    if d.solution_key is None and (d.target_key is None or d.sft_targets == "teacher"):
        raise ValueError(
            "objective=sft trains on the reference solutions (or, with data.sft_targets=teacher, on the "
            "teacher's answers reading them): it needs data.solution_key, or data.target_key"
        )
    if cfg.teacher.solution_source != "own":
        raise ValueError(
            "objective=sft trains on each row's own solution: teacher.solution_source must be own"
        )
    if cfg.loss.sft_coef > 0:
        raise ValueError("objective=sft is the SFT loss itself: loss.sft_coef would add it twice; set 0")
    if r.overlap or r.reuse.refresh_every is not None:
        raise ValueError(
            "objective=sft generates no rollouts: rollout.overlap and rollout.reuse do not apply"
        )


def check_horizon(r: RolloutConfig) -> None:
    """``rollout.horizon``: a well-formed ramp that ends within the engine's context."""
    h = r.horizon
    if h is None:
        return
    if set(h) != {"start", "end", "over_steps"} or not 1 <= h["start"] <= h["end"] or h["over_steps"] < 1:
        raise ValueError(
            f"rollout.horizon={h}: expected {{start: N, end: M, over_steps: K}} with 1 <= N <= M and K >= 1"
        )
    if h["end"] > r.max_new_tokens:
        raise ValueError(
            f"rollout.horizon.end={h['end']} exceeds rollout.max_new_tokens={r.max_new_tokens} (the "
            "engine's context is sized by max_new_tokens)"
        )


def check_reuse(cfg: Config) -> None:
    """``rollout.reuse``: a schedule that can run, and a policy gradient weighed for its older responses."""
    r = cfg.rollout
    u = r.reuse
    if u.refresh_every is not None and r.overlap:
        raise ValueError("rollout.reuse generates ahead at refresh steps: it needs rollout.overlap=0")
    if u.refresh_below_agreement is not None and u.refresh_every is None:
        raise ValueError(
            "rollout.reuse.refresh_below_agreement needs rollout.reuse.refresh_every (inf: refresh "
            "only when the agreement drops)"
        )
    if u.replay and (u.refresh_every in (None, "inf") or u.refresh_below_agreement is not None):
        raise ValueError(
            f"rollout.reuse.replay=true trains K steps on each refresh's batch: it needs a finite "
            f"rollout.reuse.refresh_every (got {u.refresh_every}) and no refresh_below_agreement"
        )
    if u.refresh_below_agreement is not None and not cfg.reads_teacher():
        raise ValueError(
            "rollout.reuse.refresh_below_agreement reads the teacher-student agreement: objective=grpo "
            "measures none without grpo.distill_coef > 0"
        )
    policy_gradient = cfg.objective in ("grpo", "rlsd")
    if u.refresh_every not in (None, 1) and policy_gradient and not (cfg.grpo.tis_cap and r.plain_sampling()):
        raise ValueError(
            f"rollout.reuse with objective={cfg.objective} trains the policy gradient on an older "
            "student's responses: it needs grpo.tis_cap >= 1 (each token weighed by min(S / S_engine, "
            "cap)) and log-probs to weigh by (rollout.temperature > 0, top_k=0, top_p=1)"
        )


def check_overlap(cfg: Config) -> None:
    """``rollout.overlap``: separate servers, and log-probs to correct the lag by where GRPO weighs it."""
    r = cfg.rollout
    if r.overlap and r.engine != "vllm_server":
        raise ValueError("rollout.overlap=1 needs rollout.engine=vllm_server (separate servers)")
    corrected = cfg.objective in ("grpo", "rlsd") and cfg.grpo.tis_cap
    if r.overlap and corrected and not r.checks_logprobs(r.engine):
        raise ValueError(
            f"rollout.overlap=1 with objective={cfg.objective} corrects the lag from the engine's "
            "log-probs, which need rollout.temperature > 0, top_k=0 and top_p=1 (or set grpo.tis_cap=0 "
            "to train uncorrected)"
        )


def check_engine(r: RolloutConfig) -> None:
    """The engine's own keys: servers to reach, log-probs to compare, ranks to share it."""
    if r.engine == "vllm_server" and not r.servers:
        raise ValueError("rollout.engine=vllm_server needs rollout.servers: [http://HOST:PORT, ...]")
    bad = [s for s in r.servers if not s.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"rollout.servers: {bad[0]!r} is not a URL (http://HOST:PORT)")
    if r.logprob_check is True and not r.plain_sampling():
        raise ValueError(
            "rollout.logprob_check=true needs rollout.temperature > 0, top_k=0 and top_p=1 (with "
            f"temperature={r.temperature}, top_k={r.top_k}, top_p={r.top_p} the log-probs differ "
            "by design)"
        )
    if r.engine == "hf" and r.tensor_parallel_size > 1:
        raise ValueError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")


def check_eval(cfg: Config) -> None:
    """Held-out evaluation needs its file, and its divergence the held-out solutions."""
    e = cfg.eval
    if e.divergence and not e.path:
        raise ValueError("eval.divergence=true needs eval.path (held-out problems with solutions)")
    if e.divergence and not cfg.data.solution_key:
        raise ValueError("eval.divergence=true needs data.solution_key (held-out solutions)")
    if e.every and not e.path:
        raise ValueError("eval.every > 0 needs eval.path (a held-out file with answers)")
    check_sets(e)
    if any(s.seen_answers for s in e.sets.values()) and not cfg.data.answer_key:
        raise ValueError("eval.sets.*.seen_answers needs data.answer_key (the training rows' answers)")
    if cfg.guard.max_accuracy_drop is not None and not e.every:
        raise ValueError("guard.max_accuracy_drop needs eval.every > 0 (held-out accuracy to compare)")


def check_sets(e: EvalConfig) -> None:
    """``eval.sets``: beside a primary ``eval.path``, each named as metrics can carry it."""
    if e.sets and not e.path:
        raise ValueError("eval.sets needs eval.path: the primary held-out set, which decides")
    for name in e.sets:
        if not name.isidentifier():
            raise ValueError(f"eval.sets.{name}: a set's name is letters, digits and _ (it names metrics)")
