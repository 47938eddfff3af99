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


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    enabled: bool = True
    r: int = Field(64, ge=1)
    alpha: float = Field(128, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"


class ModelConfig(_Section):
    path: str = "smollm2-135m-instruct"  # HF name, local dir, or a short name from `opsd fetch-model`
    trust_remote_code: bool = False  # run the model repository's own Python code (only for repos you trust)
    # The compute dtype of the forwards. auto: bfloat16 where the device has bf16 matrix units (CUDA;
    # CPUs with AMX/AVX512-BF16, or OPSD_CPU_BF16=1), else float32. Full fine-tuning in bf16 keeps
    # float32 master weights and AdamW state; LoRA keeps the frozen base in this dtype, adapters in fp32.
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    pure_bf16: bool = False  # full fine-tuning in bf16 with bf16 weights and AdamW state: no fp32 master copy
    attn_implementation: str | None = "sdpa"
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer (inductor, dynamic shapes) for the teacher and student passes;
    # generation stays eager. About a minute compiling at the first step; one process only (not under
    # torchrun); on a CPU it needs a C++ compiler. docs/benchmarks.md has what it buys.
    compile: bool = False
    lora: LoraConfig = LoraConfig()


class DataConfig(_Section):
    path: str = ""
    problem_key: str = "problem"
    solution_key: str | None = "solution"
    answer_key: str | None = "answer"
    split: str = "train"
    skip_bad_rows: bool = False
    drop_empty_solution: bool = False
    shuffle: bool = True  # false: file order (benchmarks, curricula)
    instruction: str = DEFAULT_INSTRUCTION
    teacher_template: str = DEFAULT_TEACHER_TEMPLATE
    raw_splice: bool = False  # seed-style: student prompt + solution tokens, no teacher template
    student_thinking: bool | None = None  # enable_thinking for Qwen3-style templates; None = template default
    teacher_thinking: bool | None = None  # the reference found student off, teacher on best
    max_prompt_len: int = Field(1024, ge=8)
    max_teacher_prompt_len: int = Field(2048, ge=8)


def resolve_engine(setting: str) -> tuple[str, str]:
    """``rollout.engine`` as the engine that runs, and why: ``auto`` is vLLM (colocated) where it is
    installed, the HF engine otherwise. The one place ``auto`` is read; vLLM is not imported here."""
    if setting != "auto":
        return setting, f"rollout.engine={setting}"
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return "vllm", "rollout.engine=auto: vLLM is installed"
    hint = "pip install -e '.[vllm]', or on CPU scripts/vllm_cpu_env.sh"
    return "hf", f"rollout.engine=auto: vLLM is not installed ({hint})"


class RolloutConfig(_Section):
    # auto: vLLM where it is installed, else hf (resolve_engine); the startup line says which.
    engine: Literal["auto", "hf", "vllm", "vllm_server"] = "auto"
    prompts_per_step: int = Field(8, ge=1)  # the global batch: under torchrun each rank draws its share
    n: int = Field(1, ge=1)  # responses per prompt
    temperature: float = Field(1.1, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(1024, ge=1)
    stop_strings: list[str] = []
    batch_size: int = Field(32, ge=1)
    # vLLM only. None: 0.4 on GPUs; on a CPU a KV cache sized to hold batch_size sequences of
    # max_model_len tokens (a set fraction makes vLLM reserve that share of the machine's RAM)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)  # vLLM only: ranks per engine under torchrun
    # vLLM only. Sleep while the trainer trains: 0 off, 1 offload weights to CPU, 2 discard them
    # (reloaded from the trainer at wake-up). Sleep mode exists on CUDA/ROCm/XPU; elsewhere it is off.
    vllm_sleep_level: Literal[0, 1, 2] = 2
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: the trainer model's dtype
    max_model_len: int | None = Field(None, ge=1)  # vLLM context; None: data.max_prompt_len + max_new_tokens
    vllm_kwargs: dict[str, Any] = {}  # vLLM: extra vllm.LLM() arguments, e.g. enforce_eager: true
    # Compare the engine's log-prob of each sampled token with the trainer's (metric logprob_gap): auto
    # does it for vLLM. Needs plain sampling (temperature > 0, top_k=0, top_p=1): the engine reports
    # log-probs of the distribution it sampled from, which top-k/top-p renormalise.
    logprob_check: Literal["auto"] | bool = "auto"
    # vllm_server: `opsd serve` URLs; prompt i goes to server i mod S. The weights reach them through
    # sync_dir (a directory every server can read); OPSD_VLLM_API_KEY is sent if set.
    servers: list[str] = []
    sync_dir: str | None = None  # None: logging.run_dir/weights-sync (one per run: syncs never collide)
    weight_sync: Literal["disk", "nccl"] = "disk"
    # nccl (GPU; written against vLLM 0.32, not executed here): where trainer rank 0 listens for each
    # server's NCCL group (HOST:PORT, default 127.0.0.1:29600+i), and each server's tensor-parallel size.
    nccl_endpoints: list[str] = []
    server_tensor_parallel_size: int = Field(1, ge=1)
    server_timeout_s: float = Field(600.0, gt=0)
    # The largest |log-prob| difference a sync's probe accepts between server and trainer (float32 on
    # both: ~1e-6; use ~0.1 for bf16 servers, whose logits round at 2^-8).
    sync_tolerance: float | None = Field(None, gt=0)  # None: 1e-3 for a float32 trainer, 0.1 for bf16
    # vllm_server: 1 requests the next step's rollouts before this step trains (one step off-policy:
    # they come from the weights before this step's update); metric policy_lag.
    overlap: Literal[0, 1] = 0

    def plain_sampling(self) -> bool:
        """Sampling from the tempered softmax itself (no top-k/top-p): the log-probs are comparable."""
        return self.temperature > 0 and self.top_k == 0 and self.top_p == 1.0

    def checks_logprobs(self) -> bool:
        vllm = resolve_engine(self.engine)[0] in ("vllm", "vllm_server")
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
    mode: Literal[MODES] = "jsd"
    beta: float = Field(0.0, ge=0, le=1)
    temperature: float | None = Field(None, gt=0)  # None: the rollout's sampling temperature
    clip_mode: Literal[CLIP_MODES] = "entry"
    clip: float = Field(0.05, ge=0)
    topk: int = Field(0, ge=0)
    reduction: Literal[REDUCTIONS] = "token"
    chunk_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _spec(self) -> LossConfig:
        # DistillSpec holds the combination rules (opsd/loss/spec.py); restating them here would drift.
        try:
            self.to_spec(1.0)
        except UserError as e:
            raise ValueError(str(e)) from None
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
    mode: Literal["fixed", "ema", "live", "external"] = "fixed"
    ema_decay: float = Field(0.999, gt=0, lt=1)
    path: str | None = None  # external teacher model
    privileged: bool = True  # put the reference solution in the teacher's context
    solution_source: Literal["own", "other"] = "own"  # other: the next row's solution (a control)
    # full fine-tuning + fixed: where the frozen copy lives. Under torchrun it is FSDP-sharded like the
    # student, on the GPUs (device) or with its shards offloaded to CPU memory (cpu).
    frozen_copy: Literal["device", "cpu", "none"] = "device"


class ParallelConfig(_Section):
    """How `opsd train` spreads over the processes torchrun starts; one process without torchrun ignores
    it."""

    replicate: int = Field(
        1, ge=1
    )  # HSDP: shard within world_size/replicate ranks (a node), replicate across
    param_dtype: Literal["auto", "float32", "bfloat16"] = (
        "auto"  # compute dtype of gathered weights; auto: model.dtype's
    )
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype gradients are summed over ranks in
    timeout_s: int | None = Field(None, ge=1)  # a collective waiting longer fails; None: torch's default


class GRPOConfig(_Section):
    grader: str = "math"  # opsd.grading.GRADERS (math, lenient) or "package.module:function"
    scale_rewards: bool = False  # divide advantages by the group's std (off, as in Dr. GRPO)
    # > 0: add this times the distillation loss against the configured, privileged teacher (reward and
    # distillation together); 0: GRPO alone, with no teacher and no solutions.
    distill_coef: float = Field(0.0, ge=0)
    # Truncated importance sampling: each token's policy-gradient weight times min(S(y) / engine's
    # S(y), tis_cap), where the engine reports log-probs (vLLM; a lag with rollout.overlap). 0: off.
    tis_cap: float = Field(2.0, ge=0)

    @field_validator("tis_cap")
    @classmethod
    def _tis_cap(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("must be 0 (off) or >= 1: a cap below 1 scales every gradient down")
        return v


class OptimConfig(_Section):
    lr: float = Field(5e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(0.1, ge=0)  # 0 disables clipping
    scheduler: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_steps: int = Field(100, ge=1)
    # Padded tokens per micro-batch; auto sizes it from the model and the free memory (logged at start).
    max_tokens_per_microbatch: int | Literal["auto"] = "auto"
    # A micro-batch takes the next (shorter) sample only while its real tokens stay at least this
    # fraction of its padded ones: similar lengths together, little padding computed. 0: fill to the budget.
    min_real_token_frac: float = Field(0.8, ge=0, le=1)
    max_bad_steps: int = Field(3, ge=1)  # consecutive non-finite steps before stopping


class CheckpointConfig(_Section):
    enabled: bool = True  # false: never write checkpoints (benchmarks, throwaway runs)
    every: int = Field(50, ge=0)  # 0: only at the end
    keep_last: int = Field(2, ge=1)
    save_merged: bool = False  # LoRA: also write a merged full model


class LoggingConfig(_Section):
    run_dir: str = "runs/opsd"
    sample_every: int = Field(10, ge=0)  # log decoded responses every K steps; 0 disables
    num_samples: int = Field(2, ge=1)
    progress: bool = True
    step_lines: bool = True  # a console line per step under the progress bar (false: the bar only)
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "opsd"


class EvalConfig(_Section):
    path: str | None = None
    every: int = Field(0, ge=0)  # 0 disables
    k: int = Field(1, ge=1)
    limit: int | None = Field(None, ge=1)
    # Greedy by default: the in-training curve should move with the weights, not with sampling noise
    # (`opsd eval`, EvalCommandConfig, samples at 0.6 by default to report Avg@k as the paper does).
    temperature: float = Field(0.0, ge=0)
    max_new_tokens: int = Field(1024, ge=1)
    answer_key: str = "answer"
    grader: str = "math"  # opsd.grading.GRADERS (math, lenient) or "package.module:function"
    # Also the student's divergence from the privileged teacher on the held-out problems (metric
    # eval/divergence): the signal that moves where accuracy is near zero. Needs data.solution_key in
    # the held-out file; costs one sampled response per problem.
    divergence: bool = False


class Config(_Section):
    seed: int = 0
    device: DeviceSetting = "auto"  # auto | cpu | cuda | cuda:N
    objective: Literal["opsd", "grpo"] = "opsd"  # grpo: the RL baseline, same rollouts, data and loss kernel
    grpo: GRPOConfig = GRPOConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    loss: LossConfig = LossConfig()
    teacher: TeacherConfig = TeacherConfig()
    optim: OptimConfig = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    parallel: ParallelConfig = ParallelConfig()

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        if not self.data.path:
            raise ValueError(
                "data.path is required: a JSONL/JSON/Parquet/CSV file, a saved dataset dir or a hub name"
            )
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
        if self.objective == "grpo":
            if self.rollout.n < 2:
                raise ValueError("objective=grpo needs rollout.n >= 2 (advantages are relative to a group)")
            if not self.data.answer_key:
                raise ValueError(
                    "objective=grpo needs data.answer_key (the field the reward is graded against)"
                )
        distills = self.objective == "opsd" or self.grpo.distill_coef > 0
        if distills and t.privileged and self.data.solution_key is None:
            raise ValueError(
                "teacher.privileged=true needs data.solution_key (the field holding the reference solution)"
            )
        r = self.rollout
        if r.overlap and r.engine != "vllm_server":
            raise ValueError("rollout.overlap=1 needs rollout.engine=vllm_server (separate servers)")
        if r.overlap and self.objective == "grpo" and self.grpo.tis_cap and not r.checks_logprobs():
            raise ValueError(
                "rollout.overlap=1 with objective=grpo corrects the lag from the engine's log-probs, "
                "which need rollout.temperature > 0, top_k=0 and top_p=1 (or set grpo.tis_cap=0 to "
                "train uncorrected)"
            )
        if self.eval.divergence and not self.eval.path:
            raise ValueError("eval.divergence=true needs eval.path (held-out problems with solutions)")
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
        if resolve_engine(r.engine)[0] == "hf" and r.tensor_parallel_size > 1:
            raise ValueError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")
        if self.eval.divergence and not self.data.solution_key:
            raise ValueError("eval.divergence=true needs data.solution_key (held-out solutions)")
        if self.eval.every and not self.eval.path:
            raise ValueError("eval.every > 0 needs eval.path (a held-out file with answers)")
        return self


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


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
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise UserError(f"override {item!r}: the value is not valid YAML") from None
        _set_dotted(tree, key.strip(), value)
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
