"""The ``model`` section: the model trained or evaluated, how it computes and which weights train."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opsd.config.base import Section


class LoraConfig(Section):
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


class ModelConfig(Section):
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
