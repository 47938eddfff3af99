"""Atomic, safe-to-load checkpoints: written to a temporary directory, then renamed into place.

A run killed mid-save leaves only a ``.tmp-*`` directory behind (removed at the next save, or by
:func:`clean_partial`); every ``step_*`` directory is complete. One layout for one process and for
any number of torchrun ranks (:func:`save_distributed`), so a run resumes at any
world size. ``RUN_DIR/checkpoints/step_000010/``:

* ``dcp/``     -- trainable weights, optimizer state and the EMA teacher (torch.distributed.checkpoint;
  resharded on load to the current number of ranks)
* ``model/``   -- Hugging Face format: the LoRA adapter (peft) or the full model, plus tokenizer
* ``merged/``  -- optional, LoRA only: the adapter merged into a full model (vLLM/transformers load it)
* ``state.pt`` -- the format and the parts all ranks share, by name (the run's counters, scheduler,
  data cursor: :meth:`opsd.setup.RunParts.checkpointed`)
* ``rank_NNNNN.pt`` -- each rank's own parts by name (truncation counts, rollouts in flight) and RNG

The ``.pt`` files hold only tensors, numbers, strings, lists, tuples and dicts, and are loaded with
``torch.load(weights_only=True)``: a checkpoint from someone else cannot run code when resumed.
Frozen weights (the LoRA base model) are not saved; they come from ``model.path``.

Only the newest ``checkpoint.keep_last`` are kept, and the best by held-out accuracy, which
``checkpoints/best.json`` names (:mod:`opsd.records`; :func:`prune_checkpoints`).
"""

from __future__ import annotations

import gc
import io
import json
import pickle
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from opsd.distributed import initialized, rank_world, run_setup
from opsd.errors import TrainingError, UserError
from opsd.models import base_model, merged_weights
from opsd.parallel import is_sharded
from opsd.records import best_checkpoint

PREFIX = "step_"
# state.pt's "format". 1 (no key): before float32 master weights; a bf16 full fine-tuning run stored
# bf16 weights and AdamW state, which load exactly into the float32 masters of format 2. 3: the run's
# counters under "progress" (formats 1 and 2 kept "step" and "bad_steps" at the top; they load as 3).
FORMAT = 3


class Stateful(Protocol):
    """A checkpointed part of a run: the protocol torch.distributed.checkpoint's ``Stateful`` names.
    Its state holds only tensors and plain data (weights-only loadable)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class RunState:
    """What a checkpoint holds of a run: the trainable weights of ``model``, ``optimizer`` and
    ``tensors`` (``dcp/``, resharded on load), the Hugging Face export (``model/``, with
    ``tokenizer``), the ``shared`` parts (rank 0 writes them to ``state.pt``, every rank loads them)
    and each rank's own ``per_rank`` parts (``rank_NNNNN.pt``; a rank the saving run did not have
    loads None into each). :func:`save_checkpoint` and :func:`load_checkpoint` walk the parts by name."""

    model: nn.Module
    tokenizer: Any = None
    optimizer: torch.optim.Optimizer | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    shared: dict[str, Stateful] = field(default_factory=dict)
    per_rank: dict[str, Stateful] = field(default_factory=dict)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.pt").is_file()
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints, never the best one (named in
    ``checkpoints/best.json``, :mod:`opsd.records`); returns what was deleted."""
    best = best_checkpoint(run_dir)
    old = [p for p in list_checkpoints(run_dir)[:-keep_last] if p != best]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove temporary directories a killed save left behind; returns what was removed."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    partial = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(TMP_PREFIX))
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


# --- distributed checkpoint I/O: one layout for one process and any number of ranks ---------

_DCP_DIR = "dcp"
_SHARED = "state.pt"  # also what opsd.checkpoint.list_checkpoints looks for
_META = "distributed.json"
TMP_PREFIX = ".tmp-"  # a directory being written; opsd.checkpoint.clean_partial removes leftovers


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load; that is the intended use here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _check_plain(obj: Any, what: str) -> bytes:
    """Serialize ``obj`` and prove it loads with ``weights_only=True`` (so resume can load it)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as err:
        raise TypeError(f"{what} must hold only tensors and plain data to be loadable safely: {err}") from err
    return buf.getvalue()


def collect_state_dict_cycles() -> None:
    """torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``) leave reference cycles
    behind (a recursive closure holding a set of the model's modules), so a model that a checkpoint
    touched would outlive its trainer until Python's cycle collector ran: on a GPU, its weights in the
    next trainer's memory (a resume, ``opsd compare``'s next arm). Collected after every use."""
    gc.collect()


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Model (trainable parameters only) and optimizer state keyed by parameter name, sharded as live."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    return {"model": model_sd, "optim": optim_sd}


def save_distributed(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra_state_per_rank: dict,
    shared_state: dict,
    *,
    tensors: dict[str, Tensor] | None = None,
    export: Callable[[Path], None] | None = None,
    collective_export: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: write a checkpoint to ``ckpt_dir`` atomically; every rank calls it, rank 0 commits.

    * ``dcp/``: trainable parameters and optimizer state (torch.distributed.checkpoint, one file per
      rank plus metadata; loads at any world size), and ``tensors`` (e.g. the EMA teacher).
    * ``rank_NNNNN.pt``: each rank's ``extra_state_per_rank`` (its RNG state, ...).
    * ``state.pt``: rank 0's ``shared_state`` (step, scheduler, data cursor, ...).
    * whatever ``export(tmp_dir)`` writes on rank 0 (the Hugging Face adapter / merged model, from a
      :func:`gather_full_state_dict` every rank called before), and whatever
      ``collective_export(tmp_dir)`` writes, which every rank calls (it streams gathered tensors to
      rank 0; it must run its collectives to the end on every rank and raise only after them).

    Everything goes to ``.tmp-<name>`` beside ``ckpt_dir``; after all ranks finished, rank 0 renames
    it into place. A kill at any point leaves either the previous checkpoints or the complete new one
    (plus a ``.tmp-*`` that ``opsd.checkpoint.clean_partial`` removes). Extra and shared state must be
    plain data (weights_only-loadable). A failure on any rank raises on all ranks, and the temporary
    directory is removed. Works without a process group (one process).
    """
    import torch.distributed.checkpoint as dcp

    final = Path(ckpt_dir)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}"
    rank, world = rank_world()

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    run_setup(prepare, f"checkpoint save to {final}")
    try:
        state = _state_dicts(model, optimizer)
        if tensors:
            state["tensors"] = dict(tensors)
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp / _DCP_DIR, no_dist=not initialized())

        def write_own() -> None:
            (tmp / _rank_file(rank)).write_bytes(_check_plain(extra_state_per_rank, "extra_state_per_rank"))
            if rank == 0:
                (tmp / _SHARED).write_bytes(_check_plain(shared_state, "shared_state"))
                (tmp / _META).write_text(json.dumps({"world_size": world}))
                if export is not None:
                    export(tmp)

        run_setup(write_own, f"checkpoint save to {final}")
        if collective_export is not None:
            run_setup(lambda: collective_export(tmp), f"checkpoint export to {final}")

        def commit() -> None:
            if rank != 0:
                return
            if final.exists():  # re-saving a step: the old copy stays until the new one is in place
                old = final.parent / f"{TMP_PREFIX}old-{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)

        run_setup(commit, f"checkpoint commit of {final}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


@dataclass
class LoadedCheckpoint:
    """What :func:`load_distributed` hands back besides the in-place loads."""

    shared_state: dict
    rank_state: dict | None  # this rank's extra state; None if the checkpoint had fewer ranks
    saved_world_size: int


def load_distributed(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    tensors: dict[str, Tensor] | None = None,
) -> LoadedCheckpoint:
    """Collective: load a :func:`save_distributed` checkpoint in place, at any world size.

    Model, optimizer and ``tensors`` are resharded to the current layout (2 ranks -> 1, 1 -> 2, ...).
    Per-rank state only maps back at the same world size or for ranks that existed: a new rank gets
    ``rank_state=None`` and should seed itself from :func:`rank_seed`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    ckpt = Path(ckpt_dir)
    if not (ckpt / _DCP_DIR).is_dir() or not (ckpt / _SHARED).is_file():
        raise UserError(f"{ckpt}: not a distributed checkpoint (no {_DCP_DIR}/ or {_SHARED})")
    rank, _ = rank_world()
    state = _state_dicts(model, optimizer)
    if tensors:
        state["tensors"] = dict(tensors)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=ckpt / _DCP_DIR, no_dist=not initialized())
    # strict=False: frozen weights are not in the checkpoint (they come from the model source); a
    # missing trainable tensor already failed in dcp.load, which loads every key it is asked for.
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"], options=opts)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
        )
    if tensors:
        for name, t in tensors.items():
            if state["tensors"][name] is not t:
                t.copy_(state["tensors"][name])
    rank_path = ckpt / _rank_file(rank)
    return LoadedCheckpoint(
        shared_state=torch.load(ckpt / _SHARED, weights_only=True),
        rank_state=torch.load(rank_path, weights_only=True) if rank_path.is_file() else None,
        saved_world_size=json.loads((ckpt / _META).read_text())["world_size"]
        if (ckpt / _META).is_file()
        else 1,
    )


def gather_full_state_dict(
    model: nn.Module, *, trainable_only: bool = False, all_ranks: bool = False
) -> dict[str, Tensor]:
    """Collective: full (unsharded) weights under the model's own parameter names, for an HF export.

    Rank 0 gets CPU tensors and the other ranks ``{}``; with ``all_ranks`` every rank gets them on its
    device (a per-rank rollout engine needs them). The live weights are never modified; on one
    process without sharding the tensors are the live ones (detached), so do not change them in place.
    """
    if not is_sharded(model):
        return {
            k: v.detach()
            for k, v in model.state_dict().items()
            if not trainable_only or k in _trainable_names(model)
        }
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(
        full_state_dict=True, cpu_offload=not all_ranks, ignore_frozen_params=trainable_only
    )
    return get_model_state_dict(model, options=opts)


def _trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Collective: ``(name, full tensor)`` one at a time on every rank, for streaming weight sync.

    Peak memory is one full tensor, not the whole model. Every rank must drain the iterator.
    """
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        yield name, t.full_tensor() if isinstance(t, DTensor) else t.detach()


# --- RNG state, in types weights_only loading accepts ------------------------------------------


def rng_state() -> dict:
    """Python, numpy and torch (and this process's CUDA device) generator states as tensors, ints,
    floats and lists. Only the current CUDA device: asking for every visible one would start a CUDA
    context on each GPU from every torchrun rank."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- save and load ----------------------------------------------------------------------------


# What a failed write raises: OSError from Python, RuntimeError from torch.save (and
# opsd.distributed.PeerError: another rank's failure), safetensors' own.
_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def _cause(err: BaseException, rank: int) -> BaseException:
    """The exception inside torch.distributed.checkpoint's wrapper (this rank's, else the first)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException) or not err.failures:
        return err
    return (err.failures.get(rank) or next(iter(err.failures.values())))[0]


def save_checkpoint(
    run_dir: Path, step: int, run: RunState, *, keep_last: int, save_merged: bool = False
) -> Path:
    """Write everything needed to resume exactly; returns the checkpoint directory.

    Each part of ``run.shared`` and ``run.per_rank`` is saved under its name (rank 0's shared ones,
    with the format; each rank's own, with its RNG state); the trainable weights, the optimizer and
    ``run.tensors`` go to ``dcp/``. Collective under torchrun: every rank calls it, and rank 0 writes
    the Hugging Face export from gathered weights. A failed write (full disk, I/O error) on any rank
    raises :class:`TrainingError` after removing the temporary directory; earlier checkpoints are
    never touched before the new one is complete.
    """
    rank, _ = rank_world()
    root = checkpoint_dir(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    if rank == 0:
        clean_partial(run_dir)
    model, tokenizer = run.model, run.tokenizer
    weights = _export_weights(model)
    lora = hasattr(model, "peft_config")

    def export(tmp: Path) -> None:
        model.save_pretrained(tmp / "model", safe_serialization=True, **weights)
        tokenizer.save_pretrained(tmp / "model")

    def merged(tmp: Path) -> None:
        write_merged(model, tokenizer, tmp / "merged")

    # The parts' states first, outside the write's error handling: a part's own failure is not a
    # failed write.
    state = {"format": FORMAT} | {name: part.state_dict() for name, part in run.shared.items()}
    mine = {name: part.state_dict() for name, part in run.per_rank.items()}
    mine["rng"] = rng_state()  # after the parts: a part's state_dict may draw
    try:
        save_distributed(
            final,
            model,
            run.optimizer,
            mine,
            state,
            tensors=run.tensors,
            export=export,
            collective_export=merged if save_merged and lora else None,
        )
    except BaseException as err:
        cause = _cause(err, rank)
        if cause is err and not isinstance(err, _WRITE_ERRORS):
            raise
        if not isinstance(cause, _WRITE_ERRORS):
            raise cause from err  # e.g. a KeyboardInterrupt inside torch.distributed.checkpoint
        previous = latest_checkpoint(run_dir)
        intact = (
            f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
        )
        raise TrainingError(
            f"writing checkpoint step {step} to {root} failed (disk full?): {type(cause).__name__}: "
            f"{' '.join(str(cause).split())}; {intact}"
        ) from err
    if rank == 0:
        prune_checkpoints(run_dir, keep_last)
    collect_state_dict_cycles()
    return final


def _export_weights(model: nn.Module) -> dict:
    """``save_pretrained`` keyword arguments for ``model/``: nothing unsharded (it reads the live
    model); sharded, the gathered full weights on rank 0 (collective; the others get empty dicts)."""
    if not is_sharded(model):
        return {}
    return {"state_dict": gather_full_state_dict(model, trainable_only=hasattr(model, "peft_config"))}


MERGED_SHARD_BYTES = 2 << 30


def write_merged(model: nn.Module, tokenizer, out: Path, *, shard_bytes: int = MERGED_SHARD_BYTES) -> None:
    """The LoRA adapter folded into the base weights (out of place), written to ``out`` as a Hugging
    Face model in safetensors shards, one merged tensor at a time: at most one shard is held, not a
    second copy of the model (~15 GB at 8B). Collective when the model is sharded: every rank gathers
    each tensor, rank 0 writes. A write error on rank 0 is raised after the last gather, so the other
    ranks are never left waiting in one."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    rank, _ = rank_world()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, Tensor] = {}
    shards, size, total, failed = 0, 0, 0, None
    where: dict[str, int] = {}  # tensor name -> shard number

    def write() -> None:
        nonlocal failed, shards, shard, size
        if failed is None:
            try:
                save_file(shard, str(out / f".shard-{shards}.safetensors"), metadata={"format": "pt"})
            except (OSError, RuntimeError) as err:
                failed = err
        shards, shard, size = shards + 1, {}, 0

    for name, t in merged_weights(model):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if rank != 0:
            continue
        full = full.detach().to("cpu")
        if any(full.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in shard.values()):
            full = full.clone()  # tied weights share storage, which one safetensors file cannot hold
        if shard and size + full.nbytes > shard_bytes:
            write()
        shard[name] = full
        size += full.nbytes
        total += full.nbytes
        where[name] = shards
    if rank != 0:
        return
    write()
    if failed is not None:
        raise failed
    names = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    for i, fname in enumerate(names):
        (out / f".shard-{i}.safetensors").rename(out / fname)
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in where.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    base = base_model(model)
    base.config.save_pretrained(out)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_checkpoint(ckpt: Path, run: RunState, *, seed: int = 0) -> None:
    """Load a checkpoint in place into the live model, optimizer and tensors, resharded to this run's
    ranks (collective under torchrun), restore this rank's RNG state (a rank the saving run did not
    have is seeded with ``seed`` instead), then each shared part and each of this rank's parts by
    name. A format this opsd cannot read is refused with one line (:func:`check_format`)."""
    ckpt = Path(ckpt)
    fmt = check_format(ckpt)
    if not (ckpt / "dcp").is_dir():
        raise UserError(
            f"{ckpt}: no dcp/ directory; it was written by an earlier opsd version in another "
            "layout. Resume it with that version, or start the run again"
        )
    loaded = load_distributed(ckpt, run.model, run.optimizer, tensors=run.tensors)
    collect_state_dict_cycles()
    mine = loaded.rank_state or {}
    if loaded.rank_state is None:
        torch.manual_seed(seed)
    else:
        set_rng_state(mine["rng"])
    shared = upgrade_state(loaded.shared_state, fmt)
    for name, part in run.shared.items():
        part.load_state_dict(shared[name])
    for name, part in run.per_rank.items():
        part.load_state_dict(mine.get(name))  # every rank calls each: a part may agree over ranks


def upgrade_state(state: dict, fmt: int) -> dict:
    """``state.pt`` of format ``fmt`` in this format's keys (formats 1-2: the counters at the top)."""
    if fmt < 3:
        state = dict(state)
        state["progress"] = {"step": state.pop("step"), "bad_steps": state.pop("bad_steps", 0)}
    return state


def check_format(ckpt: Path) -> int:
    """The checkpoint's format; one that this opsd cannot read is refused with one line."""
    fmt = int(load_state(ckpt).get("format", 1))
    if fmt > FORMAT:
        raise UserError(
            f"{ckpt}: checkpoint format {fmt} was written by a newer opsd (this one reads formats 1 to "
            f"{FORMAT}); upgrade opsd to resume it"
        )
    return fmt


def load_state(ckpt: Path, device: torch.device | str = "cpu") -> dict:
    """``state.pt`` of a checkpoint, refusing anything but plain data (no pickled code)."""
    path = Path(ckpt) / "state.pt"
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [line.strip() for line in str(err).splitlines()]
        detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), "")
        raise UserError(
            f"{path}: refused to load, it holds more than tensors and plain data (written by an older "
            f"opsd, or not by opsd); only load checkpoints you trust. {detail}".rstrip()
        ) from err
