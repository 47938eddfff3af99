"""Whether this CPU multiplies bf16 matrices natively: ``model.dtype: auto`` computes in bf16 only
where it does (:func:`opsd.devices.has_bf16_units`). ``OPSD_CPU_BF16=0|1`` overrides the probe."""

from __future__ import annotations

import os

from opsd.errors import UserError

CPU_BF16_ENV = "OPSD_CPU_BF16"


def cpu_has_bf16_units() -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 matrices natively, and why opsd thinks so.

    Without AMX-BF16 or AVX512-BF16, oneDNN emulates bf16 products, measured ~25x slower than float32
    on an AMD EPYC without either. ``OPSD_CPU_BF16=0|1`` overrides the probe (odd CPUs, and the test
    suite, which checks both answers on every machine).
    """
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None and forced.strip() != "":
        if forced.strip() not in ("0", "1"):
            raise UserError(f"{CPU_BF16_ENV}={forced!r}: expected 0 (no bf16 units) or 1 (bf16 units)")
        on = forced.strip() == "1"
        return on, f"{CPU_BF16_ENV}={forced.strip()} overrides the CPU probe"
    capped = isa_cap()
    if capped:
        return False, f"{capped} keeps the kernels below the CPU's bf16 instructions (bf16 would be emulated)"
    flags = cpu_flags()
    if "amx_bf16" in flags or "avx512_bf16" in flags:
        return True, "CPU with AMX/AVX512-BF16 matrix units"
    return False, "CPU without bf16 matrix units (bf16 would be emulated, many times slower)"


# oneDNN ISA caps that still reach its bf16 instructions (AVX512-BF16, AMX, AVX10); any other cap keeps
# the kernels on AVX2 or plain AVX512, where bf16 products are emulated.
_BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")


def isa_cap() -> str | None:
    """The environment setting that caps torch's or oneDNN's kernels below bf16 instructions, if any:
    ``ATEN_CPU_CAPABILITY=avx2`` or ``ONEDNN_MAX_CPU_ISA=AVX2`` (how an AVX2-only machine is reproduced
    on a newer one) make a CPU with bf16 units compute as one without."""
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in ("default", "avx2"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa and not isa.startswith(_BF16_ISAS):
        return f"ONEDNN_MAX_CPU_ISA={isa}"
    return None


def cpu_flags() -> str:
    """The kernel's CPU flags (``/proc/cpuinfo``), empty where it does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""
