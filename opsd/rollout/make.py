"""The engine kind that runs -> an engine: the one place that builds one of the rollout engines
(:mod:`opsd.rollout.hf`, :mod:`opsd.rollout.vllm`, :mod:`opsd.rollout.remote`); a new engine is a
class of its own and a branch here. ``rollout.engine: auto`` is resolved before, once per run
(:func:`opsd.config.resolve_engine`), and the kind passed in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd.cpu import CpuPlan
from opsd.errors import UserError
from opsd.rollout.base import EngineRun, RolloutEngine
from opsd.rollout.hf import HFEngine
from opsd.rollout.remote import VLLMServerEngine
from opsd.rollout.vllm import VLLMEngine

if TYPE_CHECKING:
    from opsd.config import RolloutConfig


def make_engine(
    rollout: RolloutConfig, model, tokenizer, run: EngineRun | None = None, *, kind: str | None = None
) -> RolloutEngine:
    """The engine of ``kind`` ("hf", "vllm", "vllm_server"; default ``rollout.engine``, which must then
    name one) from the rollout section, on ``model`` (the trainer's live model object), with what the
    run built before it (:class:`~opsd.rollout.base.EngineRun`; default: none of it, seed 0)."""
    run = run or EngineRun()
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
            autocast_dtype=run.autocast_dtype,
            plan=run.plan,
            fold_lora_bytes=fold_lora_bytes(rollout.fold_lora, run.plan),
        )
    if name == "vllm":
        return VLLMEngine(model, tokenizer, rollout, run)
    if name == "vllm_server":
        return VLLMServerEngine(model, tokenizer, rollout, run)
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
