"""opsd.data: loading every source kind and every bad input, and the real data sets."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import SHARED_DATA

from opsd.data import (
    RowKeys,
    load_examples,
    sources,
)
from opsd.errors import UserError

ROWS = [
    {"problem": "What is 2 + 3?", "solution": "2 + 3 = 5.", "answer": "5"},
    {"problem": "What is 4 * 6?", "solution": "4 * 6 = 24.", "answer": "24"},
    {"problem": "What is 9 - 7?", "solution": "9 - 7 = 2.", "answer": "2"},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_quiet(source, keys=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_examples(str(source), keys, **kw)


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
    _check_rows(load_examples(str(src), RowKeys(answer="answer")), src)


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
    ex = load_examples(str(tmp_path / "d.csv"), RowKeys(answer="answer")).examples[0]
    assert (ex.problem, ex.solution, ex.answer) == (rows[0]["problem"], rows[0]["solution"], "007")


def test_messages_problem(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}]
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs, "solution": "2"}])
    ex = load_examples(str(src), RowKeys(problem="messages")).examples[0]
    assert ex.problem == msgs


def test_messages_problem_from_parquet(tmp_path: Path) -> None:
    import datasets

    msgs = [{"role": "user", "content": "What is 1 + 1?"}]
    datasets.Dataset.from_list([{"messages": msgs, "solution": "2"}]).to_parquet(str(tmp_path / "m.parquet"))
    assert load_examples(str(tmp_path / "m.parquet"), RowKeys(problem="messages")).examples[0].problem == msgs


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
        load_examples(str(src), RowKeys(problem="messages"))


def test_numeric_answers_become_strings_and_gsm8k_raw(tmp_path: Path) -> None:
    rows = [
        {"question": "q1", "answer": 72},
        {"question": "q2", "answer": 3.0},
        {"question": "q3", "answer": 0.5},
        {"question": "q4", "answer": "She makes 9 * 2 = 18.\n#### 18"},
    ]
    src = write_jsonl(tmp_path / "gsm.jsonl", rows)
    report = load_examples(str(src), RowKeys(problem="question", solution=None, answer="answer"))
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
    _check_rows(load_examples(str(src), RowKeys(answer="answer")), src)
    # the first row is a good row, not a bad one to skip
    _check_rows(load_examples(str(src), RowKeys(answer="answer"), skip_bad_rows=True), src)


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
        load_examples(str(src), RowKeys(answer="answer"))


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
    report = load_quiet(src, RowKeys(answer="answer"), skip_bad_rows=True, require_answer=True)
    assert report.skipped_bad == 6
    assert [e.row for e in report.examples] == [0, 7]
    report = load_quiet(src, RowKeys(answer="answer"), skip_bad_rows=True)  # answer optional now
    assert report.skipped_bad == 4
    assert [e.answer for e in report.examples] == ["5", None, None, "24"]


def test_require_answer_without_skip_raises(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "solution": "s"}])
    with pytest.raises(
        ValueError, match=r"missing field 'answer'; available keys: \['problem', 'solution'\]"
    ):
        load_examples(str(src), RowKeys(answer="answer"), require_answer=True)
    with pytest.warns(UserWarning, match="1 of 1 rows have no 'answer'"):
        assert load_examples(str(src), RowKeys(answer="answer")).examples[0].answer is None


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
        load_examples("x.jsonl", RowKeys(solution=None), drop_empty_solution=True)
    with pytest.raises(ValueError, match="require_answer"):
        load_examples("x.jsonl", require_answer=True)


def test_not_a_saved_dataset_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Hugging Face datasets directory"):
        load_examples(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# The real data sets (optional)


@pytest.mark.shared_data
def test_shared_math_and_gsm8k() -> None:
    if not (SHARED_DATA / "math_train.jsonl").exists():
        pytest.skip(f"{SHARED_DATA} not present")
    path = str(SHARED_DATA / "math_train.jsonl")
    with pytest.warns(UserWarning, match="4 of 7500 rows have no 'answer'"):
        math = load_examples(path, RowKeys(answer="answer"))  # two MATH rows have a null answer, two ""
    assert len(math.examples) == 7500 and sum(e.answer is None for e in math.examples) == 4
    math = load_quiet(path, RowKeys(answer="answer"), require_answer=True, skip_bad_rows=True)
    assert len(math.examples) == 7496 and math.skipped_bad == 4
    assert all(e.solution and e.answer for e in math.examples)
    assert "\\boxed" in math.examples[0].solution
    gsm = load_examples(
        str(SHARED_DATA / "gsm8k_test.jsonl"), RowKeys(problem="question", solution=None, answer="answer")
    )
    assert len(gsm.examples) == 1319 and "####" in gsm.examples[0].answer


@pytest.mark.slow
def test_the_data_tests_pass_with_offline_mode_set(tmp_path):
    """Offline clusters set HF_HUB_OFFLINE=1 before anything reads it: the data room's other tests, run
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
            str(Path(__file__).parent),
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
