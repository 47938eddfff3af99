"""LoRA folded into copies of the weights while the HF engine decodes on a CPU (the plan's
``fold_lora_bytes``; ``rollout.fold_lora`` switches it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from opsd.models import lora_modules, plus_deltas


@contextmanager
def lora_folded(model: nn.Module, max_bytes: int) -> Iterator[bool]:
    """Inside: every LoRA-wrapped weight replaced by a new tensor ``W + scale * B @ A`` (what
    :func:`opsd.models.merged_weights` gives a vLLM engine) and the adapters off, so each projection
    is one matrix product instead of three; on exit the original tensors are back, untouched. Yields
    whether it folded: not when the copies would exceed ``max_bytes``, nor for a DoRA adapter or a
    sharded model.

    Why: decoding a few rows at a time, a LoRA projection's two extra small products and the
    scaling cost about as much as the base product (docs/results.md, "HF engine"). The copies
    live only while generating, when the activations of a training step are not held.
    """
    from torch.distributed.tensor import DTensor

    mods = lora_modules(model)
    weights = [m.base_layer.weight for m in mods.values()]
    size = sum(w.numel() * w.element_size() for w in weights)
    dora = any(any(getattr(m, "use_dora", {}).values()) for m in mods.values())
    if not mods or size > max_bytes or dora or any(isinstance(w, DTensor) for w in weights):
        yield False
        return
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        for (name, mod), w in zip(mods.items(), weights):
            folded = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=w.device)
            plus_deltas(w.detach(), mod, name, out=folded)  # keeps w's (column-major) layout
            saved.append((w, w.data))
            w.data = folded
        with model.disable_adapter():
            yield True
    finally:
        for w, data in saved:
            w.data = data
