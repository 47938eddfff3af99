"""The rollout engine contract: prompts as token ids in, sampled responses with log-probs out.

Every engine implements :class:`RolloutEngine`; :func:`opsd.rollout.make.make_engine` builds one from
the run config. The helpers here are shared by the in-process engines and the HTTP client of
:mod:`opsd.rollout.remote`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from opsd.config import RolloutConfig
    from opsd.cpu import CpuPlan
    from opsd.distributed import Dist


@dataclass
class EngineRun:
    """What an engine takes from the run besides the ``rollout`` section and the live model: built
    before it (:func:`opsd.rollout.make.make_engine`).

    ``max_prompt_len`` plus ``max_new_tokens`` (the longest generation asked of the engine, rollouts
    or held-out evaluation; default rollout.max_new_tokens) sizes vLLM's context when
    rollout.max_model_len is unset; ``model_path`` is the directory vLLM loads the architecture from
    (default: where the model was loaded from). ``compute_dtype`` is vLLM's dtype when
    rollout.vllm_dtype is auto (the trainer's compute dtype, not the float32 of master weights), and
    the server probe's trainer side; ``autocast_dtype`` makes the HF engine generate under autocast.
    ``ranks``: this process's place among the trainer's ranks (one engine per rank under torchrun).
    ``run_dir``: where the weight sync directory defaults to. ``plan``: the trainer's CPU plan (the
    HF engine's decoding mechanisms, the vLLM engine's KV cache size; None: the device's default)."""

    seed: int = 0
    max_prompt_len: int | None = None
    max_new_tokens: int | None = None
    model_path: str | None = None
    compute_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None
    ranks: Dist | None = None
    run_dir: str | None = None
    plan: CpuPlan | None = None

    def max_model_len(self, rollout: RolloutConfig) -> int | None:
        """vLLM's context: rollout.max_model_len, else the longest prompt plus the longest generation."""
        if rollout.max_model_len is not None or self.max_prompt_len is None:
            return rollout.max_model_len
        return self.max_prompt_len + (self.max_new_tokens or rollout.max_new_tokens)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's eos
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None  # None: fresh OS entropy; the global torch RNG is never touched either way
    min_new_tokens: int = 0  # stop tokens are masked out before this many tokens (benchmarks)

    @classmethod
    def from_rollout(cls, rollout, seed: int | None) -> SamplingParams:
        """The ``rollout`` config section's sampling settings, with ``seed``."""
        r = rollout
        stops = list(r.stop_strings)
        return cls(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stop_strings=stops, seed=seed)

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens]")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")


@dataclass
class Completion:
    prompt_index: int  # index into the prompts list given to generate()
    token_ids: list[int]  # response tokens; includes the stop token when finish_reason == "stop"
    # Log-prob of each token under the distribution it was sampled from (after temperature, top-k,
    # top-p), same length as token_ids; None when the engine does not report them.
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length"

    def row(self) -> list:
        """This completion as a JSON row (also what a weights-only checkpoint load accepts)."""
        return [self.prompt_index, self.token_ids, self.logprobs, self.finish_reason]

    @classmethod
    def from_row(cls, row: list) -> Completion:
        i, t, lp, r = row
        return cls(i, list(t), list(lp) if lp is not None else None, r)


def batch_state(example_indices: list[int], prompts: list, completions: list[Completion]) -> dict:
    """A step's problems, prompt pairs and responses in plain types, for a checkpoint."""
    return {
        "example_indices": list(example_indices),
        "prompts": [[list(s), list(t)] for s, t in prompts],
        "completions": [c.row() for c in completions],
    }


def batch_from_state(state: dict) -> tuple[list[int], list[tuple[list[int], list[int]]], list[Completion]]:
    """:func:`batch_state`'s problems, prompt pairs and responses back."""
    prompts = [(list(s), list(t)) for s, t in state["prompts"]]
    return list(state["example_indices"]), prompts, [Completion.from_row(r) for r in state["completions"]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer, its rollout queue and `opsd eval` call on a rollout engine.

    generate() returns len(prompts) * n completions, prompt-major, deterministic given params.seed.
    submit() asks for what generate() returns without waiting for it (``rollout.overlap``: the
    servers sample while the trainer trains) and collect() waits for it, given submit()'s handle.
    sync_weights() makes later generate() calls use the model's current weights. sleep() may free
    the engine's memory while the trainer trains and wake() takes it back; generate() wakes a
    sleeping engine itself. close() releases everything; the engine is unusable afterwards.
    """

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]: ...

    def submit(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Any: ...

    def collect(self, handle: Any) -> list[Completion]: ...

    def sync_weights(self, model) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class SamplesOnSubmit:
    """submit() and collect() for an engine that samples in the trainer's process: nothing runs beside
    the trainer's own compute, so submit() samples at once and its handle is the completions."""

    def submit(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        return self.generate(prompts, n, params)

    def collect(self, handle: list[Completion]) -> list[Completion]:
        return handle


def check_prompts(prompts: list[list[int]], n: int, vocab_size: int | None) -> None:
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}): min {min(p)}, max {max(p)}"
            )


def end_token_ids(tokenizer, model, extra: list[int]) -> list[int]:
    """eos from the tokenizer and the model's generation config (chat models often have several)."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in [tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos]), *extra]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    return ids
