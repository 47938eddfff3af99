"""Evaluation: :mod:`opsd.eval.loop` is the loop the trainer, `opsd demo` and `opsd eval` share
(generation, grading, Avg@k and pass@k, the rank-sharded variant); :mod:`opsd.eval.cli` is
`opsd eval` itself (its flags, table and output files), imported by nothing below the commands.

Who calls which evaluate function:

- :func:`evaluate_model`: one live (model, tokenizer) -> :class:`EvalResult`; `opsd demo`, bench/,
  and the two below.
- :func:`evaluate_sharded`: :func:`evaluate_model` split over data-parallel ranks; the trainer.
- :func:`opsd.eval.cli.evaluate`: models loaded from paths, results written to files; `opsd eval`.
"""

from opsd.eval.loop import EvalResult, EvalRun, evaluate_model, evaluate_sharded

__all__ = ["EvalResult", "EvalRun", "evaluate_model", "evaluate_sharded"]
