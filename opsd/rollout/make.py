"""The engine kind that runs -> an engine: the one place that builds one of the rollout engines
(:mod:`opsd.rollout.hf`, :mod:`opsd.rollout.vllm`, :mod:`opsd.rollout.remote`); a new engine is a
class of its own and a branch here. ``rollout.engine: auto`` is resolved before, once per run
(:func:`opsd.config.resolve_engine`), and the kind passed in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from opsd.cpu import CpuPlan
from opsd.errors import UserError
from opsd.precision import dtype_name
from opsd.rollout.base import RolloutEngine
from opsd.rollout.hf import HFEngine
from opsd.rollout.remote import VLLMServerEngine
from opsd.rollout.vllm import VLLMEngine

if TYPE_CHECKING:
    from opsd.config import RolloutConfig
    from opsd.distributed import Dist


def make_engine(
    rollout: RolloutConfig,
    model,
    tokenizer,
    *,
    seed: int,
    kind: str | None = None,
    max_prompt_len: int | None = None,
    max_new_tokens: int | None = None,
    model_path: str | None = None,
    compute_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    ranks: Dist | None = None,
    run_dir: str | None = None,
    plan: CpuPlan | None = None,
) -> RolloutEngine:
    """The engine of ``kind`` ("hf", "vllm", "vllm_server"; default ``rollout.engine``, which must then
    name one) with the rollout config's settings, on `model` (the trainer's live model object).

    `max_prompt_len` plus `max_new_tokens` (the longest generation asked of the engine, rollouts or
    held-out evaluation; default rollout.max_new_tokens) sizes vLLM's context when
    rollout.max_model_len is unset; `model_path` is the
    directory vLLM loads the architecture from (default: where `model` was loaded from).
    `compute_dtype` is vLLM's dtype when rollout.vllm_dtype is auto (the trainer's compute dtype, not
    the float32 of master weights); `autocast_dtype` makes the HF engine generate under autocast.
    `ranks`: this process's place among the trainer's ranks (one engine per rank under torchrun).
    `plan`: the trainer's CPU plan (the HF engine's decoding mechanisms, the vLLM engine's KV cache
    size; None: the device's default).
    """
    name = kind or rollout.engine
    if name == "hf":
        if rollout.tensor_parallel_size > 1:
            raise UserError(
                "rollout.tensor_parallel_size > 1 needs rollout.engine=vllm; the HF engine runs here"
            )
        return HFEngine(
            model,
            tokenizer,
            batch_size=rollout.batch_size,
            autocast_dtype=autocast_dtype,
            plan=plan,
            fold_lora_bytes=fold_lora_bytes(rollout.fold_lora, plan),
        )
    if name == "vllm":
        max_len = rollout.max_model_len
        if max_len is None and max_prompt_len is not None:
            max_len = max_prompt_len + (max_new_tokens or rollout.max_new_tokens)
        return VLLMEngine(
            model,
            tokenizer,
            seed=seed,
            model_path=model_path,
            tensor_parallel_size=rollout.tensor_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            dtype=dtype_name(compute_dtype)
            if rollout.vllm_dtype == "auto" and compute_dtype
            else rollout.vllm_dtype,
            max_model_len=max_len,
            max_num_seqs=rollout.batch_size,
            sleep_level=rollout.vllm_sleep_level,
            llm_kwargs=rollout.vllm_kwargs,
            world_size=ranks.world_size if ranks is not None else None,
            device=ranks.device if ranks is not None else None,
            plan=plan,
        )
    if name == "vllm_server":
        return VLLMServerEngine(
            model,
            tokenizer,
            rollout.servers,
            sync_dir=rollout.sync_dir or str(Path(run_dir or ".") / "weights-sync"),
            timeout_s=rollout.server_timeout_s,
            server_wait_s=rollout.server_wait_s,
            api_key=os.environ.get("OPSD_VLLM_API_KEY") or None,
            sync_tolerance=rollout.sync_tolerance,
            transport=rollout.weight_sync,
            compute_dtype=compute_dtype,
            nccl_endpoints=rollout.nccl_endpoints or None,
            server_world_size=rollout.server_tensor_parallel_size,
        )
    if name == "auto":
        raise ValueError("rollout.engine=auto: resolve it first (opsd.config.resolve_engine) and pass kind")
    raise UserError(f"rollout.engine={name!r} unknown; allowed: ['hf', 'vllm', 'vllm_server']")


def fold_lora_bytes(setting: str, plan: CpuPlan | None) -> int | None:
    """``rollout.fold_lora`` as the HF engine's folding budget: ``auto`` the CPU plan's (None: the
    engine's default plan for its device; a GPU's is 0 until a GPU measurement justifies it), ``off``
    none, ``on`` the plan's budget where it has one, else every LoRA-wrapped weight."""
    if setting == "off":
        return 0
    if setting == "on":
        return (plan or CpuPlan()).forced_fold_bytes()
    return None
