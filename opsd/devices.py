"""The device, one fact with one resolver: which device a setting names, whether this machine has it,
and a description of the machine for the records that results carry.

Light on purpose (torch is imported inside the functions): ``opsd.config`` validates with it.

Every config that takes a device (``opsd train``'s ``device``, ``opsd eval``, ``opsd sft``) validates
with :func:`check_device_setting` and resolves with :func:`resolve_device`; nothing else parses it.
"""

from __future__ import annotations

import os
import platform
import re
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


def check_compiler(device: torch.device) -> None:
    """``model.compile`` on a CPU: inductor writes C++ and needs a compiler to build it."""
    if device.type != "cpu":
        return
    import shutil

    names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(name and shutil.which(name) for name in names):
        raise UserError(
            "model.compile=true on a CPU needs a C++ compiler (g++ or clang++ on PATH, or CXX); "
            "install one or set model.compile=false"
        )


def has_bf16_units(device: torch.device) -> tuple[bool, str]:
    """bf16 matrix units on ``device``, and why opsd thinks so: CUDA's driver says; on a CPU the
    instruction set does (:func:`opsd.cpu.cpu_has_bf16_units`)."""
    import torch

    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return True, "CUDA device with bf16 support"
        return False, "CUDA device without bf16 support"
    from opsd.cpu import cpu_has_bf16_units

    return cpu_has_bf16_units()


def activation_room(device: torch.device, reserve: int, *, beside_vllm: bool) -> tuple[int, str]:
    """Bytes a micro-batch's saved activations may take on ``device``, and why: a quarter of a GPU's
    free memory less ``reserve`` (what the step will take that is not allocated yet: AdamW's state),
    or the CPU's budget (:func:`opsd.cpu.activation_budget`)."""
    import torch

    if device.type == "cuda":
        # What the caching allocator holds but does not use is free to this step too.
        torch.cuda.empty_cache()
        free = max(0, torch.cuda.mem_get_info(device)[0] - reserve)
        return free // 4, f"a quarter of the {free / 2**30:.1f} GiB free on {device} after AdamW's state"
    from opsd.cpu import activation_budget

    return activation_budget(reserve, beside_vllm=beside_vllm)


def rng_devices(device: torch.device) -> list[torch.device]:
    """The devices whose generators ``torch.random.fork_rng`` saves besides the CPU's: ``device``
    where it is a CUDA one."""
    return [device] if device.type == "cuda" else []


def synchronizes(device: torch.device) -> bool:
    """Whether ``device`` runs kernels behind the host's back (CUDA), so a phase timer must wait for it."""
    return device.type == "cuda"


def reset_peak_memory(device: torch.device) -> None:
    """Count ``device``'s peak memory from here (CUDA); a CPU's peak RSS cannot be reset."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset; CPU: the process's peak RSS."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def empty_cache(device: torch.device | None) -> None:
    """Hand what CUDA's caching allocator holds unused back to the driver; nothing elsewhere."""
    import torch

    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def vllm_device(device: torch.device | None) -> torch.device:
    """The device the colocated vLLM engine runs on: the CPU for vLLM's CPU build (or without CUDA),
    else ``device`` where it is a CUDA one, else the current CUDA device."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or not torch.cuda.is_available():
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def use_device(dev: torch.device) -> torch.device:
    """Make ``cuda:N`` the current CUDA device of this process; returns ``dev``. Without it, one
    process on cuda:1 keeps cuda:0 as current: step timers, the CUDA RNG state in checkpoints and
    vLLM's engine would go to cuda:0."""
    import torch

    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def process_group_args(dev: torch.device) -> dict[str, Any]:
    """``init_process_group``'s backend for ranks on ``dev``: NCCL for CUDA tensors beside gloo for CPU
    ones (``dev`` made the current device first), gloo alone on a CPU."""
    import torch

    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        return {"backend": "cpu:gloo,cuda:nccl", "device_id": dev}
    return {"backend": "gloo"}


def collective_device(backend_types: set[str]) -> torch.device:
    """Where a tensor goes for a collective its own device's backend cannot run: the current CUDA
    device where the backend takes CUDA tensors, else the CPU."""
    import torch

    if "cuda" in backend_types:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_device(device_type: str) -> torch.device:
    """This process's device of a mesh's ``device_type``: the current CUDA device, or that type's."""
    import torch

    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def offloads_to_host(device: torch.device) -> bool:
    """Whether weights on ``device`` can be offloaded to host memory (FSDP's CPU offload): a GPU's; a
    CPU's are there already."""
    return device.type == "cuda"


def on_cuda(tensors: list) -> bool:
    """Whether every tensor (FSDP2's DTensors included) lives on a CUDA device; False for none."""
    return bool(tensors) and all(t.is_cuda for t in tensors)


def torch_build() -> str:
    """Which accelerator this torch was built for: CUDA, ROCm or none."""
    import torch

    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build"
    return "CPU-only build"


def gpus_line() -> str:
    """The visible GPUs with their memory, or why there are none."""
    import torch

    if not torch.cuda.is_available():
        return "none (CPU-only torch build)" if torch.version.cuda is None else "none visible"
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(f"cuda:{i} {props.name} {props.total_memory / 2**30:.1f} GiB")
    return f"{len(gpus)}: " + "; ".join(gpus)
