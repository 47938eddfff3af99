"""Atomic, safe-to-load checkpoints: written to a temporary directory, then renamed into place.

A run killed mid-save leaves only a ``.tmp-*`` directory behind (removed at the next save, or by
:func:`clean_partial`); every ``step_*`` directory is complete. Layout of
``RUN_DIR/checkpoints/step_000010/``:

* ``model/``   -- Hugging Face format: the LoRA adapter (peft) or the full model, plus tokenizer
* ``merged/``  -- optional, LoRA only: the adapter merged into a full model (vLLM/transformers load it)
* ``state.pt`` -- optimizer, scheduler, teacher (EMA), RNG states, data cursor, step counter

``state.pt`` holds only tensors, numbers, strings, lists, tuples and dicts, and is loaded with
``torch.load(weights_only=True)``: a checkpoint from someone else cannot run code when resumed.
"""

from __future__ import annotations

import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from opsd.errors import TrainingError, UserError
from opsd.models import merged_state_dict

PREFIX = "step_"
TMP_PREFIX = ".tmp-"


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
    """Python, numpy and torch (and CUDA) generator states as tensors, ints, floats and lists."""
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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
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
        torch.cuda.set_rng_state_all(state["cuda"])


# --- save and load ----------------------------------------------------------------------------


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError from Python, RuntimeError from torch.save, safetensors' own."""
    errors: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    try:
        from safetensors import SafetensorError

        errors += (SafetensorError,)
    except ImportError:
        pass
    return errors


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: nn.Module,
    tokenizer,
    state: dict,
    *,
    keep_last: int,
    save_merged: bool = False,
) -> Path:
    """Write everything needed to resume exactly; returns the checkpoint directory.

    A failed write (full disk, I/O error) raises :class:`TrainingError` after removing the
    temporary directory; earlier checkpoints are never touched before the new one is complete.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    clean_partial(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f"{TMP_PREFIX}{final.name}-{int(time.time() * 1e6)}"
    try:
        tmp.mkdir()
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        if save_merged and hasattr(model, "peft_config"):
            _save_merged(model, tmp / "merged")
            tokenizer.save_pretrained(tmp / "merged")
        torch.save(state, tmp / "state.pt")
    except _write_errors() as err:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        intact = (
            f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
        )
        raise TrainingError(
            f"writing checkpoint step {step} to {root} failed (disk full?): {type(err).__name__}: "
            f"{' '.join(str(err).split())}; {intact}"
        ) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        replaced = root / f"{TMP_PREFIX}old-{tmp.name.removeprefix(TMP_PREFIX)}"
        final.rename(replaced)
        tmp.rename(final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _save_merged(peft_model: nn.Module, out: Path) -> None:
    """A plain HF model with the adapter folded in; the live weights are left bit-identical."""
    peft_model.get_base_model().save_pretrained(
        out, state_dict=merged_state_dict(peft_model), safe_serialization=True
    )


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


def load_model_weights(model: nn.Module, model_dir: Path, *, lora: bool) -> None:
    """Load a checkpoint's ``model/`` into the live model: the adapter with LoRA, else all weights."""
    from safetensors.torch import load_file

    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(model_dir / "adapter_model.safetensors"))
    else:
        fresh = type(model).from_pretrained(model_dir, torch_dtype=model.dtype)
        model.load_state_dict(fresh.state_dict())
