"""Atomic, safe-to-load checkpoints: written to a temporary directory, then renamed into place.

A run killed mid-save leaves only a ``.tmp-*`` directory behind (removed at the next save, or by
:func:`clean_partial`); every ``step_*`` directory is complete. One layout for one process and for
any number of torchrun ranks (:func:`opsd.distributed.save_distributed`), so a run resumes at any
world size. ``RUN_DIR/checkpoints/step_000010/``:

* ``dcp/``     -- trainable weights, optimizer state and the EMA teacher (torch.distributed.checkpoint;
  resharded on load to the current number of ranks)
* ``model/``   -- Hugging Face format: the LoRA adapter (peft) or the full model, plus tokenizer
* ``merged/``  -- optional, LoRA only: the adapter merged into a full model (vLLM/transformers load it)
* ``state.pt`` -- step counter, scheduler, data cursor (shared by all ranks)
* ``rank_NNNNN.pt`` -- each rank's own RNG state and counters

The ``.pt`` files hold only tensors, numbers, strings, lists, tuples and dicts, and are loaded with
``torch.load(weights_only=True)``: a checkpoint from someone else cannot run code when resumed.
Frozen weights (the LoRA base model) are not saved; they come from ``model.path``.
"""

from __future__ import annotations

import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from opsd.distributed import (
    TMP_PREFIX,
    gather_full_state_dict,
    is_sharded,
    load_distributed,
    rank_world,
    save_distributed,
)
from opsd.errors import TrainingError, UserError
from opsd.models import base_model, merged_state_dict

PREFIX = "step_"
# state.pt's "format". 1 (no key): before float32 master weights; a bf16 full fine-tuning run stored
# bf16 weights and AdamW state, which load exactly into the float32 masters of format 2.
FORMAT = 2


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


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove temporary directories a killed save left behind; returns what was removed."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    partial = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(TMP_PREFIX))
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


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


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError from Python, RuntimeError from torch.save (and
    opsd.distributed.PeerError: another rank's failure), safetensors' own."""
    errors: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    try:
        from safetensors import SafetensorError

        errors += (SafetensorError,)
    except ImportError:
        pass
    return errors


def _cause(err: BaseException, rank: int) -> BaseException:
    """The exception inside torch.distributed.checkpoint's wrapper (this rank's, else the first)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException) or not err.failures:
        return err
    return (err.failures.get(rank) or next(iter(err.failures.values())))[0]


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: nn.Module,
    tokenizer,
    state: dict,
    *,
    keep_last: int,
    save_merged: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    rank_state: dict | None = None,
    tensors: dict[str, Tensor] | None = None,
) -> Path:
    """Write everything needed to resume exactly; returns the checkpoint directory.

    ``state`` is shared by all ranks (rank 0's is written), ``rank_state`` is this rank's own (its
    RNG state is added); the trainable weights, ``optimizer`` and ``tensors`` go to ``dcp/``. Collective under torchrun:
    every rank calls it, and rank 0 writes the Hugging Face export from gathered weights. A failed
    write (full disk, I/O error) on any rank raises :class:`TrainingError` after removing the
    temporary directory; earlier checkpoints are never touched before the new one is complete.
    """
    rank, _ = rank_world()
    root = checkpoint_dir(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    if rank == 0:
        clean_partial(run_dir)
    weights, merged = _export_weights(model, save_merged)

    def export(tmp: Path) -> None:
        model.save_pretrained(tmp / "model", safe_serialization=True, **weights)
        tokenizer.save_pretrained(tmp / "model")
        if merged is not None:
            base_model(model).save_pretrained(tmp / "merged", state_dict=merged, safe_serialization=True)
            tokenizer.save_pretrained(tmp / "merged")

    try:
        mine = {**(rank_state or {}), "rng": rng_state()}
        save_distributed(final, model, optimizer, mine, state, tensors=tensors, export=export)
    except BaseException as err:
        cause = _cause(err, rank)
        if cause is err and not isinstance(err, _write_errors()):
            raise
        if not isinstance(cause, _write_errors()):
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
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _export_weights(model: nn.Module, save_merged: bool) -> tuple[dict, dict[str, Tensor] | None]:
    """What the Hugging Face export writes: ``save_pretrained`` keyword arguments for ``model/``
    and the merged weights for ``merged/`` (LoRA folded in out of place, the live weights untouched).

    Unsharded, ``save_pretrained`` reads the live model. Sharded, this is collective and rank 0
    gets the gathered full weights (the others empty dicts).
    """
    lora = hasattr(model, "peft_config")
    if not is_sharded(model):
        return {}, merged_state_dict(model) if save_merged and lora else None
    weights = {"state_dict": gather_full_state_dict(model, trainable_only=lora)}
    return weights, _gather_on_rank0(merged_state_dict(model)) if save_merged and lora else None


def _gather_on_rank0(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Collective: each sharded tensor gathered in turn; rank 0 keeps CPU copies, the others nothing."""
    from torch.distributed.tensor import DTensor

    rank, _ = rank_world()
    out = {}
    for k, v in sd.items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if rank == 0:
            out[k] = full.cpu()
    return out


def load_checkpoint(
    ckpt: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    tensors: dict[str, Tensor] | None = None,
    seed: int = 0,
) -> tuple[dict, dict]:
    """Load a checkpoint in place into the live model, optimizer and ``tensors``, resharded to this
    run's ranks (collective under torchrun), and restore this rank's RNG state; a rank the saving
    run did not have is seeded with ``seed`` instead. Returns the shared state and this rank's own
    (empty for a new rank)."""
    ckpt = Path(ckpt)
    if not (ckpt / "dcp").is_dir():
        raise UserError(
            f"{ckpt}: no dcp/ directory; it was written by an earlier opsd version in another "
            "layout. Resume it with that version, or start the run again"
        )
    loaded = load_distributed(ckpt, model, optimizer, tensors=tensors)
    if loaded.rank_state is None:
        torch.manual_seed(seed)
        return loaded.shared_state, {}
    set_rng_state(loaded.rank_state["rng"])
    return loaded.shared_state, loaded.rank_state


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
