"""teacher.solution_source: the wrong-answer control on GSM8K- and MATH-style rows, its refusals, control B
on rows that share one solution, and the GSM8K solution rewritten as a boxed SFT target."""

from __future__ import annotations

import json
import random

import pytest

from opsd.config import load_config
from opsd.data.controls import (
    apply_solution_source,
    boxed_target,
    final_answer,
    require_other_solution,
    shared_text_note,
    shared_text_rows,
    wrong_answer_solution,
    wrong_value,
)
from opsd.data.sources import Example
from opsd.errors import UserError
from opsd.grading import normalize_gold

GSM8K = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)
GSM8K_NO_NOTE = "She bought 4 tops for a total of $20 so 20/4 = $5\n#### 5"
GSM8K_THOUSANDS = "He pays 2*600 = $<<2*600=1200>>1,200 a year.\n#### 1,200"
MATH = "Adding real parts and imaginary parts separately, we have $(2-(-4)+0+2)+(1+0-1+4)i=\\boxed{8+4i}$."
MATH_NUMBER = "The denominator is zero at $y=1$ and $y=4$, so the sum is $\\boxed{5}$. Indeed $\\boxed{5}$."


def test_gsm8k_final_answer_is_wrong_everywhere_it_appears():
    wrong = wrong_answer_solution(GSM8K)
    assert wrong == (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=73>>73 clips altogether in April and May.\n"
        "#### 73"
    )
    # An intermediate result equal to nothing final is kept; only the last worked line changes.
    assert "<<48/2=24>>24" in wrong and "72" not in wrong
    assert wrong_answer_solution(GSM8K_NO_NOTE) == "She bought 4 tops for a total of $20 so 20/4 = $6\n#### 6"
    assert (
        wrong_answer_solution(GSM8K_THOUSANDS) == "He pays 2*600 = $<<2*600=1,201>>1,201 a year.\n#### 1,201"
    )


def test_the_answer_in_words_changes_and_operands_stay():
    prose = "He eats 48 pieces because 32 + 16 = <<32+16=48>>48\n#### 48"
    assert wrong_answer_solution(prose) == "He eats 49 pieces because 32 + 16 = <<32+16=49>>49\n#### 49"
    operand = "The number left is 160-80 = <<160-80=80>>80\n#### 80"
    assert wrong_answer_solution(operand) == "The number left is 160-80 = <<160-80=81>>81\n#### 81"
    assert wrong_answer_solution("x = <<8=8>>8 years old\n#### 8") == "x = <<9=9>>9 years old\n#### 9"


def test_math_boxed_answers_are_replaced():
    assert wrong_answer_solution(MATH_NUMBER).count("\\boxed{6}") == 2
    assert "\\boxed{5}" not in wrong_answer_solution(MATH_NUMBER)
    # A non-numeric answer takes the nearest following row's different final answer.
    assert wrong_answer_solution(MATH, ["8 + 4i", "\\frac{1}{2}"]).endswith("\\boxed{\\frac{1}{2}}$.")
    assert wrong_answer_solution(MATH, ["8+4i"]) is None  # nothing different to put there: refused


def test_wrong_values_are_deterministic_and_differ():
    assert [wrong_value(x) for x in ("72", "-3", "0.5", "1,200", "$10")] == ["73", "-2", "1.5", "1,201", "11"]
    assert final_answer("no answer here") is None and wrong_answer_solution("no answer here") is None


def test_rows_without_a_final_answer_are_refused_and_counted():
    rows = [
        Example("q0", GSM8K, GSM8K, 0),
        Example("q1", "Just prose, no final line.", "7", 1),
        Example("q2", MATH, "8+4i", 2),
        Example("q3", MATH_NUMBER, "5", 3),
    ]
    kept, refused = apply_solution_source(rows, "wrong_answer")
    assert refused == 1 and [ex.row for ex in kept] == [0, 2, 3]
    # The gold answer is unchanged: the student is still graded against 72, 8+4i and 5.
    assert [normalize_gold(ex.answer) for ex in kept] == ["72", "8+4i", "5"]
    assert kept[1].solution.endswith("\\boxed{5}$.")  # row 2's wrong value: row 3's final answer
    other, none = apply_solution_source(rows, "other")
    assert none == 0 and other[0].solution == rows[1].solution and other[-1].solution == rows[0].solution
    assert apply_solution_source(rows, "own") == (rows, 0)


def test_boxed_sft_target():
    assert boxed_target(GSM8K) == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n"
        "The final answer is \\boxed{72}."
    )
    assert boxed_target(GSM8K_THOUSANDS).endswith("\\boxed{1200}.")
    assert boxed_target(MATH) == MATH


def _cfg(tmp_path, rows, source):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        None,
        [
            f"data.path={data}",
            "data.problem_key=question",
            "data.solution_key=answer",
            "data.answer_key=answer",
            f"teacher.solution_source={source}",
        ],
    )


def test_load_data_applies_the_control_and_reports_refusals(tmp_path):
    from opsd.setup import load_data

    rows = [{"question": "Natalia?", "answer": GSM8K}, {"question": "Prose?", "answer": "no final answer"}]
    data = load_data(
        _cfg(tmp_path, rows, "wrong_answer"), privileged=True, needs_answers=True, rank=0, world=1
    )
    assert data.report["wrong_answer_refused"] == 1 and data.report["rows"] == 2
    assert [ex.solution.endswith("#### 73") for ex in data.examples] == [True]
    assert normalize_gold(data.examples[0].answer) == "72"
    own = load_data(_cfg(tmp_path, rows, "own"), privileged=True, needs_answers=True, rank=0, world=1)
    assert own.report["wrong_answer_refused"] == 0 and len(own.examples) == 2
    with pytest.raises(UserError, match="refused all 1 rows"):
        load_data(
            _cfg(tmp_path, rows[1:], "wrong_answer"), privileged=True, needs_answers=True, rank=0, world=1
        )


def test_the_answer_is_convention_is_a_final_answer_and_is_made_wrong():
    """Arithmetic word problems close with "The answer is N.": the final answer, and the last step's
    result, change; the earlier steps stay."""
    solution = "24 + 6 = 30. 30 + 11 = 41. 91 - 41 = 50. The answer is 50."
    assert final_answer(solution) == "50"
    assert wrong_answer_solution(solution) == "24 + 6 = 30. 30 + 11 = 41. 91 - 41 = 51. The answer is 51."
    decimals = "0.5 + 0.25 = 0.75. The answer is 0.75."
    assert wrong_answer_solution(decimals) == "0.5 + 0.25 = 1.75. The answer is 1.75."


def _bios(people: list[str]) -> list[Example]:
    """One row a question, ``people[i]``'s biography the solution: rows of one person share their text."""
    return [Example(f"q{i}", f"{who} was born in Havana.", who, i) for i, who in enumerate(people)]


def test_control_b_never_reads_the_rows_own_text_where_rows_share_it():
    """Nine questions a person, shuffled, and a group at the end whose nearest different text wraps
    around to the first row."""
    people = [who for who in ("Ines", "Petra", "Walter", "Yara") for _ in range(9)]
    random.Random(0).shuffle(people)
    people += ["Zoe"] * 4
    rows = _bios(people)
    other, refused = apply_solution_source(rows, "other")
    assert refused == 0 and len(other) == len(rows)
    assert all(o.solution != ex.solution for o, ex in zip(other, rows))
    assert [o.problem for o in other] == [ex.problem for ex in rows]  # only the solution changes
    n = len(rows)
    for i, ex in enumerate(rows):  # the nearest following row whose text differs
        j = next(j % n for j in range(i + 1, i + n) if rows[j % n].solution != ex.solution)
        assert other[i].solution == rows[j].solution
    assert [o.solution for o in other[-4:]] == [rows[0].solution] * 4


def test_control_b_takes_the_nearest_following_different_solution():
    rows = _bios(["A", "A", "B", "B", "B", "C", "A"])
    other, _ = apply_solution_source(rows, "other")
    assert [o.answer for o in rows] == ["A", "A", "B", "B", "B", "C", "A"]
    assert [o.solution.split()[0] for o in other] == ["B", "B", "C", "C", "C", "A", "B"]
    # Whitespace alone does not make a text different.
    spaced = [Example("q0", "Ana  was born.", "", 0), Example("q1", "Ana was born.\n", "", 1)]
    assert apply_solution_source(spaced, "other") == ([], 2)


def test_shared_rows_are_counted():
    assert shared_text_rows(_bios(["A", "B", "A", "C", "C", "C", "D"])) == 5
    assert shared_text_rows(_bios(["A", "B", "C"])) == 0
    assert shared_text_rows([]) == 0
    note = shared_text_note(_bios(["A", "B", "A"]), "train.jsonl")
    assert note.startswith("data: 2 of 3 rows of train.jsonl share their solution with another row;")
    assert "\n" not in note


def test_control_b_refuses_rows_that_all_share_one_solution(tmp_path):
    """Nothing else to read: refused in one line naming the file, here and where training loads it."""
    from opsd.setup import load_data

    same = _bios(["A"] * 5)
    assert apply_solution_source(same, "other") == ([], 5)
    assert apply_solution_source(same[:1], "other") == ([], 1)
    with pytest.raises(UserError, match="every row has the same solution") as err:
        require_other_solution(same, "facts/train.jsonl")
    assert str(err.value).startswith("facts/train.jsonl: ") and "\n" not in str(err.value)
    require_other_solution(_bios(["A", "B"]), "train.jsonl")  # two different solutions: kept
    rows = [{"question": f"Q{i}?", "answer": "Ana was born in Lima."} for i in range(3)]
    cfg = _cfg(tmp_path, rows, "other")
    with pytest.raises(UserError, match="every row has the same solution") as err:
        load_data(cfg, privileged=True, needs_answers=False, rank=0, world=1)
    assert str(err.value).startswith(f"{cfg.data.path}: ") and "\n" not in str(err.value)
    # Without a teacher reading solutions no control applies: nothing is refused.
    assert len(load_data(cfg, privileged=False, needs_answers=False, rank=0, world=1).examples) == 3


def test_load_data_gives_control_b_the_nearest_different_solution(tmp_path):
    from opsd.setup import load_data

    rows = [{"question": f"Q{i}?", "answer": f"{who} was born."} for i, who in enumerate("AABA")]
    data = load_data(_cfg(tmp_path, rows, "other"), privileged=True, needs_answers=False, rank=0, world=1)
    assert [ex.solution[0] for ex in data.examples] == ["B", "B", "A", "B"]
