"""Evaluation: :mod:`opsd.eval.loop` is the loop the trainer, `opsd demo` and `opsd eval` share
(generation, grading, Avg@k and pass@k, the rank-sharded variant); :mod:`opsd.eval.cli` is
`opsd eval` itself (its config, flags, table and output files).

Who calls which evaluate function:

- :func:`evaluate_model`: one live (model, tokenizer) -> :class:`EvalResult`; `opsd demo`, bench/,
  and the two below.
- :func:`evaluate_sharded`: :func:`evaluate_model` split over data-parallel ranks; the trainer.
- :func:`evaluate`: models loaded from paths, results written to files; `opsd eval`.
"""

from opsd.eval.cli import (
    EVAL_FLAGS,
    EvalCommandConfig,
    add_eval_arguments,
    evaluate,
    flag_overrides,
    format_eval_table,
    run_eval,
    write_outputs,
)
from opsd.eval.loop import EvalResult, evaluate_model, evaluate_sharded

__all__ = [
    "EVAL_FLAGS",
    "EvalCommandConfig",
    "EvalResult",
    "add_eval_arguments",
    "evaluate",
    "evaluate_model",
    "evaluate_sharded",
    "flag_overrides",
    "format_eval_table",
    "run_eval",
    "write_outputs",
]
