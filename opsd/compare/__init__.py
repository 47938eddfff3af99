"""`opsd compare`: the paper's comparison on the user's own model and data.

OPSD against GRPO, GRPO with a distillation term (``mixed``), SFT on the worked solutions and three
controls (A: no solution; B: another problem's; wrong-answer: its own with the final answer made
wrong), every method from the same config: the same model, training rows, held-out set
(``eval.path``), evaluation, schedule and budget. The budget is defined once (:class:`Budget`) and
printed: equal optimizer steps and equal responses per step (OPSD samples ``rollout.n`` responses to
each of ``rollout.prompts_per_step`` problems; GRPO and mixed sample ``grpo_n`` to each of fewer
problems; SFT trains on as many worked solutions a step, which count as its data).

Every method is `opsd train`'s Trainer with a few overrides (:func:`method_overrides`; SFT is
``objective: sft``), in a run directory of its own (``OUT/seedS/METHOD``; `opsd report` works on
each). The comparison resumes where it stopped: a finished method is read back, not rerun; an
unfinished one resumes from its last checkpoint (written at every evaluation). GRPO's settings come
from ``OUT/tune/grpo.json`` when `opsd compare --tune grpo` has chosen them (by training reward on
seeds that are not reported), and from the config otherwise; GRPO + distillation's from
``OUT/tune/mixed.json`` (`--tune mixed`), and GRPO's otherwise.

The report (compare.md, :func:`format_comparison_table`): per method and for the base model, strict accuracy
(eval.grader) with a 95% Wilson interval over the held-out problems, lenient accuracy
(eval.lenient_grader), mean response length, truncation, repetition (:func:`opsd.metrics.repetition`
over words), held-out divergence and the cost of reaching its best evaluation; underneath, the
teacher's ceiling (:func:`teacher_ceiling`). SFT's targets are the worked solutions, a GSM8K
``#### N`` ending rewritten as ``\\boxed{N}`` (:func:`opsd.data.controls.boxed_target`).

The package: ``plan`` (the methods, the budget, GRPO's settings), ``methods`` (one method on one
seed and its evaluation points), ``run`` (every method on every seed), ``tuning`` (``--tune``),
``report`` (the table, its intervals, the plot), ``records`` (what is written and read back) and
``cli`` (the command).
"""

from opsd.compare.cli import (
    add_compare_arguments,
    run_compare_command,
)
from opsd.compare.methods import (
    arm_config,
    ceiling_context,
    run_trainer_method,
    teacher_ceiling,
)
from opsd.compare.plan import (
    MARKER,
    METHODS,
    NOTES,
    TUNED,
    Budget,
    ComparePlan,
    GRPOSettings,
    MethodJob,
    TunePlan,
    Variant,
    check_group_size,
    claim_dir,
    default_grpo,
    distill_coefficient,
    label,
    method_overrides,
    sft_overrides,
    tune_file,
)
from opsd.compare.records import (
    EvalPoint,
    MethodRun,
)
from opsd.compare.report import (
    format_comparison_table,
    paired_interval,
    plot_compare,
    wilson,
)
from opsd.compare.run import (
    run_compare,
)
from opsd.compare.tuning import (
    no_signal,
    read_tuned,
    run_tune,
    tune_grid,
)

__all__ = [
    "Budget",
    "ComparePlan",
    "EvalPoint",
    "GRPOSettings",
    "MARKER",
    "METHODS",
    "MethodJob",
    "MethodRun",
    "NOTES",
    "TUNED",
    "TunePlan",
    "Variant",
    "arm_config",
    "add_compare_arguments",
    "ceiling_context",
    "check_group_size",
    "claim_dir",
    "default_grpo",
    "distill_coefficient",
    "format_comparison_table",
    "label",
    "method_overrides",
    "no_signal",
    "paired_interval",
    "plot_compare",
    "read_tuned",
    "run_compare",
    "run_compare_command",
    "run_trainer_method",
    "run_tune",
    "sft_overrides",
    "teacher_ceiling",
    "tune_file",
    "tune_grid",
    "wilson",
]
