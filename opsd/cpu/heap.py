"""glibc's heap on a Linux CPU: free pages back to the OS between steps (``malloc_trim``, an action
that changes no setting), and, opt-in, malloc settings that keep the micro-batch loop's freed blocks
resident for the next micro-batch (``mallopt``: process-wide, and glibc has no getter to restore
them exactly, so only ``cpu.tune_malloc`` or the ``opsd`` command turns it on)."""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

# glibc's mallopt parameters (malloc.h), and the most its dynamic mmap threshold rises to (32 MiB, with
# trimming at twice that) as freed blocks of up to that size are unmapped, as a training step's are.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_MAX_DEFAULT = 65536
_MMAP_THRESHOLD_SETTLED = 32 << 20
_TRIM_ALMOST_NEVER = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before free() trims it
USER_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def glibc() -> ctypes.CDLL | None:
    """The C library whose heap holds CPU tensors: glibc on Linux, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def user_malloc_settings(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the user tuned glibc's malloc through the environment: then opsd leaves it alone."""
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(k in env for k in USER_MALLOC_ENV) or "glibc.malloc." in tunables


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (``malloc_trim``). Returns whether it ran.

    Why: a step frees and reallocates its activations, generation buffers and loss blocks on the heap,
    and the holes stayed resident: the peak RSS grew step after step (docs/cpu.md, "Heap trims")."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@contextmanager
def reuse_freed_blocks(*, keep_pages: bool = False) -> Iterator[bool]:
    """Inside, every CPU tensor comes from glibc's heap and freeing one never shrinks it, so a block one
    micro-batch frees is the next one's, already resident.

    Why: the fused loss's ``[chunk, V]`` blocks are above glibc's mmap threshold, so each was mapped,
    zero-filled page by page and unmapped again: ~350,000 page faults a SmolLM2-135M step
    (docs/cpu.md, "Reused heap blocks"). On exit glibc's settings are those its own dynamic threshold
    reaches in a training process (not what they were: glibc cannot say); ``keep_pages``: the heap
    still never shrinks by itself after the loop (beside the colocated vLLM engine, which never trims).
    Yields False and does nothing off glibc or when the user set malloc through the environment."""
    libc = glibc()
    if libc is None or user_malloc_settings():
        yield False
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ALMOST_NEVER)
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _MMAP_MAX_DEFAULT)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_SETTLED)
        if not keep_pages:
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_SETTLED)
