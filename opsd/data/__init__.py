"""Data for OPSD: sources (files, datasets, the hub), prompts (token ids), batching (aligned micro-batches).

``sources`` and ``prompts`` import only the standard library at load time; ``batching`` needs torch, so
its names load on first use. ``import opsd.config`` (which takes the prompt defaults) therefore does not
pull in torch, transformers or datasets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opsd.data.prompts import (
    DEFAULT_INSTRUCTION,
    DEFAULT_TEACHER_TEMPLATE,
    TEMPLATE_FIELDS,
    PromptBuilder,
    apply_chat_template_ids,
    check_teacher_template,
    raw_splice_teacher_ids,
    student_prompt_ids,
    teacher_prompt_ids,
)
from opsd.data.sampler import DataCursor
from opsd.data.sources import FILE_SUFFIXES, Example, LoadReport, RowKeys, load_examples

if TYPE_CHECKING:
    from opsd.data.batching import (
        MicroBatch,
        Sample,
        check_alignment,
        make_microbatches,
        make_sample,
        pack_microbatches,
        pad_right,
        response_positions,
    )

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEFAULT_TEACHER_TEMPLATE",
    "FILE_SUFFIXES",
    "TEMPLATE_FIELDS",
    "DataCursor",
    "Example",
    "LoadReport",
    "MicroBatch",
    "PromptBuilder",
    "RowKeys",
    "Sample",
    "apply_chat_template_ids",
    "check_alignment",
    "check_teacher_template",
    "load_examples",
    "make_microbatches",
    "make_sample",
    "pack_microbatches",
    "pad_right",
    "raw_splice_teacher_ids",
    "response_positions",
    "student_prompt_ids",
    "teacher_prompt_ids",
]


def __getattr__(name: str) -> Any:
    if name in __all__:  # only the batching names are not imported above
        from opsd.data import batching

        return getattr(batching, name)
    raise AttributeError(f"module 'opsd.data' has no attribute {name!r}")
