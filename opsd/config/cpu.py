"""The ``cpu`` section: the CPU speed and memory mechanisms, each with its own switch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from opsd.config.base import Section, Switch
from opsd.cpu import SECTION_DEFAULTS


class CpuTuning(Section):
    """The CPU speed and memory mechanisms of docs/cpu.md: what runs on a CPU, each with its own switch.
    On a GPU none of them runs. The defaults are the CPU room's own (``opsd.cpu.SECTION_DEFAULTS``), which
    it plans with when no config is given."""

    tuning: Annotated[Literal["auto", "off"], Switch] = Field(
        SECTION_DEFAULTS["tuning"],
        description="auto: on a CPU, each mechanism runs where its gate holds; off: the plain path "
        "(transformers + peft + the fused loss), none of them. On a GPU the CPU plan is empty either way.",
    )
    pack_rows: bool = Field(
        SECTION_DEFAULTS["pack_rows"],
        description="On a CPU, a micro-batch's rows run packed into one forward (no padding), attention "
        "called once per row; false: the padded, batched forward.",
    )
    bucket_widths: bool = Field(
        SECTION_DEFAULTS["bucket_widths"],
        description="On a CPU in bf16 or fp16, padded widths rounded up to buckets (bounds PyTorch's "
        "per-length cache of bf16 attention kernels).",
    )
    frozen_layout: bool = Field(
        SECTION_DEFAULTS["frozen_layout"],
        description="On a CPU, frozen weights stored in the layout its GEMMs read fastest.",
    )
    trim_heap: bool = Field(
        SECTION_DEFAULTS["trim_heap"],
        description="On a Linux glibc CPU, free heap pages returned to the OS after generation and after "
        "each step (malloc_trim; changes no setting).",
    )
    tune_malloc: bool | None = Field(
        SECTION_DEFAULTS["tune_malloc"],
        description="On a Linux glibc CPU, glibc's malloc settings (mallopt) tuned in the micro-batch loop "
        "so freed blocks are reused; opt-in, as glibc cannot restore them afterwards. null: on under the "
        "`opsd` command, off for a Python caller; a MALLOC_* or GLIBC_TUNABLES malloc setting keeps it off.",
    )
