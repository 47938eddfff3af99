"""How OpenMP's idle threads wait: set by the ``opsd`` command (and the bench scripts) before torch
loads OpenMP; the library never sets it (it is process-wide)."""

from __future__ import annotations

from collections.abc import MutableMapping

OPENMP_SPIN = "10000"  # libgomp pauses before an idle thread sleeps: ~0.1 ms


def openmp_waiting(env: MutableMapping[str, str]) -> bool:
    """Passive waiting after a short spin, unless the user chose (``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` set). Returns whether it set anything.

    Why: libgomp's default spin made CPU steps several times slower whenever anything else shared the
    cores, and sleeping at once slowed vLLM's many small decode operators; a short spin keeps both
    (docs/cpu.md, "OpenMP waiting")."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN
    return True
