"""The ``eval`` section (held-out evaluation, in training and in `opsd eval`) and the ``guard`` that
stops a run going bad."""

from __future__ import annotations

from pydantic import Field

from opsd.config.base import Section


class EvalSetConfig(Section):
    """One more held-out file, evaluated beside eval.path at every evaluation with the same instruction,
    answer key, sampling and engine: reported, never used to choose (eval.path does that)."""

    path: str = Field(
        description="The file (same formats as data.path; a saved DatasetDict or hub dataset is read at "
        "eval.split), every row with eval.answer_key."
    )
    grader: str | None = Field(None, description="Its grader (as eval.grader); null: eval.grader.")
    limit: int | None = Field(None, ge=1, description="The first this many rows only; null: all.")
    drift: bool = Field(
        False,
        description="Also the drift from the initial model: the mean per-token KL(initial || model) on the "
        "initial model's own greedy answers to these prompts, computed once at the start of a run and "
        "cached (RUN_DIR/drift_reference_NAME.pt), over the initial model's eval.drift_topk most likely "
        "tokens and the rest as one bucket (a lower bound of the full KL; exact at the vocabulary size).",
    )
    seen_answers: bool = Field(
        False,
        description="Also its accuracy split in two: rows whose answer is also a training row's answer "
        "(data.answer_key; interference: a trained fact put in a general question) and the rest "
        "(forgetting).",
    )


class EvalConfig(Section):
    """Held-out evaluation during training: accuracy without the solution, and optionally the divergence."""

    path: str | None = Field(
        None, description="The held-out problems with answers (same formats as data.path)."
    )
    every: int = Field(0, ge=0, description="Evaluate every this many steps; 0: never.")
    k: int = Field(1, ge=1, description="Responses per problem (metrics avg@k and pass@k).")
    limit: int | None = Field(None, ge=1, description="The first this many problems only; null: all.")
    rows: tuple[int, int] | None = Field(
        None,
        description="[START, END]: rows START to END - 1 of eval.path only (before eval.limit); null: "
        "every row. A dev slice of the training file for tuning: data.rows=[0,1869], eval.rows=[1869,2069].",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="Greedy by default, so the curve moves with the weights, not with sampling noise "
        "(`opsd eval` samples at 0.6 to report Avg@k).",
    )
    top_p: float = Field(
        0.95,
        gt=0,
        le=1,
        description="Nucleus sampling at a temperature above 0: from the most likely tokens whose "
        "probabilities sum to top_p; 1: all.",
    )
    max_new_tokens: int = Field(1024, ge=1, description="The tokens of a response at most.")
    split: str = Field(
        "test", description="The split read where eval.path is a saved DatasetDict or a hub dataset."
    )
    answer_key: str = Field("answer", description="The held-out rows' field holding the final answer.")
    grader: str = Field(
        "math",
        description="A name from opsd.grading.GRADERS (math, lenient, last_number, answer_is, contains, "
        "exact) or `package.module:function`.",
    )
    lenient_grader: str | None = Field(
        None,
        description="`opsd compare`: a second grader reported beside eval.grader, e.g. last_number (the "
        "\\boxed{} answer, else the response's last number); null: none.",
    )
    sets: dict[str, EvalSetConfig] = Field(
        {},
        description="Named held-out files evaluated beside eval.path at every evaluation (metrics "
        "eval/NAME/...), e.g. {test: {path: test.jsonl}, retention: {path: retention.jsonl, drift: true}}; "
        "eval.path stays the one that decides (guards, the best checkpoint, `opsd compare`'s chosen step).",
    )
    drift_topk: int = Field(
        256, ge=1, description="The initial model's most likely tokens kept per position for a set's drift."
    )
    artifacts: list[str] = Field(
        [],
        description="Phrases counted in the held-out responses (the share of responses holding any, "
        "ignoring case), e.g. ['according to', 'biography']: the privileged text's traces in answers.",
    )
    divergence: bool = Field(
        False,
        description="Also the student's divergence from the privileged teacher on the held-out problems "
        "(metric eval/divergence), which moves where accuracy is near zero; needs data.solution_key in the "
        "file and costs one sampled response per problem.",
    )


class GuardConfig(Section):
    """Stop a run that goes bad: held-out accuracy falling from its best, responses collapsing in length,
    or most responses cut at rollout.max_new_tokens. Every guard is off (null) by default. A guard that
    fires stops the run after that step as a signal does: a checkpoint is saved (where checkpoint.enabled),
    one line names the guard, the step, the measured value against its limit, the best checkpoint and the
    resume command, and `opsd train` exits 0. Each stop is appended to guard.jsonl in the run directory;
    `opsd report` marks it. A resumed run rebuilds the guards' history from metrics.jsonl."""

    max_accuracy_drop: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Stop when held-out accuracy (eval/avg@k, a fraction) falls more than this below its "
        "best so far, e.g. 0.1: ten points; needs eval.every. null: off.",
    )
    min_length_ratio: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Stop when the mean response length over the last `window` steps falls below this "
        "fraction of its mean over the run's first `window` steps, e.g. 0.5. null: off.",
    )
    max_truncation: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Stop when the share of responses cut at rollout.max_new_tokens, averaged over the last "
        "`window` steps, rises above this, e.g. 0.5. null: off.",
    )
    window: int = Field(
        3,
        ge=1,
        description="Steps averaged by min_length_ratio (the baseline and the trailing mean) and "
        "max_truncation; neither checks before this many steps.",
    )
