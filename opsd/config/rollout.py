"""The ``rollout`` section: the engine that samples the student's responses and its settings, and
rollouts reused across steps (``rollout.reuse``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from opsd.config.base import Section, Switch
from opsd.errors import UserError


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


def refresh_every_value(value: Any) -> Any:
    """``rollout.reuse.refresh_every`` as one clear error: YAML's ``.inf`` and the word inf both mean
    never refresh, and a bool (an int to Python) is no step count."""
    if value is None:
        return None
    if value == float("inf") or (isinstance(value, str) and value.strip().lower() in ("inf", ".inf")):
        return "inf"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected an integer >= 1, inf (the initial student's rollouts only) or null (off)")
    return value


class ReuseConfig(Section):
    """Rollouts reused across steps (Semi-OPD, reported by OPSD's first author): the student generates
    the rollouts of several steps at once, each step's stored under logging.run_dir/rollouts (token ids
    and log-probs, one JSONL file per step) and read back by the steps in between and by a resume. The
    teacher still scores every step's rollouts. Without replay only engine wakes and weight syncs are
    saved, not tokens; with replay each batch trains K steps, so generation, about half of a step on a
    CPU, drops K-fold, at the price of training on an older student's responses. objective grpo and
    rlsd weigh those by grpo.tis_cap's importance ratio (required), capped from above only: no PPO
    clip bounds how far replay's K steps move. Metrics: rollout/generated_tokens (0 on a reused step)
    and rollout/reused."""

    refresh_every: Annotated[int | Literal["inf"] | None, BeforeValidator(refresh_every_value)] = Field(
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


class RolloutConfig(Section):
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
