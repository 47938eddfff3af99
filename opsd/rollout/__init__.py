"""On-policy rollout engines: prompts as token ids in, sampled responses with log-probs out.

The three engines implement :class:`RolloutEngine` (``opsd.rollout.base``);
:func:`opsd.rollout.make.make_engine` builds the one the run's resolved ``rollout.engine`` names.
HFEngine (``opsd.rollout.hf``) runs anywhere (CPU or GPU) on the trainer's own model object, so weight
sync is free.
VLLMEngine (``opsd.rollout.vllm``, optional `vllm` extra, pinned to one vLLM version) runs a colocated,
in-process vllm.LLM per trainer rank that sleeps while the trainer trains and reloads the trainer's
weights after each optimizer step.
VLLMServerEngine (``opsd.rollout.remote``) sends the rollouts over HTTP to `vllm serve` processes that
`opsd serve` (``opsd.rollout.serve``) starts, and their weights after each optimizer step.
``opsd.rollout.queue`` decides what each step trains on.
"""

from opsd.errors import EngineError
from opsd.rollout.base import Completion, RolloutEngine, SamplingParams
from opsd.rollout.hf import HFEngine
from opsd.rollout.vllm import (
    VLLM_VERSION,
    VLLMEngine,
    check_weight_coverage,
    weights_to_resend,
)

__all__ = [
    "VLLM_VERSION",
    "Completion",
    "EngineError",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "check_weight_coverage",
    "weights_to_resend",
]
