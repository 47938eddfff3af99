"""Answer grading for math benchmarks: last \\boxed{} extraction + math-verify equivalence; and for
short factual answers (``contains``, ``exact``).

Grading never raises: a parse error, a timeout or an answer too large to check safely is an
incorrect verdict with the reason in `Grade.error`, so one pathological sample cannot kill an eval
(or a training run that evaluates every N steps).
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import sympy

from opsd.errors import UserError

# Longest extracted answer we hand to sympy. Real answers (matrices, long expressions) are far
# shorter; without a cap a degenerate 100k-char "answer" can stall the parser for minutes.
MAX_ANSWER_CHARS = 1000
# Numbers with more digits than this are not evaluated: off the main thread there is no timeout,
# and sympy evaluating e.g. 10^{10^{10^{10}}} never returns.
MAX_NUMBER_DIGITS = 1_000_000

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@functools.cache
def _math_verify() -> SimpleNamespace:
    """math-verify, imported where grading runs: a run that never grades with it (training alone, the
    GPU machine's evidence run, whose image lacks it) needs no math-verify installed. Missing where it
    is needed: one line, not a wrong verdict per answer."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from math_verify.errors import TimeoutException
    except ModuleNotFoundError as e:
        raise UserError(
            f"grading with math-verify needs the math-verify package ({e}): pip install math-verify"
        ) from e
    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]
    return SimpleNamespace(
        parse=parse, verify=verify, TimeoutException=TimeoutException, extraction=extraction
    )


@dataclass
class Grade:
    correct: bool
    extracted: str | None  # the last \boxed{} content of the response; None when there is none
    error: str | None  # why grading could not complete (counted as incorrect); None when it did


# A grader maps (response text, gold answer) to a Grade. ``grade`` below (math-verify on the last
# \boxed{}) is the default of `opsd eval`; a task with its own answer format (the demo) passes its own.
Grader = Callable[[str, str], Grade]


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}); None if absent or its braces never close."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i) and not text[i:].lstrip(" ").startswith("{"):
        # "\boxed 5" form: the answer runs to the next "$" or whitespace.
        rest = text[i:].lstrip(" ")
        end = min((j for j in (rest.find("$"), rest.find(" "), rest.find("\n")) if j >= 0), default=len(rest))
        return rest[:end] or None
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def normalize_gold(gold: str) -> str:
    """Reduce a gold answer field to the bare answer.

    GSM8K answers are a worked solution ending in "#### 1,234"; MATH-style fields may hold a full
    solution with a \\boxed{}. Plain answers pass through stripped.
    """
    gold = str(gold)
    if "####" in gold:
        return gold.rsplit("####", 1)[1].strip().replace(",", "")
    if any(cmd in gold for cmd in _BOX_COMMANDS):
        boxed = extract_boxed(gold)
        if boxed is not None:
            return boxed.strip()
    return gold.strip()


def _log10_magnitude(expr: sympy.Basic) -> float:
    """Rough upper bound on log10 |expr| for a numeric sympy tree, without evaluating it."""
    if isinstance(expr, sympy.Integer):
        v = abs(int(expr))
        return math.log10(v) if v > 0 else 0.0  # math.log10 takes ints of any size
    if isinstance(expr, (sympy.Rational, sympy.Float)):
        v = abs(float(expr))
        return math.log10(v) if v > 1 else 0.0
    if isinstance(expr, sympy.Pow):
        base, exp = _log10_magnitude(expr.base), _log10_magnitude(expr.exp)
        exp_value = 10.0**exp if exp < 300 else math.inf
        return base * exp_value
    if isinstance(expr, sympy.Mul):
        return sum(_log10_magnitude(a) for a in expr.args)
    if expr.args:
        return max(_log10_magnitude(a) for a in expr.args) + math.log10(len(expr.args))
    return 1.0  # pi, E, symbols, ...


def _too_large(parsed: list) -> bool:
    for item in parsed:
        if isinstance(item, sympy.Basic) and not isinstance(item, sympy.MatrixBase):
            for node in sympy.preorder_traversal(item):
                if isinstance(node, sympy.Pow) and _log10_magnitude(node) > MAX_NUMBER_DIGITS:
                    return True
    return False


def grade(response: str, gold: str, timeout_s: float = 5) -> Grade:
    """Grade one response against a gold answer with math-verify.

    math-verify's timeouts use SIGALRM, which only works on the main thread; elsewhere they are
    disabled and the length/magnitude caps above are what keeps grading bounded.
    """
    mv = _math_verify()
    extracted = extract_boxed(response)
    if extracted is None:
        return Grade(correct=False, extracted=None, error=None)
    if not extracted.strip():
        return Grade(correct=False, extracted=extracted, error=None)
    if len(extracted) > MAX_ANSWER_CHARS:
        return Grade(
            False, extracted[:200], f"answer too long to grade ({len(extracted)} chars > {MAX_ANSWER_CHARS})"
        )
    gold_answer = normalize_gold(gold)
    if not gold_answer:
        return Grade(False, extracted, "empty gold answer")
    on_main = threading.current_thread() is threading.main_thread()
    timeout = math.ceil(timeout_s) if on_main and timeout_s > 0 else None  # signal.alarm takes whole seconds
    try:
        gold_parsed = mv.parse(
            "\\boxed{" + gold_answer + "}", mv.extraction, parsing_timeout=timeout, raise_on_error=True
        )
        pred_parsed = mv.parse(
            "\\boxed{" + extracted + "}", mv.extraction, parsing_timeout=timeout, raise_on_error=True
        )
        if not gold_parsed:
            return Grade(False, extracted, f"could not parse gold answer {gold_answer[:100]!r}")
        if not pred_parsed:
            return Grade(False, extracted, None)
        if _too_large(pred_parsed) or _too_large(gold_parsed):
            return Grade(False, extracted, f"number too large to verify (> {MAX_NUMBER_DIGITS} digits)")
    except mv.TimeoutException:
        return Grade(False, extracted, f"math-verify parse timed out after {timeout_s}s")
    except Exception as e:  # noqa: BLE001 - any grader failure is an incorrect, recorded verdict
        return Grade(False, extracted, f"parse failed: {type(e).__name__}: {str(e)[:200]}")
    # parse() returns [sympy form, raw string]; compare pair by pair (as verify() does) so a failure
    # on one representation neither hides a match on another nor goes unrecorded.
    error = None
    for g in gold_parsed:
        for t in pred_parsed:
            try:
                if mv.verify(g, t, timeout_seconds=timeout, raise_on_error=True):
                    return Grade(correct=True, extracted=extracted, error=None)
            except mv.TimeoutException:
                return Grade(False, extracted, f"math-verify timed out after {timeout_s}s")
            except Exception as e:  # noqa: BLE001
                error = error or f"verify failed: {type(e).__name__}: {str(e)[:200]}"
    return Grade(correct=False, extracted=extracted, error=error)


def grade_lenient(response: str, gold: str) -> Grade:
    """math-verify's own extraction on the response's tail (\\boxed{}, "final answer is", the last
    expression) instead of the last \\boxed{} only.

    For models that rarely box their answer: reported beside the strict :func:`grade`, it shows what a
    model gets right without following the output format. Never raises, like :func:`grade`.
    """
    mv = _math_verify()
    try:
        pred = mv.parse(response[-4 * MAX_ANSWER_CHARS :])
        if not pred:
            return Grade(correct=False, extracted=None, error=None)
        correct = bool(mv.verify(mv.parse("\\boxed{" + normalize_gold(gold) + "}"), pred))
        return Grade(correct=correct, extracted=str(pred[-1])[:200], error=None)
    except mv.TimeoutException:
        return Grade(False, None, "math-verify timed out")
    except Exception as e:  # noqa: BLE001 - any grader failure is an incorrect, recorded verdict
        return Grade(False, None, f"lenient grading failed: {type(e).__name__}: {str(e)[:200]}")


_LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def grade_last_number(response: str, gold: str) -> Grade:
    """:func:`grade` where the response has a \\boxed{} answer, else its last number (thousands separators
    dropped) compared numerically with the gold answer: the lenient reading of a numeric answer (GSM8K)
    for a model that does not box it. Never raises."""
    if extract_boxed(response) is not None:
        return grade(response, gold)
    return _same_number(_LAST_NUMBER.findall(response[-4 * MAX_ANSWER_CHARS :]), gold)


def _same_number(found: list[str], gold: str) -> Grade:
    """The last of ``found`` (thousands separators dropped) against the gold answer, numerically; none
    found is incorrect, a gold answer that is not a number is recorded."""
    if not found:
        return Grade(correct=False, extracted=None, error=None)
    said = found[-1].replace(",", "")
    try:
        correct = float(said) == float(normalize_gold(gold).replace(",", "").strip().lstrip("$"))
    except ValueError:
        return Grade(False, said, f"gold answer {normalize_gold(gold)[:100]!r} is not a number")
    return Grade(correct=correct, extracted=said, error=None)


_ANSWER_IS = re.compile(r"[Tt]he answer is[ \t]*:?[ \t]*\$?[ \t]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")


def grade_answer_is(response: str, gold: str) -> Grade:
    """The number after the response's last "The answer is" compared numerically with the gold answer;
    no such phrase is wrong: the strict reading of the instruction "Finish with: The answer is N."
    (arithmetic word problems). Never raises."""
    return _same_number(_ANSWER_IS.findall(response), gold)


def _number_settled(text: str, end: int) -> int | None:
    """Where the number that ends at ``end`` can no longer grow, or None: after it the regex reads
    only digits, then ``,`` or ``.`` followed by a digit. So the number is settled by a next character
    that is none of these, or by ``,``/``.`` followed by a non-digit. A space settles it only before a
    character other than ``,``/``.`` (a tokenizer's clean-up of spaces turns " ." into "."); an
    unfinished character (U+FFFD, a token cut inside a UTF-8 sequence) settles nothing."""
    after = text[end : end + 2]
    if not after or after[0] == "\ufffd" or after[0].isdecimal():
        return None
    if after[0] in ",. ":
        if len(after) < 2 or after[1] == "\ufffd":
            return None
        if after[0] == " ":
            return None if after[1] in ",." else end + 2
        return None if after[1].isdecimal() else end + 2
    return end + 1


def answer_is_settled(text: str) -> int | None:
    """The length of the shortest prefix of ``text`` in which an answer :func:`grade_answer_is` reads is
    complete (the first such "The answer is N"), or None. Grading that prefix gives the grade of every
    text it begins, unless the rest writes another "The answer is" (the grader reads the last)."""
    for m in _ANSWER_IS.finditer(text):
        settled = _number_settled(text, m.end())
        if settled is not None:
            return settled
    return None


_ANSWER_IS_PENDING = re.compile(r"[Tt]he answer is[ \t]*:?[ \t]*\$?[ \t]*(?:-?[\d,.]*[ ]?)?\ufffd*$")


def answer_is_pending(text: str) -> bool:
    """Whether ``text`` ends inside an answer :func:`grade_answer_is` would read: the phrase, then at
    most a number still being written."""
    return _ANSWER_IS_PENDING.search(text[-200:]) is not None


@dataclass(frozen=True)
class AnswerEnd:
    """Where a grader's answer is complete in a response's text: `opsd probe` stops greedy answers
    there (:func:`opsd.eval.cut.generate_to_answer`) instead of generating what no grade reads.

    ``settled(text)``: the length of the shortest prefix of ``text`` whose grade every longer text
    keeps unless it writes another answer, or None. ``pending(text)``: whether ``text`` ends inside an
    answer still being written. ``markers``: strings every such answer contains, which an engine stops
    at (``SamplingParams.stop_strings``) so the few tokens that settle the answer come next."""

    markers: tuple[str, ...]
    settled: Callable[[str], int | None]
    pending: Callable[[str], bool]
    rule: str  # the cut in words, for the probe's output


# The graders whose answers can end before the response does, by name (:data:`GRADERS`).
ANSWER_ENDS: dict[str, AnswerEnd] = {
    "answer_is": AnswerEnd(
        markers=("he answer is",),
        settled=answer_is_settled,
        pending=answer_is_pending,
        rule=(
            'answer_is: a response stops once its first "The answer is N" is complete (a character '
            "after N that cannot extend it); the grader reads the last one, so a response that would "
            "have written another answer later is graded on its first"
        ),
    ),
}


def grade_contains(response: str, gold: str) -> Grade:
    """The gold answer anywhere in the response as a whole word or phrase, ignoring case ("Havana" in "He
    was born in Havana.", not "pilot" in "copilots"; the words of "software engineer" may be parted by
    any whitespace): short factual answers stated in a sentence. Never raises."""
    words = str(gold or "").split()
    if not words:
        return Grade(False, None, "empty gold answer")
    phrase = r"\s+".join(re.escape(w) for w in words)
    found = re.search(rf"(?<!\w){phrase}(?!\w)", str(response), re.IGNORECASE)
    return Grade(correct=found is not None, extracted=found.group(0) if found else None, error=None)


def grade_exact(response: str, gold: str) -> Grade:
    """The whole response, stripped of surrounding whitespace and one final period, equal to the gold
    answer ignoring case (the gold stripped alike, so "Washington, D.C." matches itself): a model told to
    answer with the answer alone. Never raises."""
    want = _bare(str(gold or ""))
    if not want:
        return Grade(False, None, "empty gold answer")
    said = _bare(str(response))
    return Grade(correct=said.casefold() == want.casefold(), extracted=said[:200], error=None)


def _bare(text: str) -> str:
    """``text`` without surrounding whitespace and one final period."""
    text = text.strip()
    return text[:-1].rstrip() if text.endswith(".") else text


# The graders by name: `opsd eval`'s `grader` key (and the GRPO reward's `grpo.grader`) use these names.
GRADERS: dict[str, Grader] = {
    "math": grade,
    "lenient": grade_lenient,
    "last_number": grade_last_number,
    "answer_is": grade_answer_is,
    "contains": grade_contains,
    "exact": grade_exact,
}


def resolve_grader(name: str, key: str) -> Callable[[str, str], Any]:
    """A grader by name (:data:`GRADERS`) or as ``package.module:function`` returning a :class:`Grade`,
    a bool or a float; the one place grader names are read. ``key``: the config key, for the error."""
    if name in GRADERS:
        return GRADERS[name]
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        raise UserError(
            f"{key}={name!r}: expected one of {sorted(GRADERS)} or an importable package.module:function"
        ) from None


def as_grade(verdict: Any) -> Grade:
    """A custom grader's verdict (a Grade, a bool or a number in [0, 1]) as a Grade."""
    if isinstance(verdict, Grade):
        return verdict
    return Grade(correct=bool(float(getattr(verdict, "correct", verdict)) >= 1.0), extracted=None, error=None)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), as a stable running product."""
    if not (n >= 1 and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (samples per problem), got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong
