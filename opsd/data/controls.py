"""What the teacher reads in place of each problem's own solution (``teacher.solution_source``), and the
GSM8K worked solution rewritten as an SFT target in the student's answer format.

* ``own``: the row's solution, unchanged.
* ``other`` (control B): the solution of the nearest following row (wrapping around) whose solution
  differs from the row's own: where rows share one text (several questions on one biography), the next
  row's is often that same text. Every row having the same solution is refused
  (:func:`require_other_solution`); :func:`shared_text_rows` counts the rows that share theirs.
* ``wrong_answer``: the row's own solution with its final answer replaced by a wrong value
  (:func:`wrong_answer_solution`): every ``#### N``, every ``\\boxed{N}`` and, on the last worked line,
  the calculator note's result and the number after it (``<<48+24=72>>72``), a result written
  after ``=`` without a note (``20/4 = $5``), and the answer stated in words (``He eats 48 pieces
  because ...``; a number next to an operator is an operand and kept). A numeric N becomes N + 1
  (as many decimals as N, thousands separators kept); a non-numeric one (``\\frac{1}{2}``) becomes the
  final answer of the nearest following row that differs. The gold answer (``Example.answer``) is
  unchanged. A row whose solution has no detectable final answer (no ``####`` and no ``\\boxed{}``) is
  refused and counted, never kept with its true answer.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from opsd.data.sources import Example
from opsd.errors import UserError

SOLUTION_SOURCES = ("own", "other", "wrong_answer")
_HASHES = re.compile(r"####[ \t]*\$?[ \t]*(-?[\d,]*\.?\d+)")
_ANSWER_IS = re.compile(r"[Tt]he answer is[ \t]*:?[ \t]*\$?[ \t]*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_RESULT = re.compile(r"(=[ \t]*\$?[ \t]*)(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?![\d.,]*\d)")
_STANDALONE = re.compile(r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|[.,]\d)")
_OPERATORS = set("+-*/x×÷=–−")
_NOTE = re.compile(r"<<([^<>]*)=([^<>=]*)>>(\s*\$?\s*)(-?[\d,]*\.?\d+)?")


def final_answer(solution: str) -> str | None:
    """The solution's final answer: the number after its last ``####`` (GSM8K), else after its last
    "The answer is" (arithmetic word problems), else its last ``\\boxed{}`` content (MATH); None when
    it has none of them."""
    from opsd.grading import extract_boxed

    hashes = _HASHES.findall(solution) or _ANSWER_IS.findall(solution)
    if hashes:
        return hashes[-1]
    boxed = extract_boxed(solution)
    return boxed.strip() if boxed and boxed.strip() else None


def _as_number(text: str) -> float | None:
    text = text.strip().strip("$").strip()
    if not _NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def _plus_one(text: str) -> str:
    """``text`` (a number as written) + 1, with as many decimals and its thousands separators."""
    bare = text.strip().strip("$").strip()
    decimals = len(bare.split(".", 1)[1]) if "." in bare else 0
    value = float(bare.replace(",", "")) + 1
    return f"{value:{',' if ',' in bare else ''}.{decimals}f}"


def wrong_value(answer: str, alternatives: Iterable[str] = ()) -> str | None:
    """The wrong value that replaces ``answer``: N + 1 for a number, else the first alternative that
    differs from it; None when there is none."""
    if _as_number(answer) is not None:
        return _plus_one(answer)
    key = "".join(answer.split())
    return next((a for a in alternatives if "".join(a.split()) != key), None)


def wrong_answer_solution(solution: str, alternatives: Iterable[str] = ()) -> str | None:
    """``solution`` with every occurrence of its final answer (:func:`final_answer`) replaced by
    :func:`wrong_value`; None when it has no detectable final answer (the row is then refused)."""
    answer = final_answer(solution)
    if answer is None:
        return None
    wrong = wrong_value(answer, alternatives)
    if wrong is None:
        return None
    number = _as_number(answer)

    def same(text: str) -> bool:
        if number is not None:
            return _as_number(text) == number
        return "".join(text.split()) == "".join(answer.split())

    out = _HASHES.sub(lambda m: m.group(0)[: m.start(1) - m.start(0)] + wrong, solution)
    out = _ANSWER_IS.sub(lambda m: m.group(0)[: m.start(1) - m.start(0)] + wrong, out)
    out = _replace_boxed(out, same, wrong)
    lines = out.split("\n")
    worked = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("####")]
    if worked:  # the last worked line's calculator note: <<48+24=72>>72
        i = worked[-1]
        notes = [m for m in _NOTE.finditer(lines[i]) if same(m.group(2))]
        if notes:
            m = notes[-1]
            tail = "" if m.group(4) is None else (wrong if same(m.group(4)) else m.group(4))
            expr = wrong if same(m.group(1)) else m.group(1)  # <<24=24>>24: the expression is N
            new = f"<<{expr}={wrong}>>{m.group(3)}{tail}"
            lines[i] = lines[i][: m.start()] + new + lines[i][m.end() :]
        # ... and a result written without a note: "20/4 = $5"
        lines[i] = _RESULT.sub(lambda m: m.group(1) + (wrong if same(m.group(2)) else m.group(2)), lines[i])
        lines[i] = _prose(lines[i], same, wrong)
    out = "\n".join(lines)
    return out if out != solution else None


def _prose(line: str, same, wrong: str) -> str:
    """The answer stated in words on the last worked line ("He eats 48 pieces because ..."): every
    standalone number equal to it, outside calculator notes and not an operand (next to + - * / x)."""
    parts = re.split(r"(<<[^<>]*>>)", line)
    for k in range(0, len(parts), 2):  # the even parts lie outside the notes
        text = parts[k]

        def swap(m: re.Match, text: str = text) -> str:
            before, after = text[: m.start()].rstrip()[-1:], text[m.end() :].lstrip()[:1]
            operand = before in _OPERATORS or after in _OPERATORS
            return wrong if same(m.group(0)) and not operand else m.group(0)

        parts[k] = _STANDALONE.sub(swap, text)
    return "".join(parts)


def _replace_boxed(text: str, same, wrong: str) -> str:
    r"""Every ``\boxed{X}`` whose X is the final answer, as ``\boxed{wrong}`` (nested braces kept)."""
    out, pos = [], 0
    while True:
        start = text.find("\\boxed{", pos)
        if start < 0:
            break
        i, depth = start + len("\\boxed"), 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
        else:
            break
        content = text[i + 1 : j]
        out.append(text[pos : i + 1] + (wrong if same(content) else content) + "}")
        pos = j + 1
    return "".join(out) + text[pos:]


def apply_solution_source(examples: list[Example], source: str) -> tuple[list[Example], int]:
    """The examples with the solution the teacher reads under ``teacher.solution_source`` and the number
    of rows refused (``wrong_answer``: rows without a detectable final answer; ``other``: every row when
    all of them have the same solution)."""
    if source == "own" or not examples:
        return examples, 0
    if source == "other":  # control B: each problem with the nearest following different solution
        nearest = _nearest_different([_text(ex.solution) for ex in examples])
        if nearest is None:
            return [], len(examples)
        return [replace(ex, solution=examples[j].solution) for ex, j in zip(examples, nearest)], 0
    if source != "wrong_answer":
        raise ValueError(f"unknown solution source {source!r}; expected one of {SOLUTION_SOURCES}")
    finals = [final_answer(ex.solution) for ex in examples]
    kept = []
    for i, ex in enumerate(examples):
        following = (finals[(i + j) % len(finals)] for j in range(1, len(finals)))
        wrong = wrong_answer_solution(ex.solution, (f for f in following if f is not None))
        if wrong is not None:
            kept.append(replace(ex, solution=wrong))
    return kept, len(examples) - len(kept)


def _text(solution: str) -> str:
    """A solution as compared with another: whitespace runs count as one space."""
    return " ".join(solution.split())


def _nearest_different(texts: list[str]) -> list[int] | None:
    """Per row, the index of the nearest following row (wrapping around) whose text differs from its own;
    None when every row has the same text. One pass backwards around the circle: a row whose successor
    has its text takes the successor's answer."""
    n = len(texts)
    start = next((i for i in range(n) if texts[i] != texts[(i + 1) % n]), None)
    if start is None:
        return None
    nearest = [0] * n
    nearest[start] = (start + 1) % n
    for k in range(1, n):
        i = (start - k) % n
        after = (i + 1) % n
        nearest[i] = after if texts[after] != texts[i] else nearest[after]
    return nearest


def shared_text_rows(examples: list[Example]) -> int:
    """How many rows share their solution with at least one other row: where control B would often have
    read the row's own text had it taken the next row's."""
    counts = Counter(_text(ex.solution) for ex in examples)
    return sum(c for c in counts.values() if c > 1)


def shared_text_note(examples: list[Example], path: str) -> str:
    """The stderr line saying how many rows of ``path`` share their solution, and what control B reads."""
    return (
        f"data: {shared_text_rows(examples)} of {len(examples)} rows of {path} share their solution with "
        "another row; control B reads the nearest following row whose solution differs"
    )


def require_other_solution(examples: list[Example], path: str) -> None:
    """Control B needs two different solutions: refused in one line naming ``path`` where every row has
    the same one (the teacher would read the row's own text, and the control would not be one)."""
    if examples and len({_text(ex.solution) for ex in examples}) < 2:
        raise UserError(
            f"{path}: teacher.solution_source=other: every row has the same solution, so control B has "
            "nothing else to read"
        )


def boxed_target(solution: str) -> str:
    """A GSM8K worked solution as an SFT target in the student's answer format: the calculator notes
    (``<<48/2=24>>``) removed and the closing ``#### N`` written as ``The final answer is \\boxed{N}.``;
    a solution without ``####`` (MATH, already boxed) is returned unchanged."""
    if not _HASHES.search(solution):
        return solution
    text = re.sub(r"<<[^<>]*>>", "", solution)
    body, _, tail = text.rpartition("####")
    answer = _HASHES.match("####" + tail).group(1).replace(",", "")
    return f"{body.rstrip()}\nThe final answer is \\boxed{{{answer}}}."
