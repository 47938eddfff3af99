"""Frozen weights in the layout a CPU's GEMMs read fastest."""

from __future__ import annotations

from torch import nn


def frozen_weights(*models: nn.Module | None, column_major: bool = True) -> int:
    """Lays out every frozen ``nn.Linear`` weight column-major (the same ``[out, in]`` values, stored as
    the contiguous transpose) and copies every other frozen CPU tensor into the process's own memory.
    Returns how many weights changed layout.

    Why: ``F.linear`` multiplies by ``W.T``, and MKL's float32 GEMM reads a column-major ``W`` about
    twice as fast at the few rows of a decode step, and no slower at a forward's thousands
    (docs/cpu.md, "Frozen weight layout"). The values do not change; products may round differently in
    the last bit, the same for every forward that reads them. Copying also releases the checkpoint's
    memory map. Trainable weights keep their layout.

    ``column_major=False`` only copies: for a process that decodes in vLLM, where each weight sync
    would otherwise pay a transposing pass."""
    seen: set[int] = set()
    moved = 0
    for model in models:
        if model is None:
            continue
        linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in seen or t.requires_grad or t.device.type != "cpu":
                continue
            seen.add(id(t))
            if column_major and id(t) in linear and t.dim() == 2:
                t.data = t.data.t().contiguous().t()
                moved += 1
            else:
                t.data = t.data.clone()
    return moved
