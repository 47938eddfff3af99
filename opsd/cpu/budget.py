"""How much a CPU step may hold in saved activations (``optim.max_tokens_per_microbatch: auto``)."""

from __future__ import annotations

import os

ACTIVATION_BUDGET = 512 << 20  # bytes of saved activations per micro-batch on a CPU
ACTIVATION_BUDGET_BESIDE_VLLM = 2 << 30  # the same with the colocated vLLM engine in the process


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


def activation_budget(reserve: int, *, beside_vllm: bool) -> tuple[int, str]:
    """Bytes of saved activations a micro-batch may hold on a CPU, and why.

    512 MiB with the HF engine: generation, the data and the OS share the RAM, and a SmolLM2-135M LoRA
    step then peaks under 2 GiB. Beside the colocated vLLM engine (its weight copy and KV cache hold
    the process near 4 GiB anyway) 2 GiB, at most a quarter of the RAM available to this rank less
    ``reserve`` (AdamW's state): one or two samples per micro-batch ran the student pass 1.3-1.9x
    slower (docs/cpu.md, "Micro-batch budget")."""
    if not beside_vllm:
        return ACTIVATION_BUDGET, "512 MiB on the CPU"
    room, where = ACTIVATION_BUDGET_BESIDE_VLLM, "2 GiB on the CPU beside the vLLM engine"
    ram = available_ram()
    if ram is not None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks here share it
        quarter = max(0, ram // local_ranks - reserve) // 4
        if quarter < room:
            room = quarter
            where = f"a quarter of the {quarter * 4 / 2**30:.1f} GiB of RAM available, vLLM resident"
    return room, where
