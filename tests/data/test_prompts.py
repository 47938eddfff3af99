"""opsd.data's prompts: student and teacher prompts, templates, truncation, the prompt builder against the
trainer's own, and the splice of a response into both."""

from __future__ import annotations

import json

import pytest

from opsd.data import (
    DEFAULT_INSTRUCTION,
    DEFAULT_TEACHER_TEMPLATE,
    Example,
    PromptBuilder,
    Sample,
    check_alignment,
    make_sample,
    raw_splice_teacher_ids,
    student_prompt_ids,
    teacher_prompt_ids,
)
from opsd.errors import UserError
from opsd.tiny import build_tiny_tokenizer

# ---------------------------------------------------------------------------------------------------
# Prompts

QWEN3_LIKE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is true -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    t = build_tiny_tokenizer()
    t.chat_template = QWEN3_LIKE
    return t


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_student_and_teacher_prompts(tok) -> None:
    problem, solution = "What is 12 + 30?", "We add: 12 + 30 = 42, so \\boxed{42}."
    s_ids, s_trunc = student_prompt_ids(tok, problem)
    t_ids, t_trunc = teacher_prompt_ids(tok, problem, solution)
    assert not s_trunc and not t_trunc
    assert all(type(i) is int for i in s_ids + t_ids)
    s, t = text(tok, s_ids), text(tok, t_ids)
    assert s == f"<|im_start|>user\n{problem}\n\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert solution not in s and problem in s
    assert problem in t and solution in t and DEFAULT_INSTRUCTION in t
    assert "BEGIN REFERENCE SOLUTION" in t and "END REFERENCE SOLUTION" in t and "own reasoning" in t
    assert t.endswith(f"{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    assert t.count("<|im_start|>") == 2  # one user turn + the generation prompt


def test_prompt_with_messages_problem(tok) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    s = text(tok, student_prompt_ids(tok, msgs, instruction="Box it.")[0])
    assert s.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert s.endswith("<|im_start|>user\nWhat is 1 + 1?\n\nBox it.<|im_end|>\n<|im_start|>assistant\n")
    t = text(tok, teacher_prompt_ids(tok, msgs, "It is 2.", instruction="Box it.")[0])
    assert "<|im_start|>user\nHi<|im_end|>" in t and "It is 2." in t and "What is 1 + 1?" in t
    assert msgs[3]["content"] == "What is 1 + 1?"  # the caller's list is not mutated


def test_custom_template_and_bad_templates(tok) -> None:
    ids, _ = teacher_prompt_ids(
        tok, "P?", "S.", template="Q: {problem}\nRef: {solution}\n{instruction}", instruction="I."
    )
    assert text(tok, ids) == "<|im_start|>user\nQ: P?\nRef: S.\nI.<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"must contain the field \{solution\}"):
        teacher_prompt_ids(tok, "P?", "S.", template="{problem} {instruction}")
    with pytest.raises(ValueError, match=r"unknown field \{answer\}"):
        teacher_prompt_ids(tok, "P?", "S.", template="{problem} {solution} {answer}")
    with pytest.raises(ValueError, match=r"unknown field \{\}"):
        teacher_prompt_ids(tok, "P?", "S.", template="{problem} {solution} \\boxed{}")
    assert "{solution}" in DEFAULT_TEACHER_TEMPLATE and "{problem}" in DEFAULT_TEACHER_TEMPLATE


@pytest.mark.parametrize("flag", [None, True, False])
def test_enable_thinking_with_and_without_template_support(tok, qwen_tok, flag) -> None:
    plain = text(tok, student_prompt_ids(tok, "P?", enable_thinking=flag)[0])
    assert plain.endswith("<|im_start|>assistant\n")  # a template without the flag ignores it
    q = text(qwen_tok, student_prompt_ids(qwen_tok, "P?", enable_thinking=flag)[0])
    qt = text(qwen_tok, teacher_prompt_ids(qwen_tok, "P?", "S", enable_thinking=flag)[0])
    tail = {None: "<|im_start|>assistant\n", True: "<|im_start|>assistant\n<think>\n", False: "</think>\n\n"}[
        flag
    ]
    assert q.endswith(tail) and qt.endswith(tail)
    if flag is None:
        assert "<think>" not in q  # None means the kwarg is not passed at all


def test_truncation_keeps_structure_and_is_flagged(tok) -> None:
    problem = "Long preamble. " * 40 + "What is 2 + 2?"
    solution = "Step. " * 60 + "\\boxed{4}"
    full_s, _ = student_prompt_ids(tok, problem)
    full_t, _ = teacher_prompt_ids(tok, problem, solution)
    s_ids, s_trunc = student_prompt_ids(tok, problem, max_len=len(full_s) - 20)
    assert s_trunc and len(s_ids) <= len(full_s) - 20
    s = text(tok, s_ids)
    assert s.startswith("<|im_start|>user\n... ") and s.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "What is 2 + 2?" in s and DEFAULT_INSTRUCTION in s

    # the solution is cut first; the problem stays whole while cutting the solution suffices
    t_ids, t_trunc = teacher_prompt_ids(tok, problem, solution, max_len=len(full_t) - 30)
    t = text(tok, t_ids)
    assert t_trunc and len(t_ids) <= len(full_t) - 30
    assert problem in t and "\\boxed{4}" in t and solution not in t
    assert t.endswith("<|im_end|>\n<|im_start|>assistant\n")

    # count over a batch, as the trainer reports it
    flags = [student_prompt_ids(tok, p, max_len=len(full_s) - 5)[1] for p in [problem, "Short?", problem]]
    assert sum(flags) == 2
    with pytest.raises(ValueError, match="max_len=5 is too small"):
        student_prompt_ids(tok, problem, max_len=5)


def _trainer_prompts(
    tokenizer, d: dict, privileged: bool, ex: Example
) -> tuple[list[int], list[int], bool, bool]:
    """The trainer's prompt code before PromptBuilder (Trainer._prompts), kept as the reference."""
    s_ids, s_cut = student_prompt_ids(
        tokenizer,
        ex.problem,
        instruction=d["instruction"],
        enable_thinking=d["student_thinking"],
        max_len=d["max_prompt_len"],
    )
    if not privileged:
        t_ids, t_cut = s_ids, False
    elif d["raw_splice"]:
        sol = tokenizer(ex.solution, add_special_tokens=False)["input_ids"]
        t_ids = raw_splice_teacher_ids(s_ids, sol)[: d["max_teacher_prompt_len"]]
        t_cut = len(s_ids) + len(sol) > d["max_teacher_prompt_len"]
    else:
        t_ids, t_cut = teacher_prompt_ids(
            tokenizer,
            ex.problem,
            ex.solution,
            template=d["teacher_template"],
            instruction=d["instruction"],
            enable_thinking=d["teacher_thinking"],
            max_len=d["max_teacher_prompt_len"],
        )
    return s_ids, t_ids, s_cut, t_cut


BUILDER_EXAMPLES = [
    Example("What is 2 + 3?", "2 + 3 = 5.", "5", 0),
    Example("Long preamble. " * 30 + "What is 2 + 2?", "Step. " * 40 + "\\boxed{4}", "4", 1),
    Example(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
        "It is 2.",
        "2",
        2,
    ),
    Example("Short?", "", None, 3),
]


@pytest.mark.parametrize(
    ("case", "privileged"),
    [
        ({}, True),
        ({}, False),
        ({"raw_splice": True}, True),
        ({"raw_splice": True, "max_teacher_prompt_len": 80}, True),
        ({"max_prompt_len": 200, "max_teacher_prompt_len": 400}, True),
        ({"student_thinking": False, "teacher_thinking": True, "instruction": "Box it."}, True),
        ({"teacher_template": "Q: {problem}\nRef: {solution}\n{instruction}"}, True),
    ],
)
def test_prompt_builder_matches_the_trainer(qwen_tok, case: dict, privileged: bool) -> None:
    from opsd.config import DataConfig

    cfg = DataConfig(path="x.jsonl", **case)
    d = cfg.model_dump()
    builder = PromptBuilder(qwen_tok, cfg, privileged)
    want_cut = {"student": 0, "teacher": 0}
    for i, ex in enumerate(BUILDER_EXAMPLES):
        s_ids, t_ids, s_cut, t_cut = _trainer_prompts(qwen_tok, d, privileged, ex)
        want_cut["student"] += s_cut
        want_cut["teacher"] += t_cut
        assert builder(i, ex) == (s_ids, t_ids)
    for i, ex in enumerate(BUILDER_EXAMPLES):  # cached: no second tokenization, no second count
        assert builder(i, ex) is builder(i, ex)
    assert builder.truncated == want_cut
    if "max_prompt_len" in case or "max_teacher_prompt_len" in case:
        assert builder.truncated != {"student": 0, "teacher": 0}
    keys = (
        "instruction",
        "teacher_template",
        "student_thinking",
        "teacher_thinking",
        "max_prompt_len",
        "max_teacher_prompt_len",
        "raw_splice",
    )
    explicit = PromptBuilder(qwen_tok, DataConfig(path="x.jsonl", **{k: d[k] for k in keys}), privileged)
    assert [explicit(i, ex) for i, ex in enumerate(BUILDER_EXAMPLES)] == [
        builder(i, ex) for i, ex in enumerate(BUILDER_EXAMPLES)
    ]


def test_prompt_builder_truncation_state(tok) -> None:
    from opsd.config import DataConfig

    limits = DataConfig(path="x.jsonl", max_prompt_len=200, max_teacher_prompt_len=400)
    builder = PromptBuilder(tok, limits)
    builder(1, BUILDER_EXAMPLES[1])
    state = json.loads(json.dumps(builder.state_dict()))  # plain ints, as a checkpoint stores them
    assert state == builder.truncated == {"student": 1, "teacher": 1}
    builder.truncated["student"] = 99  # a copy: the counts change only through the builder
    assert builder.truncated["student"] == 1
    fresh = PromptBuilder(tok, limits)
    fresh.load_state_dict(state)
    fresh(0, BUILDER_EXAMPLES[0])
    assert fresh.truncated == {"student": 1, "teacher": 1}
    with pytest.raises(UserError, match=r"must contain the field \{solution\}"):
        PromptBuilder(tok, DataConfig.model_construct(teacher_template="{problem} {instruction}"))
    unused = DataConfig.model_construct(teacher_template="{problem}")
    PromptBuilder(tok, unused, privileged=False)  # the template is unused then


# ---------------------------------------------------------------------------------------------------
# Aligned samples


def test_make_sample_alignment() -> None:
    s = make_sample([1, 2, 3], [1, 2, 9, 9, 3], [7, 8, 2], example_index=4, finish_reason="stop")
    assert s.student_ids == [1, 2, 3, 7, 8, 2] and s.teacher_ids == [1, 2, 9, 9, 3, 7, 8, 2]
    assert s.response_len == 3 and s.student_ids[-3:] == s.teacher_ids[-3:] == [7, 8, 2]
    with pytest.raises(ValueError, match="empty response"):
        make_sample([1], [1], [], 0, "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        make_sample([1], [1], [2], 0, "eos")


def test_alignment_check_raises_on_mismatch() -> None:
    bad = Sample(
        student_ids=[1, 2, 5, 6],
        teacher_ids=[1, 3, 3, 5, 7],
        response_len=2,
        example_index=9,
        finish_reason="stop",
    )
    with pytest.raises(
        ValueError, match=r"example 9: .*differ at response position 1 \(student token 6, teacher token 7\)"
    ):
        check_alignment(bad)
    too_long = Sample([1, 2], [1, 2, 3], response_len=3, example_index=1, finish_reason="length")
    with pytest.raises(ValueError, match="does not fit"):
        check_alignment(too_long)


def test_raw_splice() -> None:
    assert raw_splice_teacher_ids([1, 2], [5, 6, 7]) == [1, 2, 5, 6, 7]
    sample = make_sample([1, 2], raw_splice_teacher_ids([1, 2], [5, 6]), [9], 0, "length")
    assert sample.teacher_ids == [1, 2, 5, 6, 9]
