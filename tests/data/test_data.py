"""opsd.data: loading every source kind and every bad input, the cursor, prompts, alignment, packing."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import SHARED_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.data import (
    DEFAULT_INSTRUCTION,
    DEFAULT_TEACHER_TEMPLATE,
    DataCursor,
    Example,
    MicroBatch,
    PromptBuilder,
    Sample,
    check_alignment,
    load_examples,
    make_microbatches,
    make_sample,
    pack_microbatches,
    raw_splice_teacher_ids,
    sources,
    student_prompt_ids,
    teacher_prompt_ids,
)
from opsd.errors import UserError
from opsd.tiny import build_tiny_tokenizer

ROWS = [
    {"problem": "What is 2 + 3?", "solution": "2 + 3 = 5.", "answer": "5"},
    {"problem": "What is 4 * 6?", "solution": "4 * 6 = 24.", "answer": "24"},
    {"problem": "What is 9 - 7?", "solution": "9 - 7 = 2.", "answer": "2"},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_quiet(source, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_examples(str(source), **kw)


# ---------------------------------------------------------------------------------------------------
# Sources


def _check_rows(report, source) -> None:
    assert [e.problem for e in report.examples] == [r["problem"] for r in ROWS]
    assert [e.solution for e in report.examples] == [r["solution"] for r in ROWS]
    assert [e.answer for e in report.examples] == [r["answer"] for r in ROWS]
    assert [e.row for e in report.examples] == [0, 1, 2]
    assert (report.skipped_bad, report.empty_solution, report.dropped_empty) == (0, 0, 0)
    assert report.source == str(source)


@pytest.mark.parametrize(
    "kind", ["jsonl", "json_array", "json_lines", "parquet", "csv", "saved", "saved_dict"]
)
def test_every_source_kind_loads(tmp_path: Path, kind: str) -> None:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if kind == "jsonl":
        src = write_jsonl(tmp_path / "d.jsonl", ROWS)
    elif kind == "json_array":
        src = tmp_path / "d.json"
        src.write_text(json.dumps(ROWS))
    elif kind == "json_lines":
        src = write_jsonl(tmp_path / "d.json", ROWS)
    elif kind == "parquet":
        src = tmp_path / "d.parquet"
        ds.to_parquet(str(src))
    elif kind == "csv":
        src = tmp_path / "d.csv"
        ds.to_csv(str(src), index=False)
    elif kind == "saved":
        src = tmp_path / "saved"
        ds.save_to_disk(str(src))
    else:
        src = tmp_path / "saved_dict"
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(src))
    _check_rows(load_examples(str(src), answer_key="answer"), src)


def test_saved_dataset_dict_split(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": ds, "test": ds.select([2])}).save_to_disk(str(tmp_path / "dd"))
    report = load_examples(str(tmp_path / "dd"), split="test")
    assert [e.problem for e in report.examples] == [ROWS[2]["problem"]]
    with pytest.raises(ValueError, match=r"no split 'validation'.*\['test', 'train'\]"):
        load_examples(str(tmp_path / "dd"), split="validation")


def test_csv_keeps_text_and_multiline_values(tmp_path: Path) -> None:
    import datasets

    rows = [
        {"problem": "Line one\nline two, with a comma", "solution": 'He said "hi".\nDone.', "answer": "007"}
    ]
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    ex = load_examples(str(tmp_path / "d.csv"), answer_key="answer").examples[0]
    assert (ex.problem, ex.solution, ex.answer) == (rows[0]["problem"], rows[0]["solution"], "007")


def test_messages_problem(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}]
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs, "solution": "2"}])
    ex = load_examples(str(src), problem_key="messages").examples[0]
    assert ex.problem == msgs


def test_messages_problem_from_parquet(tmp_path: Path) -> None:
    import datasets

    msgs = [{"role": "user", "content": "What is 1 + 1?"}]
    datasets.Dataset.from_list([{"messages": msgs, "solution": "2"}]).to_parquet(str(tmp_path / "m.parquet"))
    assert load_examples(str(tmp_path / "m.parquet"), problem_key="messages").examples[0].problem == msgs


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty messages list"),
        ([{"role": "user"}], "message 0 needs a string 'content'"),
        (["hi"], "message 0 must be a"),
        ([{"role": "system", "content": "x"}], "no 'user' message"),
    ],
)
def test_bad_messages_shape(tmp_path: Path, messages: list, match: str) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages, "solution": "s"}])
    with pytest.raises(ValueError, match=match):
        load_examples(str(src), problem_key="messages")


def test_numeric_answers_become_strings_and_gsm8k_raw(tmp_path: Path) -> None:
    rows = [
        {"question": "q1", "answer": 72},
        {"question": "q2", "answer": 3.0},
        {"question": "q3", "answer": 0.5},
        {"question": "q4", "answer": "She makes 9 * 2 = 18.\n#### 18"},
    ]
    src = write_jsonl(tmp_path / "gsm.jsonl", rows)
    report = load_examples(str(src), problem_key="question", solution_key=None, answer_key="answer")
    assert [e.answer for e in report.examples] == ["72", "3", "0.5", "She makes 9 * 2 = 18.\n#### 18"]
    # solution_key=None: external-teacher mode, no privileged info and no empty-solution warning
    assert all(e.solution == "" for e in report.examples)
    assert report.empty_solution == 0


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    return msg


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode off, whatever the environment says (an offline cluster sets HF_HUB_OFFLINE=1):
    huggingface_hub and datasets read the variables once, at import, so their constants are reset too.
    The hub's answers themselves are faked by each test."""
    import datasets
    import huggingface_hub.constants

    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)


@pytest.mark.usefixtures("online")
def test_hub_name_unreachable_fails_fast_and_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: False)

    def never(*a, **k):
        raise AssertionError("load_dataset must not be called when the hub is unreachable")

    monkeypatch.setattr("datasets.load_dataset", never)
    for name in ("someone/gsm8k:main", "my_dataset"):
        with pytest.raises(UserError) as info:
            load_examples(name)
        msg = _one_line(info.value)
        assert msg.startswith(f"{name}: no such local file or directory, and the Hugging Face hub")
        assert "is unreachable" in msg and "local .jsonl" in msg


@pytest.mark.usefixtures("online")
def test_unknown_hub_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    from datasets.exceptions import DatasetNotFoundError

    def not_found(*a, **k):
        raise DatasetNotFoundError("Dataset 'someone/nope' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: True)
    monkeypatch.setattr("datasets.load_dataset", not_found)
    with pytest.raises(UserError) as info:
        load_examples("someone/nope")
    msg = _one_line(info.value)
    assert msg.startswith("someone/nope: no such local file or directory")
    assert "hub has no dataset 'someone/nope'" in msg


def test_hub_name_offline_mode_cache_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(
        sources, "hub_reachable", lambda timeout_s=3.0: pytest.fail("no probe in offline mode")
    )
    with pytest.raises(UserError) as info:
        load_examples("opsd-test/no-such-dataset-xyz")
    msg = _one_line(info.value)
    assert msg.startswith("opsd-test/no-such-dataset-xyz: no such local file or directory")
    assert "offline mode is on" in msg and "local .jsonl" in msg


@pytest.mark.parametrize("name", ["nope.jsonl", "runs/data/train", "./train", "data\\train"])
def test_missing_path_is_not_taken_for_a_hub_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: pytest.fail("not a hub name"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as info:
        load_examples(name)
    assert _one_line(info.value) == f"{name}: no such file or directory (relative to {tmp_path})"
    with pytest.raises(UserError, match=r"^/no/such/dir/d\.jsonl: no such file or directory$"):
        load_examples("/no/such/dir/d.jsonl")


@pytest.mark.parametrize("kind", ["jsonl", "json_array", "json_lines", "csv"])
def test_utf8_byte_order_mark_is_tolerated(tmp_path: Path, kind: str) -> None:
    if kind == "csv":
        lines = ["problem,solution,answer"] + [f"{r['problem']},{r['solution']},{r['answer']}" for r in ROWS]
        src, text = tmp_path / "d.csv", "\n".join(lines) + "\n"
    elif kind == "json_array":
        src, text = tmp_path / "d.json", json.dumps(ROWS)
    else:
        src = tmp_path / ("d.jsonl" if kind == "jsonl" else "d.json")
        text = "".join(json.dumps(r) + "\n" for r in ROWS)
    src.write_text(text, encoding="utf-8-sig")
    assert src.read_bytes().startswith(b"\xef\xbb\xbf")
    _check_rows(load_examples(str(src), answer_key="answer"), src)
    # the first row is a good row, not a bad one to skip
    _check_rows(load_examples(str(src), answer_key="answer", skip_bad_rows=True), src)


def test_config_and_data_imports_stay_light() -> None:
    """opsd.config takes the prompt defaults; that must not load torch, transformers or datasets."""
    code = (
        "import sys, opsd.config, opsd.data; from opsd.data import load_examples, PromptBuilder; "
        "heavy = {'torch', 'transformers', 'datasets', 'numpy'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------------
# Bad input


def test_missing_field_names_file_row_and_keys(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"problem": "p", "sol": "s"}])
    with pytest.raises(UserError) as info:  # a user mistake: the CLI prints this one line
        load_examples(str(src))
    msg = _one_line(info.value)
    assert str(src) in msg and "line 2 (row 1)" in msg and "'solution'" in msg and "['problem', 'sol']" in msg


def test_missing_column_in_parquet(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list([{"question": "q", "solution": "s"}]).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(
        ValueError, match=r"d\.parquet: row 0: missing field 'problem'; available keys: \['question'"
    ):
        load_examples(str(tmp_path / "d.parquet"))


def test_non_string_value_names_key_and_type(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[1], {"problem": "p", "solution": 17}])
    with pytest.raises(
        ValueError, match=r"d\.jsonl: line 3 \(row 2\): field 'solution' must be a string, got int"
    ):
        load_examples(str(src))
    src = write_jsonl(tmp_path / "e.jsonl", [{"problem": {"text": "p"}, "solution": "s"}])
    with pytest.raises(
        ValueError, match="field 'problem' must be a string or a chat messages list, got dict"
    ):
        load_examples(str(src))
    src = write_jsonl(tmp_path / "f.jsonl", [{"problem": "p", "solution": "s", "answer": [1]}])
    with pytest.raises(ValueError, match="field 'answer' must be a string or a number, got list"):
        load_examples(str(src), answer_key="answer")


@pytest.mark.parametrize("name", ["e.jsonl", "e.json", "e.csv", "e.parquet"])
def test_empty_file(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("")
    with pytest.raises(ValueError, match="empty file"):
        load_examples(str(tmp_path / name))


def test_blank_lines_only_and_header_only(tmp_path: Path) -> None:
    (tmp_path / "b.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="empty file"):
        load_examples(str(tmp_path / "b.jsonl"))
    (tmp_path / "h.csv").write_text("problem,solution\n")
    with pytest.raises(ValueError, match="no rows"):
        load_examples(str(tmp_path / "h.csv"))


def test_malformed_jsonl_line_number_and_skip_count(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    lines = [
        json.dumps(ROWS[0]),
        "",
        json.dumps(ROWS[1]),
        '{"problem": "broken", ',
        json.dumps(ROWS[2]),
        "[1, 2]",
    ]
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"d\.jsonl: line 4 \(row 2\): malformed JSON"):
        load_examples(str(src))
    with pytest.warns(UserWarning, match="skipped 2 bad rows"):
        report = load_examples(str(src), skip_bad_rows=True)
    assert report.skipped_bad == 2
    assert [e.row for e in report.examples] == [0, 1, 3]
    assert [e.problem for e in report.examples] == [r["problem"] for r in ROWS]


def test_skip_bad_rows_counts_every_kind(tmp_path: Path) -> None:
    rows = [
        ROWS[0],
        {"problem": "p"},  # missing solution
        {"problem": 3, "solution": "s"},  # non-string problem
        {"problem": "  ", "solution": "s"},  # empty problem
        {"problem": "p", "solution": None},  # null
        {"problem": "no answer", "solution": "s"},  # missing answer with require_answer
        {"problem": "blank answer", "solution": "s", "answer": " "},  # blank answer = missing
        ROWS[1],
    ]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    report = load_quiet(src, skip_bad_rows=True, answer_key="answer", require_answer=True)
    assert report.skipped_bad == 6
    assert [e.row for e in report.examples] == [0, 7]
    report = load_quiet(src, skip_bad_rows=True, answer_key="answer")  # answer optional now
    assert report.skipped_bad == 4
    assert [e.answer for e in report.examples] == ["5", None, None, "24"]


def test_require_answer_without_skip_raises(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "solution": "s"}])
    with pytest.raises(
        ValueError, match=r"missing field 'answer'; available keys: \['problem', 'solution'\]"
    ):
        load_examples(str(src), answer_key="answer", require_answer=True)
    with pytest.warns(UserWarning, match="1 of 1 rows have no 'answer'"):
        assert load_examples(str(src), answer_key="answer").examples[0].answer is None


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"q": "p"}, {"q": "r"}])
    with pytest.raises(UserError, match=r"no usable rows.*2 skipped as bad.*missing field 'problem'"):
        load_quiet(src, skip_bad_rows=True)


def test_malformed_csv_row(tmp_path: Path) -> None:
    src = tmp_path / "d.csv"
    src.write_text('problem,solution\n"a",b\n"c",d,extra\n"e",f\n')
    with pytest.raises(UserError, match=r"d\.csv: could not read CSV.*Expected 2 columns"):
        load_examples(str(src))
    report = load_quiet(src, skip_bad_rows=True)
    assert report.skipped_bad == 1
    assert [e.problem for e in report.examples] == ["a", "e"]


def test_empty_solution_warns_with_count_and_drop(tmp_path: Path) -> None:
    rows = [ROWS[0], {"problem": "p1", "solution": ""}, {"problem": "p2", "solution": "  \n"}, ROWS[1]]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.warns(UserWarning, match="2 of 4 rows have an empty 'solution'"):
        report = load_examples(str(src))
    assert (report.empty_solution, report.dropped_empty, len(report.examples)) == (2, 0, 4)
    with pytest.warns(UserWarning, match="2 of 4 rows have an empty 'solution'.*dropped them"):
        report = load_examples(str(src), drop_empty_solution=True)
    assert (report.empty_solution, report.dropped_empty) == (2, 2)
    assert [e.row for e in report.examples] == [0, 3]


def test_conflicting_options() -> None:
    with pytest.raises(ValueError, match="drop_empty_solution"):
        load_examples("x.jsonl", solution_key=None, drop_empty_solution=True)
    with pytest.raises(ValueError, match="require_answer"):
        load_examples("x.jsonl", require_answer=True)


def test_not_a_saved_dataset_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Hugging Face datasets directory"):
        load_examples(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# Cursor


def test_cursor_deterministic_and_epochs() -> None:
    a, b = DataCursor(10, seed=3), DataCursor(10, seed=3)
    draws = [a.next_indices(4) for _ in range(5)]  # 20 indices = exactly 2 epochs
    assert draws == [b.next_indices(4) for _ in range(5)]
    flat = [i for d in draws for i in d]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new permutation each epoch
    assert flat[:10] != list(range(10))
    assert a.epoch == 2
    assert DataCursor(10, seed=4).next_indices(10) != flat[:10]
    assert DataCursor(10, seed=3, shuffle=False).next_indices(12) == [*range(10), 0, 1]


def test_cursor_epoch_boundary_is_seamless() -> None:
    c = DataCursor(7, seed=0)
    first = c.next_indices(5)
    second = c.next_indices(5)  # 2 from epoch 0, 3 from epoch 1
    assert c.epoch == 1
    assert sorted(first + second[:2]) == list(range(7))
    whole = DataCursor(7, seed=0).next_indices(10)
    assert whole == first + second


def test_cursor_sharding_disjoint_and_covering() -> None:
    world = 3
    cursors = [DataCursor(24, seed=5, rank=r, world_size=world) for r in range(world)]
    single = DataCursor(24, seed=5)
    for _ in range(2):  # two global batches of 4 * 3 = 12 inside epoch 0
        parts = [c.next_indices(4) for c in cursors]
        assert sum(parts, []) == single.next_indices(12)  # rank r takes slice [r*k, (r+1)*k)
        assert len(set(sum(parts, []))) == 12
    assert all(c.state_dict() == cursors[0].state_dict() for c in cursors)


def test_cursor_exact_resume() -> None:
    c = DataCursor(13, seed=11, rank=1, world_size=2)
    for _ in range(3):
        c.next_indices(4)
    state = json.loads(json.dumps(c.state_dict()))  # survives serialisation
    expected = [c.next_indices(4) for _ in range(5)]
    fresh = DataCursor(13, seed=11, rank=1, world_size=2)
    fresh.load_state_dict(state)
    assert [fresh.next_indices(4) for _ in range(5)] == expected
    assert fresh.epoch == c.epoch


def test_cursor_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_examples"):
        DataCursor(0, seed=0)
    with pytest.raises(ValueError, match="rank"):
        DataCursor(5, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="k must be > 0"):
        DataCursor(5, seed=0).next_indices(0)
    with pytest.raises(ValueError, match="this dataset has 6"):
        DataCursor(6, seed=0).load_state_dict(DataCursor(5, seed=0).state_dict())


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
    builder = PromptBuilder.from_config(qwen_tok, cfg, privileged)
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
    explicit = PromptBuilder(qwen_tok, privileged=privileged, **{k: d[k] for k in keys})
    assert [explicit(i, ex) for i, ex in enumerate(BUILDER_EXAMPLES)] == [
        builder(i, ex) for i, ex in enumerate(BUILDER_EXAMPLES)
    ]


def test_prompt_builder_truncation_state(tok) -> None:
    builder = PromptBuilder(tok, max_prompt_len=200, max_teacher_prompt_len=400)
    builder(1, BUILDER_EXAMPLES[1])
    state = json.loads(json.dumps(builder.state_dict()))  # plain ints, as a checkpoint stores them
    assert state == builder.truncated == {"student": 1, "teacher": 1}
    builder.truncated["student"] = 99  # a copy: the counts change only through the builder
    assert builder.truncated["student"] == 1
    fresh = PromptBuilder(tok, max_prompt_len=200, max_teacher_prompt_len=400)
    fresh.load_state_dict(state)
    fresh(0, BUILDER_EXAMPLES[0])
    assert fresh.truncated == {"student": 1, "teacher": 1}
    with pytest.raises(UserError, match=r"must contain the field \{solution\}"):
        PromptBuilder(tok, teacher_template="{problem} {instruction}")
    PromptBuilder(tok, teacher_template="{problem}", privileged=False)  # the template is unused then


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


# ---------------------------------------------------------------------------------------------------
# Micro-batching


def test_pack_examples() -> None:
    assert pack_microbatches([], 10) == []
    assert pack_microbatches([3, 3, 3, 3], 12) == [[0, 1, 2, 3]]
    assert pack_microbatches([3, 30, 3, 4], 12) == [[1], [0, 2, 3]]  # oversized alone, longest first
    assert pack_microbatches([5, 6, 6], 12) == [[1, 2], [0]]  # 3 * 6 = 18 > 12 counts padding
    with pytest.raises(ValueError, match="max_tokens"):
        pack_microbatches([1], 0)
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        pack_microbatches([1, 0], 4)


def test_pack_uses_the_longer_teacher_length() -> None:
    student, teacher = [10, 10, 10, 10], [30, 30, 30, 30]
    lengths = [max(s, t) for s, t in zip(student, teacher, strict=True)]
    groups = pack_microbatches(lengths, 64)
    assert all(len(g) * 30 <= 64 for g in groups) and len(groups) == 2


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), max_size=60), max_tokens=st.integers(1, 1000))
def test_pack_properties(lengths: list[int], max_tokens: int) -> None:
    groups = pack_microbatches(lengths, max_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each sample exactly once
    for g in groups:
        assert g and g == sorted(g)
        cost = len(g) * max(lengths[i] for i in g)
        assert cost <= max_tokens or len(g) == 1  # budget, padded, except a lone oversized sample
        if any(lengths[i] > max_tokens for i in g):
            assert len(g) == 1  # oversized goes alone
    assert pack_microbatches(list(lengths), max_tokens) == groups  # deterministic


def test_pack_keeps_similar_lengths_together() -> None:
    """The issue's rows: teacher prompts with solutions from ~200 to ~1100 tokens. One padded group would
    compute 8 x 1100; with min_real_frac=0.8 each group keeps >= 80% real tokens and far less is padded."""
    lengths = [1100, 900, 700, 500, 300, 250, 200, 200]
    assert pack_microbatches(lengths, 9000) == [list(range(8))]  # fill to the budget: 4150 real of 8800
    groups = pack_microbatches(lengths, 9000, 0.8)
    assert groups == [[0, 1, 2], [3, 4], [5, 6, 7]]
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert padded == 3300 + 1000 + 750 and sum(lengths) / padded > 0.8
    assert pack_microbatches([5, 5, 5], 100, 1.0) == [[0, 1, 2]]  # equal lengths never split
    with pytest.raises(ValueError, match="min_real_frac"):
        pack_microbatches([1], 4, 1.5)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), max_size=60),
    max_tokens=st.integers(1, 1000),
    frac=st.floats(0.0, 1.0),
)
def test_pack_min_real_frac_properties(lengths: list[int], max_tokens: int, frac: float) -> None:
    groups = pack_microbatches(lengths, max_tokens, frac)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real, padded = sum(lengths[i] for i in g), len(g) * max(lengths[i] for i in g)
        assert len(g) == 1 or (padded <= max_tokens and real >= frac * padded - 1e-9)


def _trainer_microbatch(mb: list[Sample], pad: int, reduction: str, global_tokens: float, global_seqs: float):
    """What Trainer.step built per micro-batch before MicroBatch, written out without the helpers."""
    resp = [s.response_len for s in mb]
    weights = torch.cat(
        [torch.full((n,), 1.0 / (global_tokens if reduction == "token" else n * global_seqs)) for n in resp]
    )
    targets = torch.tensor([t for s in mb for t in s.student_ids[-s.response_len :]])
    out = {"weights": weights, "targets": targets}
    for side in ("student", "teacher"):
        seqs = [getattr(s, f"{side}_ids") for s in mb]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        pos = []
        for b, (x, r) in enumerate(zip(seqs, resp, strict=True)):
            ids[b, : len(x)] = torch.tensor(x)
            mask[b, : len(x)] = 1
            pos += [b * width + p for p in range(len(x) - r - 1, len(x) - 1)]
        out |= {f"{side}_ids": ids, f"{side}_mask": mask, f"{side}_pos": torch.tensor(pos, dtype=torch.long)}
    return out


def _random_samples(seed: int, count: int, prompt_lens: tuple[int, int]) -> list:
    """Samples of random tokens: prompts of ``prompt_lens`` tokens, solutions of 0-29, responses of 1-11."""
    import random

    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randrange(*prompt_lens))]
        teacher = prompt + [rng.randrange(5, 50) for _ in range(rng.randrange(0, 30))]
        response = [rng.randrange(5, 50) for _ in range(rng.randrange(1, 12))]
        samples.append(make_sample(prompt, teacher, response, i, "stop"))
    return samples


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_microbatches_match_the_trainer(reduction: str) -> None:
    from opsd.data.batching import TokenWeights

    samples = _random_samples(seed=0, count=11, prompt_lens=(3, 20))
    global_tokens, global_seqs = float(sum(s.response_len for s in samples) * 2), float(len(samples) * 2)
    weights = TokenWeights(reduction, global_tokens, global_seqs)
    mbs = make_microbatches(samples, max_tokens=120, pad_id=0, weights=weights, device="cpu")
    groups = pack_microbatches([max(len(s.student_ids), len(s.teacher_ids)) for s in samples], 120)
    assert len(groups) > 2 and [m.sample_indices for m in mbs] == groups  # same groups, same order
    for mb, group in zip(mbs, groups, strict=True):
        assert isinstance(mb, MicroBatch)
        chosen = [samples[i] for i in group]
        want = _trainer_microbatch(chosen, 0, reduction, global_tokens, global_seqs)
        for name, tensor in want.items():
            got = getattr(mb, name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert mb.weights.dtype == torch.float32
        assert mb.response_lens == [s.response_len for s in chosen]
        assert mb.student_real_tokens == sum(len(s.student_ids) for s in chosen) == int(mb.student_mask.sum())
        assert mb.teacher_real_tokens == sum(len(s.teacher_ids) for s in chosen) == int(mb.teacher_mask.sum())
        assert mb.student_padded_tokens == mb.student_ids.numel()
        assert mb.teacher_padded_tokens == mb.teacher_ids.numel()
        # the positions pick the hidden states that predict the targets, on both sides
        for side in ("student", "teacher"):
            ids, pos = getattr(mb, f"{side}_ids").reshape(-1), getattr(mb, f"{side}_pos")
            assert torch.equal(ids[pos + 1], mb.targets)
    total = torch.cat([m.weights for m in mbs]).double().sum().item()
    assert total == pytest.approx(0.5)  # this rank's half of the global loss weight
    with pytest.raises(ValueError, match="reduction"):
        TokenWeights("mean", 1.0, 1.0)


def test_bucket_widths_are_sixteen_per_doubling_and_at_most_six_percent_wider() -> None:
    from opsd.cpu.buckets import bucket_width

    widths = [bucket_width(n) for n in range(1, 5000)]
    assert all(w >= n and (w - n) <= 0.0625 * n for n, w in zip(range(1, 5000), widths, strict=True))
    assert all(bucket_width(w) == w for w in widths)  # a bucket width is its own bucket
    got = [bucket_width(n) for n in (32, 33, 250, 256, 257, 1000, 4097)]
    assert got == [32, 34, 256, 256, 272, 1024, 4352]
    for k in range(6, 12):  # lengths in (2**(k-1), 2**k] take sixteen widths
        assert len({bucket_width(n) for n in range(2 ** (k - 1) + 1, 2**k + 1)}) == 16


def test_microbatch_widths_in_buckets() -> None:
    """With bucket (a CPU in bf16) every padded width is a bucket width, the budget bounds the bucketed
    widths, and the positions still pick the hidden states that predict the targets."""
    from opsd.cpu import RowWidths
    from opsd.cpu.buckets import bucket_width
    from opsd.data.batching import TokenWeights

    samples = _random_samples(seed=1, count=9, prompt_lens=(30, 60))
    kw = dict(pad_id=0, weights=TokenWeights("token", 100.0, 9.0), device="cpu")
    mbs = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket=True), **kw)
    bucketed = [bucket_width(max(len(s.student_ids), len(s.teacher_ids))) for s in samples]
    assert [m.sample_indices for m in mbs] == pack_microbatches(bucketed, 250)
    wider = 0
    for mb in mbs:
        chosen = [samples[i] for i in mb.sample_indices]
        for side in ("student", "teacher"):
            width = getattr(mb, f"{side}_ids").shape[1]
            longest = max(len(getattr(s, f"{side}_ids")) for s in chosen)
            assert width == bucket_width(longest)
            wider += width > longest
            ids, pos = getattr(mb, f"{side}_ids").reshape(-1), getattr(mb, f"{side}_pos")
            assert torch.equal(ids[pos + 1], mb.targets)
        assert len(chosen) == 1 or mb.teacher_padded_tokens <= 250
        assert mb.student_real_tokens == sum(len(s.student_ids) for s in chosen) == int(mb.student_mask.sum())
        assert mb.teacher_real_tokens == sum(len(s.teacher_ids) for s in chosen) == int(mb.teacher_mask.sum())
    assert wider > 0  # the test exercises the padding
    plain = make_microbatches(samples, max_tokens=250, **kw)
    same = [torch.cat([m.targets for m in x]).sort().values for x in (plain, mbs)]
    assert torch.equal(*same)  # the same response tokens, however grouped


@pytest.mark.parametrize("bucket", [False, True])
def test_packed_microbatches_name_each_rows_width(bucket: bool) -> None:
    """``pack_from`` (a CPU, one process) changes no tensor: where a side's rows differ in width and
    the shortest reaches it, it records each row's own width (its length, or its bucket width, never
    wider than the group's) and counts only those positions as computed; elsewhere rows stay batched."""
    from opsd.cpu import RowWidths
    from opsd.cpu.buckets import bucket_width
    from opsd.data.batching import TokenWeights

    samples = _random_samples(seed=2, count=9, prompt_lens=(10, 60))
    kw = dict(pad_id=0, weights=TokenWeights("token", 100.0, 9.0), device="cpu")
    batched = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket), **kw)
    never = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket, 10_000), **kw)
    assert all(m.student_rows is None and m.teacher_rows is None for m in never)
    rows = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket, 1), **kw)
    assert [m.sample_indices for m in rows] == [m.sample_indices for m in batched]
    packed = 0
    for k, (a, b) in enumerate(zip(batched, rows)):
        assert a.student_rows is None and a.teacher_rows is None
        for side in ("student", "teacher"):
            ids, widths = getattr(b, f"{side}_ids"), getattr(b, f"{side}_rows")
            assert torch.equal(ids, getattr(a, f"{side}_ids"))
            assert torch.equal(getattr(b, f"{side}_pos"), getattr(a, f"{side}_pos"))
            lengths = [len(getattr(samples[i], f"{side}_ids")) for i in b.sample_indices]
            own = [bucket_width(n) if bucket else n for n in lengths]
            if len(set(own)) == 1:  # one row, or equal ones: packing would save nothing
                assert widths is None and getattr(b, f"{side}_padded_tokens") == ids.numel()
                continue
            packed += 1
            assert widths == own and all(n <= w <= ids.shape[1] for n, w in zip(lengths, widths))
            assert getattr(b, f"{side}_padded_tokens") == sum(widths) < ids.numel()
            shortest = make_microbatches(
                samples, max_tokens=250, widths=RowWidths(bucket, min(own) + 1), **kw
            )
            assert getattr(shortest[k], f"{side}_rows") is None
    assert packed > 0


# ---------------------------------------------------------------------------------------------------
# The real data sets (optional)


@pytest.mark.shared_data
def test_shared_math_and_gsm8k() -> None:
    if not (SHARED_DATA / "math_train.jsonl").exists():
        pytest.skip(f"{SHARED_DATA} not present")
    path = str(SHARED_DATA / "math_train.jsonl")
    with pytest.warns(UserWarning, match="4 of 7500 rows have no 'answer'"):
        math = load_examples(path, answer_key="answer")  # two MATH rows have a null answer, two ""
    assert len(math.examples) == 7500 and sum(e.answer is None for e in math.examples) == 4
    math = load_quiet(path, answer_key="answer", require_answer=True, skip_bad_rows=True)
    assert len(math.examples) == 7496 and math.skipped_bad == 4
    assert all(e.solution and e.answer for e in math.examples)
    assert "\\boxed" in math.examples[0].solution
    gsm = load_examples(
        str(SHARED_DATA / "gsm8k_test.jsonl"), problem_key="question", solution_key=None, answer_key="answer"
    )
    assert len(gsm.examples) == 1319 and "####" in gsm.examples[0].answer


@pytest.mark.slow
def test_the_data_tests_pass_with_offline_mode_set(tmp_path):
    """Offline clusters set HF_HUB_OFFLINE=1 before anything reads it: this module's other tests, run
    again in a process started with it set, pass there too (the ones that need the hub's answers fake
    them and clear the variables they assume)."""
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not offline_mode_set",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
