"""The device, one fact with one resolver: which device a setting names, whether this machine has it,
and a description of the machine for the records that results carry.

Light on purpose (torch is imported inside the functions): ``opsd.config`` validates with it.

Every config that takes a device (``opsd train``'s ``device``, ``opsd eval``, ``opsd sft``) validates
with :func:`check_device_setting` and resolves with :func:`resolve_device`; nothing else parses it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opsd.errors import UserError

if TYPE_CHECKING:
    import torch

DEVICE_SETTINGS = "auto, cpu, cuda or cuda:N"
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def check_device_setting(value: str) -> str:
    """A pydantic validator's body: the setting's spelling, before anything is resolved."""
    if not _DEVICE_RE.fullmatch(value):
        raise ValueError(f"must be {DEVICE_SETTINGS}")
    return value


def resolve_device(setting: str, *, local_rank: int | None = None) -> torch.device:
    """``auto`` picks CUDA when there is one; asking for CUDA without one is a user error.

    ``local_rank``: this process's place on its node under torchrun, which then owns ``cuda:LOCAL_RANK``
    (a ``cuda:N`` setting would pin every rank to one GPU, so it is refused there)."""
    import torch

    if not _DEVICE_RE.fullmatch(setting):
        raise UserError(f"device={setting!r}: expected {DEVICE_SETTINGS}")
    cuda = torch.cuda.is_available()
    if setting.startswith("cuda") and not cuda:
        build = "a CPU-only torch build" if torch.version.cuda is None else "no visible CUDA device"
        raise UserError(f"device={setting}: this machine has {build}; use device=cpu or device=auto")
    if setting == "cpu" or (setting == "auto" and not cuda):
        return torch.device("cpu")
    if local_rank is None:
        index = int(setting.split(":")[1]) if ":" in setting else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device={setting}: only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda" if setting == "auto" else setting)
    if setting.startswith("cuda:"):
        raise UserError(
            f"device={setting!r} pins every rank to one GPU; under torchrun use device: cuda or auto "
            "(rank r uses cuda:LOCAL_RANK)"
        )
    if local_rank >= torch.cuda.device_count():
        raise UserError(
            f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
            "set --nproc-per-node to at most the GPU count"
        )
    return torch.device("cuda", local_rank)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_isa() -> str:
    """What decides bf16 speed on a CPU: AMX, AVX512-BF16, or neither (bf16 emulated)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return "unknown"
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX512, no bf16 units"
    return "no AVX512, no bf16 units"


def machine_info() -> dict[str, Any]:
    """What a result needs to say about where it came from."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "cpu_isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


OPENMP_SPIN = "10000"  # libgomp pauses before an idle thread sleeps: ~0.1 ms


def openmp_waiting(env: MutableMapping[str, str]) -> None:
    """How OpenMP's idle threads wait, unless the user chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
    set): passive, after a short spin. Must run before torch loads OpenMP; ``opsd``'s command line
    and the bench scripts call it first thing.

    Why: libgomp's default spins ~300,000 pauses, which made CPU steps several times slower whenever
    anything else shared the cores; sleeping at once made every one of the hundreds of small parallel
    operators in a vLLM decode step wait for the other thread to wake, and generation ran 2.1x slower
    (9.4 against 4.5 s for 8 responses of SmolLM2-135M; 10,000 pauses ran it as fast as 100,000, and
    1,000 at 6.4 s), the student's forward and backward 1.2x (development readings in
    docs/benchmarks.md, "OpenMP waiting, again").
    """
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN


def bucket_widths(device: torch.device, compute_dtype: torch.dtype | None) -> bool:
    """Whether padded sequence widths go in buckets (:func:`opsd.data.batching.bucket_width`): on a CPU
    computing in bf16 or fp16.

    Why: PyTorch's CPU attention (``scaled_dot_product_attention``) in bf16 keeps a kernel for every
    sequence length it has seen, in a cache that is never emptied: ~1.8 MiB a length on an AMX Xeon,
    2.1 GiB after the lengths 100-1300 (``bench/sdpa_lengths.py``), and a run's micro-batches and
    prompts grew its resident set ~0.1 GiB a step (docs/benchmarks.md, "Attention kernels kept per
    length"). Sixteen widths per doubling of the length bound it. float32 keeps no such cache; GPU
    kernels neither; nor bf16 on an AMD EPYC with AVX512-BF16 and no AMX (0.02 MiB a length), where
    the buckets cost only their padding."""
    import torch

    half = compute_dtype in (torch.bfloat16, torch.float16)
    return device.type == "cpu" and half


PER_ROW_TOKENS = 128  # the shortest row that runs a forward of its own on a CPU ...
PER_ROW_FLOPS = 1 << 29  # ... and the least work that forward must do (2 x non-embedding params x tokens)


def per_row_from(device: torch.device, sharded: bool, params: int) -> int | None:
    """The shortest row, in tokens, that runs a forward of its own in a micro-batch of unequal rows
    (:func:`opsd.data.batching.make_microbatches`): on a CPU in one process, the larger of 128 tokens
    and ``PER_ROW_FLOPS / (2 * params)`` (``params``: the model's non-embedding parameters); ``None``
    (always batched) on a GPU, which needs the batch to fill it, and under torchrun, where a forward
    per row would gather every layer once per row.

    Why: a forward per row computes no padding and needs no attention mask, which keeps attention
    from skipping the causal triangle (SmolLM2-135M in float32: the step's micro-batch loop 8% faster
    in a development reading, docs/benchmarks.md "One forward per row on a CPU"), but each row pays a
    forward's fixed cost, one read of the weights and the dispatch of every operator: 37 ms for a
    one-token SmolLM2 forward (30 layers; ~30 tokens of its compute), 0.5 ms for the demo's 2-layer
    model (~90 tokens of its own). Rows of 128 tokens and 2**29 FLOPs keep that a small part of a
    row's forward; the demo's and the tests' tiny models stay batched (their short rows ran 35%
    slower one at a time). The trainer runs such rows packed into one forward where the model's
    attention allows (:func:`opsd.models.pack_rows`), which pays that cost once a micro-batch."""
    if device.type != "cpu" or sharded:
        return None
    return max(PER_ROW_TOKENS, -(-PER_ROW_FLOPS // max(1, 2 * params)))


def available_ram(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of RAM the kernel could give this process now without swapping (``MemAvailable``), or
    None where that is not known (not Linux, or a kernel older than 3.14)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        return None
    return None


def _glibc(device: torch.device) -> ctypes.CDLL | None:
    """The C library whose heap holds ``device``'s tensors: glibc on a Linux CPU, else None."""
    if device.type != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_freed_memory(device: torch.device) -> bool:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``) when ``device`` is a CPU: the
    trainer calls it after generation and after each step.

    Why: tensors below glibc's mmap threshold (which grows to 32 MiB) come from the heap, and a step
    frees and reallocates its activations, generation buffers and loss blocks there: the holes stayed
    resident and the peak RSS grew step after step (2.6 -> 2.9 GiB over two SmolLM2-135M LoRA steps,
    docs/benchmarks.md "Train step memory"). Trimming between steps costs the next step a page fault
    per reused page. Fixing the threshold instead (``MALLOC_MMAP_THRESHOLD_=131072``: every tensor of
    128 KiB and up mapped and unmapped) held that step at 1.65 GiB but made the student's forward and
    backward 2-5x slower on the 2-core VM the figures come from (a map, faults and an unmap per
    activation; which of them costs most was not measured); it stays a user's choice (README).
    Returns whether it ran (False for an accelerator, whose tensors are not on this heap, and off glibc).
    """
    libc = _glibc(device)
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


# glibc's mallopt parameters (malloc.h), and the most its dynamic mmap threshold rises to (32 MiB, with
# trimming at twice that) as freed blocks of up to that size are unmapped, as a training step's are.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_MAX_DEFAULT = 65536
_MMAP_THRESHOLD_SETTLED = 32 << 20
_TRIM_ALMOST_NEVER = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before free() trims it
_USER_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _user_malloc_settings() -> bool:
    """Whether the user tuned glibc's malloc through the environment: then opsd leaves it alone."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(k in os.environ for k in _USER_MALLOC_ENV) or "glibc.malloc." in tunables


@contextmanager
def reuse_freed_memory(device: torch.device, *, keep_pages: bool = False) -> Iterator[bool]:
    """Inside, every CPU tensor comes from glibc's heap and freeing one never shrinks it, so a block one
    micro-batch frees is the next one's, already resident; the trainer wraps its micro-batch loop in it.

    Why: the fused loss's ``[chunk, V]`` blocks (25-50 MB at SmolLM2's vocabulary) are above glibc's
    mmap threshold, so each was mapped afresh, zero-filled page by page and unmapped again: ~350,000
    page faults a SmolLM2-135M step, and the loss took 2.3-2.7 s a step beside the colocated vLLM
    engine against 1.2 s with its blocks reused (1.4 against 1.1 s with the HF engine; development
    readings in docs/benchmarks.md, "The loss's fresh pages"). Only the loop: generation keeps glibc's
    usual mapping, whose varied buffer sizes would leave the heap fragmented, and with the HF engine
    the trainer's ``malloc_trim`` after each step still returns the free pages. On exit glibc's
    settings are those its own dynamic threshold reaches in a training process.

    ``keep_pages`` (the trainer's, beside the colocated vLLM engine: ``Trainer.trim_heap`` false): on
    exit the heap still never shrinks by itself. Otherwise the first free after the loop, under the
    restored 64 MiB trim threshold, hands the loop's pages at the heap's free top back (unless a small
    live chunk above them pins it: it depends on the heap's layout), and the next step
    faults them again: 49,000-155,000 faults a float32 pass over one step's 1,456-token micro-batches
    (development readings, docs/benchmarks.md, "Kept heap pages"). Does nothing (yields False) off a
    glibc CPU or when the user set glibc's malloc through ``MALLOC_*_`` or ``GLIBC_TUNABLES``.
    """
    libc = _glibc(device)
    if libc is None or _user_malloc_settings():
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
