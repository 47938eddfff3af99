"""The ``data`` section: the training problems and how they become the student's and the teacher's
prompts (`opsd eval` reads its prompt keys too)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opsd.config.base import Section

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

DEFAULT_TEACHER_TEMPLATE = (
    "{problem}\n\n"
    "Below is a reference solution to this problem.\n"
    "===== BEGIN REFERENCE SOLUTION =====\n"
    "{solution}\n"
    "===== END REFERENCE SOLUTION =====\n\n"
    "Use the reference only to check your understanding. Do not copy it or mention it: solve the problem "
    "yourself and derive the answer in your own reasoning.\n"
    "{instruction}"
)


class DataConfig(Section):
    """The training problems and how they become the student's and the teacher's prompts."""

    path: str = Field(
        "",
        description="Required: a JSONL/JSON/Parquet/CSV file, a saved `datasets` directory or a hub "
        "dataset name (`name:config`).",
    )
    problem_key: str = Field(
        "problem", description="The row field holding the problem (text or a list of chat messages)."
    )
    solution_key: str | None = Field(
        "solution",
        description="The row field holding the reference solution the privileged teacher reads; null: none.",
    )
    answer_key: str | None = Field(
        "answer",
        description="The row field holding the final answer (graded by objective=grpo); null: none.",
    )
    target_key: str | None = Field(
        None,
        description="The row field holding the SFT target (objective=sft, loss.sft_coef, `opsd sft` and "
        "`opsd compare`'s SFT arm), kept apart from the privileged text the teacher reads (a document "
        "is no answer); null: objective=sft trains on the solution (a GSM8K `#### N` ending written as "
        "\\boxed{N}) and the SFT anchor on the raw solution.",
    )
    sft_targets: Literal["data", "teacher"] = Field(
        "data",
        description="objective=sft: what the student imitates. data: the rows' data.target_key (else "
        "their solution); teacher: off-policy context distillation (Snell et al. 2022), the initial "
        "model's own greedy answers with the privileged text in its prompt (the teacher template), "
        "generated once at the start of a run (RUN_DIR/sft_targets.jsonl) and trained without it.",
    )
    split: str = Field("train", description="The split read from a saved DatasetDict or a hub dataset.")
    rows: tuple[int, int] | None = Field(
        None,
        description="[START, END]: train on rows START to END - 1 only (0-based, file order); null: every "
        "row. With eval.rows on the same file, a dev slice that training never reads.",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip malformed rows with a warning that counts them; false: the first one is an error.",
    )
    drop_empty_solution: bool = Field(
        False,
        description="Drop rows whose solution is empty (their teacher would see what the student sees); "
        "false: keep them with a warning.",
    )
    shuffle: bool = Field(
        True, description="Shuffle the rows each epoch; false: file order (benchmarks, curricula)."
    )
    instruction: str = Field(
        DEFAULT_INSTRUCTION,
        description="Appended to each problem in the student's prompt, and the teacher template's "
        "`{instruction}`.",
    )
    teacher_template: str = Field(
        DEFAULT_TEACHER_TEMPLATE,
        description="The teacher's user turn: a format string with `{problem}` and `{solution}`, and "
        "optionally `{instruction}`.",
    )
    raw_splice: bool = Field(
        False,
        description="Seed-style teacher prompt: the student's prompt followed by the solution's tokens, "
        "no teacher template.",
    )
    student_thinking: bool | None = Field(
        None,
        description="enable_thinking for the student's chat template (Qwen3-style); null: the "
        "template's default.",
    )
    teacher_thinking: bool | None = Field(
        None,
        description="enable_thinking for the teacher's chat template; the reference found student off, "
        "teacher on best.",
    )
    max_prompt_len: int = Field(
        1024, ge=8, description="The student prompt's tokens at most; a longer problem loses its beginning."
    )
    max_teacher_prompt_len: int = Field(
        2048,
        ge=8,
        description="The teacher prompt's tokens at most; a longer one loses the solution's beginning, "
        "then the problem's.",
    )
