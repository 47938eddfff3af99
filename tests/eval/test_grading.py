"""Grading on real benchmark answer formats, pathological responses, threads, and pass@k."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from opsd.grading import (
    GRADERS,
    MAX_ANSWER_CHARS,
    Grade,
    extract_boxed,
    grade,
    grade_lenient,
    normalize_gold,
    pass_at_k,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # last one wins, nested braces kept
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\fbox{7}", "7"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{}", ""),
        (r"no box here: 42", None),
        (r"\boxed{\frac{1}{2}", None),  # unbalanced
        (r"\boxed{3} and then \boxed{4", None),  # last one unbalanced: no silent fallback
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("Natalia sold 48 clips...\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### -5", "-5"),
        (r"Thus the area is $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}"),
        ("  17 ", "17"),
    ],
)
def test_normalize_gold(gold: str, expected: str) -> None:
    assert normalize_gold(gold) == expected


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1/2}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{1}{2}}", r"\frac12"),
        (r"\boxed{\text{(B)}}", "B"),
        (r"\boxed{\text{east}}", r"\text{east}"),
        (r"\boxed{(1,2)}", "(1, 2)"),
        (r"\boxed{073}", "73"),
        (r"The total is \boxed{72}", "She sold 48/2 = 24 in May.\n#### 72"),
        (r"\boxed{1,234}", "#### 1,234"),
        (r"\boxed{-3}", "-3"),
        (r"\boxed{\frac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\{2,1\}}", r"\{1,2\}"),
        (r"\boxed{[1,2)}", "[1,2)"),
        (r"\boxed{(-\infty, 3]}", r"(-\infty,3]"),
        (r"\boxed{2^{2^{10}}}", "2^{1024}"),
    ],
)
def test_equivalent_answers_are_correct(response: str, gold: str) -> None:
    g = grade(response, gold)
    assert g == Grade(correct=True, extracted=extract_boxed(response), error=None)


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{3}", "-3"),
        (r"\boxed{(2,1)}", "(1,2)"),
        (r"\boxed{[1,2]}", "[1,2)"),
        (r"\boxed{71}", "#### 72"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
    ],
)
def test_wrong_answers_are_incorrect(response: str, gold: str) -> None:
    g = grade(response, gold)
    assert not g.correct and g.error is None


@pytest.mark.parametrize("response", ["", "The answer is 72.", r"\boxed{}", r"\boxed{72"])
def test_missing_empty_or_unbalanced_answer_is_incorrect(response: str) -> None:
    g = grade(response, "72")
    assert not g.correct and g.error is None


def test_enormous_answer_is_incorrect_with_error() -> None:
    g = grade(r"\boxed{" + "1" * 100_000 + "}", "1")
    assert not g.correct
    assert g.error is not None and str(MAX_ANSWER_CHARS) in g.error
    assert len(g.extracted or "") <= 200  # the verdict does not carry the whole blob around


def test_enormous_response_with_small_answer_is_graded() -> None:
    assert grade("x" * 100_000 + r" \boxed{5}", "5").correct


def test_power_tower_is_refused_not_hung() -> None:
    g = grade(r"\boxed{10^{10^{10^{10}}}}", "5")
    assert not g.correct and g.error is not None and "too large" in g.error


def test_unparseable_gold_is_recorded() -> None:
    g = grade(r"\boxed{5}", "   ")
    assert not g.correct and g.error == "empty gold answer"


def test_grading_off_the_main_thread() -> None:
    cases = [
        (r"\boxed{\frac12}", "0.5", True),
        (r"\boxed{073}", "#### 73", True),
        (r"\boxed{4}", "5", False),
        (r"\boxed{10^{10^{10^{10}}}}", "5", False),
        (r"\boxed{" + "9" * 5000 + "}", "5", False),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        grades = list(pool.map(lambda c: grade(c[0], c[1]), cases))
    assert [g.correct for g in grades] == [c[2] for c in cases]
    assert all(g.error is None for g in grades[:3])
    assert all(g.error is not None for g in grades[3:])


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 0, 3, 0.0),
        (5, 5, 3, 1.0),
        (5, 4, 2, 1.0),  # fewer wrong samples than k: always a correct one in the draw
        (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k(n: int, c: int, k: int, expected: float) -> None:
    # float64 (u = 1.1e-16): a running product of <= 3 factors (2 roundings each) and 1 - p against one
    # division and 1 - q: <= ~9u = 1e-15 apart on values <= 1; measured <= 1 ulp (1.1e-16)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=0, abs=1e-14)


def test_pass_at_k_large_n_is_stable() -> None:
    # 1 - (1 - 1/1000): the inner rounding (<= u/2 = 5.6e-17) survives the exact outer subtraction, which
    # makes it 5.6e-14 relative to 0.001; measured 8.7e-16
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001, rel=1e-12, abs=0)
    # exact: 1 / C(1000, 500) = 4e-300 is far below half an ulp of 1, so both sides round to 1.0
    assert pass_at_k(1000, 500, 500) == 1 - math.comb(500, 500) / math.comb(1000, 500)


@pytest.mark.parametrize("n, c, k", [(5, 2, 6), (5, 2, 0), (5, 6, 1), (0, 0, 1), (5, -1, 1)])
def test_pass_at_k_bad_input(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_timeout_on_main_thread_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from math_verify.utils import timeout

    import opsd.grading as grading

    @timeout(1)  # math-verify's own SIGALRM mechanism, as inside verify()
    def slow(*args, **kwargs):
        time.sleep(5)
        return True

    def fake_verify(gold, target, timeout_seconds=None, raise_on_error=False):
        assert timeout_seconds == 1  # main thread: timeouts on
        return slow()

    monkeypatch.setattr(grading._math_verify(), "verify", fake_verify)
    g = grading.grade(r"\boxed{5}", "5", timeout_s=1)
    assert g == Grade(correct=False, extracted="5", error="math-verify timed out after 1s")


def test_grader_exception_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    import opsd.grading as grading

    def broken(*args, **kwargs):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(grading._math_verify(), "verify", broken)
    g = grading.grade(r"\boxed{5}", "5")
    assert not g.correct and g.error is not None and "sympy exploded" in g.error
    monkeypatch.setattr(grading._math_verify(), "parse", broken)
    g = grading.grade(r"\boxed{5}", "5")
    assert not g.correct and g.error is not None and g.error.startswith("parse failed")


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("So the answer is 72.", "Sold 24 in May.\n#### 72", True),  # no \boxed{}: strict says no
        (r"The final answer is $\frac{1}{2}$", r"\frac12", True),
        (r"\boxed{0.5}", "0.5", True),
        ("I think it is 71.", "72", False),
        ("", "72", False),
        ("x" * 100_000, "72", False),
    ],
)
def test_grade_lenient(response: str, gold: str, expected: bool) -> None:
    g = grade_lenient(response, gold)
    assert g.correct is expected and g.error is None
    if expected and r"\boxed" not in response:
        assert not grade(response, gold).correct  # what the lenient column adds over the strict one


def test_graders_by_name() -> None:
    from opsd.grading import grade_answer_is, grade_contains, grade_exact, grade_last_number

    assert GRADERS == {
        "math": grade,
        "lenient": grade_lenient,
        "last_number": grade_last_number,
        "answer_is": grade_answer_is,
        "contains": grade_contains,
        "exact": grade_exact,
    }


def test_last_number_grader_reads_boxed_strictly_then_the_last_number():
    from opsd.grading import GRADERS, grade_last_number

    gold = "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert GRADERS["last_number"] is grade_last_number
    assert grade_last_number("so she sold \\boxed{72} clips", gold).correct
    # A boxed answer is the answer: a later number does not rescue a wrong one.
    assert not grade_last_number("\\boxed{71}, not 72", gold).correct
    assert grade_last_number("48 + 24 = 72 clips. The answer is 72.", gold).correct
    assert grade_last_number("It costs $1,200.", "#### 1200").correct
    assert grade_last_number("That gives 72.0", gold).correct
    assert not grade_last_number("The answer is 27.", gold).correct
    none = grade_last_number("I do not know.", gold)
    assert not none.correct and none.extracted is None
    assert grade_last_number("12", "\\frac{1}{2}").error  # a non-numeric gold: recorded, not raised


def test_training_imports_without_math_verify_and_grading_says_what_is_missing(tmp_path) -> None:
    """The GPU machine's image has no math-verify: opsd imports it where grading runs, not before, so a
    run that does not grade with it trains; grading without it is one line naming the package."""
    import os
    import subprocess
    import sys

    shadow = tmp_path / "math_verify"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'math_verify'\", name='math_verify')\n"
    )
    code = (
        "import sys, opsd.cli, opsd.trainer, opsd.eval.cli\n"
        "assert 'math_verify' not in sys.modules\n"
        "from opsd.errors import UserError\n"
        "from opsd.grading import grade\n"
        "try:\n"
        "    grade(r'\\boxed{5}', '5')\n"
        "except UserError as e:\n"
        "    print('USER ERROR', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "USER ERROR grading with math-verify needs the math-verify package" in res.stdout


@pytest.mark.parametrize(
    "response, gold, correct, extracted",
    [
        ("3 + 4 = 7. The answer is 7.", "7", True, "7"),
        ("The answer is 1,200.", "1200", True, "1200"),
        ("the answer is: 0.5", "0.5", True, "0.5"),
        ("The answer is 6. Wait, the answer is 7.", "7", True, "7"),  # the last one counts
        ("3 + 4 = 7.", "7", False, None),  # no "The answer is": strict
        ("The answer is 8.", "7", False, "8"),
    ],
)
def test_answer_is_reads_the_number_after_the_last_answer_phrase(response, gold, correct, extracted):
    from opsd.grading import GRADERS

    g = GRADERS["answer_is"](response, gold)
    assert (g.correct, g.extracted, g.error) == (correct, extracted, None)


def test_answer_is_records_a_gold_that_is_not_a_number():
    from opsd.grading import grade_answer_is

    g = grade_answer_is("The answer is 7.", "x + 1")
    assert not g.correct and "not a number" in g.error


@pytest.mark.parametrize(
    "response, gold, correct",
    [
        ("He was born in Havana.", "Havana", True),
        ("HAVANA, of course", "havana", True),  # case is ignored
        ("He flies copilots around.", "pilot", False),  # a whole word, not part of one
        ("She is a pilot.", "pilot", True),
        ("He was born in 19845.", "1984", False),
        ("He was born in 1984.", "1984", True),
        ("She works as a software engineer.", "software engineer", True),  # a phrase across spaces
        ("She works as a Software  Engineer.", "software engineer", True),
        ("She works as an engineer of software.", "software engineer", False),
        ("He writes C++ all day.", "C++", True),  # regex metacharacters are literal
        ("He writes Cxx all day.", "C++", False),
        ("It costs $5 (five).", "$5", True),
        ("Born in St. Louis.", "St. Louis", True),
        ("Born in Stx Louis.", "St. Louis", False),
        ("", "Havana", False),
    ],
)
def test_contains_finds_the_gold_as_a_whole_word_or_phrase(response: str, gold: str, correct: bool) -> None:
    g = GRADERS["contains"](response, gold)
    assert (g.correct, g.error) == (correct, None)


@pytest.mark.parametrize(
    "response, gold, correct",
    [
        ("Havana", "Havana", True),
        ("  havana.\n", "Havana", True),  # surrounding whitespace and one final period
        ("Havana..", "Havana", False),  # one period only
        ("Washington, D.C.", "Washington, D.C.", True),  # the gold stripped alike
        ("He was born in Havana.", "Havana", False),  # the whole response, not a part
        ("Havana!", "Havana", False),
        ("1984", "1984", True),
    ],
)
def test_exact_compares_the_whole_response(response: str, gold: str, correct: bool) -> None:
    g = GRADERS["exact"](response, gold)
    assert (g.correct, g.error) == (correct, None)


@pytest.mark.parametrize("name", ["contains", "exact"])
@pytest.mark.parametrize("gold", [None, "", "   "])
def test_an_empty_gold_is_incorrect_with_its_reason(name: str, gold: str | None) -> None:
    g = GRADERS[name]("Havana", gold)
    assert not g.correct and g.error == "empty gold answer"
