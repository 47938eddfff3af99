"""Padded widths rounded up to buckets where the CPU computes in bf16 (the plan's ``bucket_widths``).

Why: PyTorch's CPU bf16 attention keeps a kernel per sequence length that is never freed (~1.8 MiB a
length on an AMX Xeon; docs/cpu.md, "Width buckets"); sixteen widths per doubling bound them."""

from __future__ import annotations


def bucket_width(n: int) -> int:
    """``n`` rounded up to one of sixteen widths per doubling (steps of ``2**(ceil(log2 n) - 5)``):
    at most 6% wider (~2% on average), and ~16 distinct widths from ``L`` to ``2L``."""
    step = 1 << max(0, (n - 1).bit_length() - 5)
    return -(-n // step) * step
