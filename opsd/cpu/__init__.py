"""Every CPU-only speed and memory mechanism, decided in one place and applied from one place.

:func:`resolve_plan` turns the ``cpu`` config section, the device, the compute dtype, the engine and
the parallelism into a :class:`CpuPlan`; the trainer prints it at start (``cpu plan: ...``), saves it
in the run directory (``cpu_plan.json``) and reaches its mechanisms through the plan's hooks, each
called from one place: :meth:`CpuPlan.around_microbatches` (the trainer's micro-batch loop),
:meth:`CpuPlan.after_generation` (the rollout queue), :meth:`CpuPlan.after_step` (the training loop)
and :meth:`CpuPlan.engine_settings` (the rollout engines). On a GPU the plan is empty;
``cpu.tuning: off`` makes it empty on a CPU too (the plain path: transformers + peft + the fused loss).
docs/cpu.md has one row per mechanism: what it does, its gate, its switch, its effect.

This package is the room's one door: code outside ``opsd/cpu/`` imports from ``opsd.cpu`` alone, never
a submodule, and reads no plan field (``tests/meta/test_wall.py``). Besides the plan, :func:`resolve_plan`,
:func:`apply_plan`, :func:`default_plan` and the plan's hooks, its entry points are the ``opsd``
command's process settings (:func:`openmp_waiting`, :func:`command_defaults`), the CPU facts the device
resolver and ``opsd env`` report (:func:`cpu_has_bf16_units`, :func:`cpu_flags`,
:func:`activation_budget`), ``opsd serve``'s vLLM flags (:func:`serve_flags`) and the packed forward
the models run (:func:`is_packed`, :func:`packed_hidden`).

Light on purpose (no torch at module level): the ``opsd`` command imports it before torch loads, to set
OpenMP's waiting. The names that need torch load on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType, SimpleNamespace
from typing import TYPE_CHECKING, Any

from opsd.cpu.bf16 import cpu_flags, cpu_has_bf16_units
from opsd.cpu.budget import activation_budget
from opsd.cpu.kv import SERVE_CPU_MAX_MODEL_LEN, serve_flags
from opsd.cpu.openmp import openmp_waiting

if TYPE_CHECKING:
    import torch
    from torch import nn

    from opsd.cpu.packing import is_packed, packed_hidden

__all__ = [
    "LOSS_CHUNK_ROWS_HF",
    "LOSS_SLAB_ELEMENTS",
    "SECTION_DEFAULTS",
    "SERVE_CPU_MAX_MODEL_LEN",
    "CpuPlan",
    "EngineSettings",
    "RowWidths",
    "activation_budget",
    "apply_plan",
    "command_defaults",
    "cpu_flags",
    "cpu_has_bf16_units",
    "default_plan",
    "is_packed",
    "openmp_waiting",
    "packed_hidden",
    "resolve_plan",
    "serve_flags",
]
_NEED_TORCH = {"is_packed": "packing", "packed_hidden": "packing"}  # loaded on first use


def __getattr__(name: str) -> Any:
    if name in _NEED_TORCH:
        import importlib

        return getattr(importlib.import_module(f"opsd.cpu.{_NEED_TORCH[name]}"), name)
    raise AttributeError(f"module 'opsd.cpu' has no attribute {name!r}")


# The ``cpu`` config section's defaults, defined here and read by :class:`opsd.config.CpuTuning`: this
# room imports no config (the config checks its device setting in opsd.devices, which asks this room for
# the CPU's facts), and plans with these where no config is given (:func:`default_plan`).
SECTION_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "tuning": "auto",
        "pack_rows": True,
        "bucket_widths": True,
        "frozen_layout": True,
        "trim_heap": True,
        "tune_malloc": None,
    }
)
LOSS_CHUNK_ROWS_HF = 128  # the loss's rows per chunk on a CPU with the HF engine
LOSS_SLAB_ELEMENTS = 3 << 20  # elements of a chunk's products the loss kernels take at a time on a CPU


@dataclass(frozen=True)
class CpuPlan:
    """What runs on this CPU; the defaults are the plain path (and a GPU's plan)."""

    frozen_layout: str | None = None  # "column-major" (decoding here) | "copied" (beside vLLM) | None
    pack_rows: bool = False  # a micro-batch's rows packed into one forward (attention opsd_sdpa)
    pack_from: int | None = None  # ... those at least this long (set by apply_plan from the model's size)
    bucket_widths: bool = False  # padded widths rounded to buckets (bf16 attention's kernel cache)
    loss_chunk_rows: int | None = None  # the loss's rows per chunk where loss.chunk_size is unset
    loss_slab_elements: int | None = None  # elements of a chunk's products per kernel call
    trim_heap: bool = False  # malloc_trim after generation and after each step
    tune_malloc: bool = False  # mallopt around the micro-batch loop (opt-in: process-wide)
    keep_pages: bool = False  # with tune_malloc: the heap never trims itself after the loop
    static_cache: bool = False  # the HF engine decodes into a preallocated cache
    fold_lora_bytes: int = 0  # the HF engine folds LoRA into weight copies up to this size
    size_kv_cache: bool = False  # vLLM's KV cache sized to its batch (sizing: tuning off keeps it)
    notes: tuple[str, ...] = field(default=())  # why something is off that auto would turn on

    @property
    def empty(self) -> bool:
        """Nothing tuned: the plain path (sizing, which holds with ``cpu.tuning: off``, aside)."""
        return self == CpuPlan(size_kv_cache=self.size_kv_cache, notes=self.notes)

    def describe(self) -> str:
        """The plan as one startup line."""
        if self.empty:
            return "none" + (f" ({'; '.join(self.notes)})" if self.notes else "")
        parts = []
        if self.frozen_layout:
            parts.append(f"frozen weights {self.frozen_layout}")
        if self.pack_rows:
            least = f" of >= {self.pack_from} tokens" if self.pack_from else ""
            parts.append(f"rows{least} packed into one forward (attention opsd_sdpa)")
        if self.bucket_widths:
            parts.append("widths in buckets")
        if self.loss_chunk_rows:
            parts.append(f"loss chunks of {self.loss_chunk_rows} rows")
        if self.loss_slab_elements:
            parts.append(f"loss slabs of {self.loss_slab_elements} elements")
        if self.trim_heap:
            parts.append("heap trimmed between steps")
        if self.tune_malloc:
            kept = ", pages kept" if self.keep_pages else ""
            parts.append(
                f"malloc tuned in the micro-batch loop{kept} (cpu.tune_malloc=false keeps glibc's own)"
            )
        if self.static_cache:
            parts.append("static KV cache")
        if self.fold_lora_bytes:
            parts.append(f"LoRA folded while decoding (up to {self.fold_lora_bytes >> 20} MiB)")
        if self.size_kv_cache:
            parts.append("vLLM's KV cache sized to its batch")
        return "; ".join(parts + list(self.notes))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"notes": list(self.notes)}

    # -- hooks: the one door through which code outside this package reaches a CPU mechanism --

    def around_microbatches(self) -> AbstractContextManager:
        """The micro-batch loop's context: with ``tune_malloc``, glibc settings under which a block one
        micro-batch frees is the next one's, already resident (:func:`opsd.cpu.heap.reuse_freed_blocks`)."""
        from opsd.cpu import heap

        if not self.tune_malloc:
            return nullcontext()
        return heap.reuse_freed_blocks(keep_pages=self.keep_pages)

    def after_generation(self) -> None:
        """Generation's freed buffers (its cache, the folded LoRA copies) back to the OS before the
        micro-batch loop: left as heap holes, they raise that loop's peak RSS."""
        self._trim()

    def after_step(self) -> None:
        """The step's heap holes back to the OS, so the RSS does not creep step after step."""
        self._trim()

    def _trim(self) -> None:
        from opsd.cpu import heap

        if self.trim_heap:
            heap.trim_heap()

    def engine_settings(self, *, fold_lora_bytes: int | None = None) -> EngineSettings:
        """What a rollout engine takes from the plan; ``fold_lora_bytes`` (``rollout.fold_lora``)
        replaces the plan's folding budget where it is set."""
        fold = self.fold_lora_bytes if fold_lora_bytes is None else fold_lora_bytes
        return EngineSettings(self.bucket_widths, self.static_cache, fold, self.size_kv_cache)

    def forced_fold_bytes(self) -> int:
        """``rollout.fold_lora: on``'s folding budget: the plan's where it has one, else every
        LoRA-wrapped weight (a GPU's plan, one beside vLLM)."""
        return self.fold_lora_bytes or 1 << 62

    def row_widths(self) -> RowWidths:
        """How the trainer's micro-batches lay out their rows: widths in buckets, rows packed."""
        return RowWidths(self.bucket_widths, self.pack_from)

    def loss_chunking(self, chunk_size: int | None) -> tuple[int | None, int | None]:
        """The loss kernels' rows per chunk (``loss.chunk_size`` where set, else the plan's) and
        elements of a chunk's products per call (None: the kernels' own)."""
        return chunk_size or self.loss_chunk_rows, self.loss_slab_elements


@dataclass(frozen=True)
class RowWidths:
    """A micro-batch's row layout on this CPU (:meth:`CpuPlan.row_widths`): ``bucket``, padded widths
    rounded up to buckets (:mod:`opsd.cpu.buckets`); ``pack_from``, the shortest row that runs packed
    (:mod:`opsd.cpu.packing`; None: rows batched). The defaults are the plain path (and a GPU's)."""

    bucket: bool = False
    pack_from: int | None = None

    def width(self, n: int) -> int:
        """A row, or a batch of rows, ``n`` tokens wide, padded to its bucket where widths are bucketed."""
        from opsd.cpu.buckets import bucket_width

        return bucket_width(n) if self.bucket else n

    def packed(self, lengths: list[int]) -> list[int] | None:
        """Each row's width in the packed forward: its length, or its bucket width (never wider than the
        padded batch's width, the bucket of the longest). None (one batched forward) where rows are
        not packed, are equally wide (nothing to save) or the shortest is under ``pack_from`` tokens."""
        widths = [self.width(n) for n in lengths]
        if self.pack_from is None or len(set(widths)) == 1 or min(widths) < self.pack_from:
            return None
        return widths


@dataclass(frozen=True)
class EngineSettings:
    """A rollout engine's CPU mechanisms, each reached through a method here: the HF engine's prompt
    widths, decoding cache and LoRA folding, the colocated vLLM engine's KV cache size."""

    bucket_widths: bool = False
    static_cache: bool = False
    fold_lora_bytes: int = 0
    size_kv_cache: bool = False

    def width(self, n: int) -> int:
        """A batch of prompts ``n`` tokens wide, padded to its bucket (:meth:`RowWidths.width`)."""
        return RowWidths(bucket=self.bucket_widths).width(n)

    def decode_cache(self, model: nn.Module, max_len: int) -> dict[str, Any]:
        """``generate``'s cache argument: a preallocated cache (:mod:`opsd.cpu.cache`), or none."""
        from opsd.cpu.cache import static_cache

        return static_cache(model, max_len) if self.static_cache else {}

    def lora_folded(self, model: nn.Module) -> AbstractContextManager[bool]:
        """Decoding with LoRA folded into weight copies within the budget (:mod:`opsd.cpu.fold`)."""
        from opsd.cpu.fold import lora_folded

        return lora_folded(model, self.fold_lora_bytes)

    def vllm_kwargs(
        self, config, dtype: str, max_num_seqs: int | None, max_model_len: int | None, **user: Any
    ) -> dict[str, int]:
        """``vllm.LLM``'s KV cache size for the batch (:func:`opsd.cpu.kv.colocated_kv_kwargs`), or
        nothing; ``user``: ``llm_kwargs`` and ``gpu_memory_utilization``, which stand where set."""
        from opsd.cpu.kv import colocated_kv_kwargs

        if not self.size_kv_cache:
            return {}
        return colocated_kv_kwargs(config, dtype, max_num_seqs, max_model_len, **user)


def resolve_plan(
    settings: Any,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    *,
    engine: str = "hf",
    sharded: bool = False,
    compiled: bool = False,
) -> CpuPlan:
    """The plan for this run. ``settings``: the ``cpu`` config section (:class:`opsd.config.CpuTuning`);
    ``engine``: the rollout engine that runs ("hf", "vllm", "vllm_server"); ``sharded``: under
    torchrun; ``compiled``: ``model.compile`` (compiled layers keep batched forwards). ``cpu.tune_malloc:
    null`` is off here: the ``opsd`` command sets it true where the user set no ``MALLOC_*``
    variable (it owns its process)."""
    import torch

    from opsd.cpu.budget import ACTIVATION_BUDGET
    from opsd.cpu.heap import glibc, user_malloc_settings

    if device.type != "cpu":
        return CpuPlan()
    beside_vllm = engine == "vllm"
    if settings.tuning == "off":
        return CpuPlan(size_kv_cache=beside_vllm, notes=("cpu.tuning=off",))
    notes = []
    hf = engine == "hf"
    half = compute_dtype in (torch.bfloat16, torch.float16)
    on_glibc = glibc() is not None
    malloc = bool(settings.tune_malloc)
    if malloc and user_malloc_settings():
        malloc = False
        notes.append("malloc left as MALLOC_*/GLIBC_TUNABLES set it")
    pack = settings.pack_rows and not sharded and not compiled
    if settings.pack_rows and compiled:
        notes.append("model.compile: rows batched")
    layout = None
    if settings.frozen_layout and not sharded:
        layout = "column-major" if hf else "copied"
    return CpuPlan(
        frozen_layout=layout,
        pack_rows=pack,
        bucket_widths=settings.bucket_widths and half,
        loss_chunk_rows=LOSS_CHUNK_ROWS_HF if hf else None,
        loss_slab_elements=LOSS_SLAB_ELEMENTS,
        trim_heap=settings.trim_heap and on_glibc and not beside_vllm,
        tune_malloc=malloc and on_glibc,
        keep_pages=malloc and on_glibc and beside_vllm,
        static_cache=hf,
        fold_lora_bytes=ACTIVATION_BUDGET if hf else 0,  # within the activations' budget, free while decoding
        size_kv_cache=beside_vllm,
        notes=tuple(notes),
    )


def command_defaults(cfg):
    """What the ``opsd`` command turns on for the process it owns: ``cpu.tune_malloc`` where the config
    leaves it unset and the user set no ``MALLOC_*``/``GLIBC_TUNABLES`` variable. A Python caller that
    builds a ``Trainer`` itself keeps glibc's settings unless it sets the key."""
    from opsd.cpu.heap import user_malloc_settings

    if cfg.cpu.tune_malloc is not None or user_malloc_settings():
        return cfg
    return cfg.model_copy(update={"cpu": cfg.cpu.model_copy(update={"tune_malloc": True})})


def default_plan(device: torch.device, compute_dtype: torch.dtype | None, *, engine: str = "hf") -> CpuPlan:
    """The plan at the ``cpu`` section's defaults (:data:`SECTION_DEFAULTS`) for one process with
    ``engine``: what an engine built outside a trainer runs."""
    return resolve_plan(SimpleNamespace(**SECTION_DEFAULTS), device, compute_dtype, engine=engine)


def apply_plan(plan: CpuPlan, *models: nn.Module | None, params: int) -> CpuPlan:
    """The plan's model transforms: frozen weights' layout, then packed attention. Returns the plan as
    applied: the shortest row that runs packed, sized from ``params`` (the student's non-embedding
    parameters); rows batched where no model could switch to packed attention (one attending with
    something other than ``sdpa``, or a transformers without an attention registry)."""
    from opsd.cpu.layout import frozen_weights
    from opsd.cpu.packing import pack_from, pack_rows

    if plan.frozen_layout is not None:
        frozen_weights(*models, column_major=plan.frozen_layout == "column-major")
    if not plan.pack_rows:
        return plan
    if pack_rows(*models) == 0:
        return replace(plan, pack_rows=False, notes=(*plan.notes, "attention is not sdpa: rows batched"))
    return replace(plan, pack_from=pack_from(params))
