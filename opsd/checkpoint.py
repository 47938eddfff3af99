"""Atomic checkpoints: written to a temporary directory, then renamed into place.

A run killed mid-save leaves only a ``.tmp-*`` directory behind; every ``step_*`` directory is
complete. Layout of ``RUN_DIR/checkpoints/step_000010/``:

* ``model/``   -- Hugging Face format: the LoRA adapter (peft) or the full model, plus tokenizer
* ``merged/``  -- optional, LoRA only: the adapter merged into a full model (vLLM/transformers load it)
* ``state.pt`` -- optimizer, scheduler, teacher (EMA), RNG states, data cursor, step counter
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

PREFIX = "step_"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.pt").is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    """Write everything needed to resume exactly; returns the checkpoint directory."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}-{int(time.time() * 1e6)}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        if save_merged and hasattr(model, "merge_and_unload"):
            _save_merged(model, tmp / "merged")
            tokenizer.save_pretrained(tmp / "merged")
        torch.save(state, tmp / "state.pt")
        if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _save_merged(peft_model: nn.Module, out: Path) -> None:
    """Merge the adapter into the weights, save a plain model, then unmerge (training goes on)."""
    peft_model.merge_adapter()
    try:
        base = peft_model.get_base_model()
        sd = {
            k.replace(".base_layer", ""): v
            for k, v in base.state_dict().items()
            if "lora_" not in k
        }
        base.save_pretrained(out, state_dict=sd, safe_serialization=True)
    finally:
        peft_model.unmerge_adapter()


def load_state(ckpt: Path, device: torch.device | str = "cpu") -> dict:
    return torch.load(Path(ckpt) / "state.pt", map_location=device, weights_only=False)
