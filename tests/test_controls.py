"""teacher.solution_source: the wrong-answer control on GSM8K- and MATH-style rows, its refusals, and the
GSM8K solution rewritten as a boxed SFT target."""

from __future__ import annotations

import json

import pytest

from opsd.config import load_config
from opsd.data.controls import (
    apply_solution_source,
    boxed_target,
    final_answer,
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
