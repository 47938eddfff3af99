"""The sections of a run's mechanics: the optimizer (``optim``), ``checkpoint``, ``logging`` and how
torchrun's processes share the model (``parallel``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opsd.config.base import Section


class OptimConfig(Section):
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


class CheckpointConfig(Section):
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


class LoggingConfig(Section):
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


class ParallelConfig(Section):
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
