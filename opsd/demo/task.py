"""The demo's task: d-digit column addition with worked solutions, disjoint seeded splits, exact grading.

The student sees ``437+285=`` and writes the columns units first, each column's total with the carry
included, then the answer: ``12 12 07 so 0722``. The worked solution is both the response format and
the privileged information the teacher reads. Rows use the schema `opsd train` reads (problem,
solution, answer). Pure Python: no model or tokenizer here.
"""

from __future__ import annotations

import random
import re

from opsd.grading import Grade

# How the teacher's prompt holds the privileged information (a `data.teacher_template`).
TEACHER_TEMPLATE = "{problem}\nWorked: {solution}"
_FINAL = re.compile(r"(?:^|\s)so ([0-9]+)$")


def answer_text(a: int, b: int, digits: int) -> str:
    """The sum with ``digits + 1`` digits (leading zero kept): every answer has the same width."""
    return f"{a + b:0{digits + 1}d}"


def worked_solution(a: int, b: int, digits: int) -> str:
    """Column addition, units first: each column's total (carry in included) as two digits, then the answer.

    ``437+285`` -> ``"12 12 07 so 0722"``.
    """
    da, db = f"{a:0{digits}d}"[::-1], f"{b:0{digits}d}"[::-1]
    totals, carry = [], 0
    for x, y in zip(da, db):
        t = int(x) + int(y) + carry
        totals.append(f"{t:02d}")
        carry = t // 10
    return " ".join(totals) + f" so {answer_text(a, b, digits)}"


def max_response_tokens(digits: int) -> int:
    """Generation budget for a ``digits``-digit problem with the character-level tokenizer: the worked
    solution, its stop token, and one token more, so an over-long response is graded wrong rather than
    cut to a correct-looking one."""
    lo = 10 ** (digits - 1)
    return len(worked_solution(lo, lo, digits)) + 2


def make_row(a: int, b: int, digits: int) -> dict:
    """One row in the schema `opsd train` reads: problem (student), solution (privileged), answer."""
    return {
        "problem": f"{a}+{b}=",
        "solution": worked_solution(a, b, digits),
        "answer": answer_text(a, b, digits),
    }


def operands(row: dict) -> tuple[int, int]:
    a, b = row["problem"].rstrip("=").split("+")
    return int(a), int(b)


def make_rows(n: int, seed: int, digits: int, exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """``n`` distinct problems of two ``digits``-digit numbers, none in ``exclude``; fixed by ``seed``."""
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    excluded = sum(1 for a, b in (exclude or ()) if lo <= a <= hi and lo <= b <= hi)
    free = (hi - lo + 1) ** 2 - excluded
    if n > free:
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems: only {free} are left")
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows = []
    while len(rows) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append(make_row(a, b, digits))
    return rows


def make_splits(seed: int, digits: int, n_sft: int, n_train: int, n_heldout: int) -> dict[str, list[dict]]:
    """Disjoint sets: ``sft`` builds the base model, ``train`` is OPSD's, ``heldout`` is only scored."""
    out: dict[str, list[dict]] = {}
    used: set[tuple[int, int]] = set()
    for k, (name, n) in enumerate((("heldout", n_heldout), ("train", n_train), ("sft", n_sft))):
        out[name] = make_rows(n, seed * 3 + k + 1, digits, exclude=used)
        used |= {operands(r) for r in out[name]}
    return out


def final_digits(response: str | None) -> str | None:
    """The digits after the last ``so `` that ends the response, or None if it does not end that way."""
    if not isinstance(response, str):
        return None
    m = _FINAL.search(response.strip())
    return m.group(1) if m else None


def grade_digits(response: str | None, answer: str) -> Grade:
    """Exact match of the final answer (fixed width, leading zero included); the working is not graded.

    An `opsd.grading.Grader`, so `opsd eval`'s loop (and later a reward) can use it.
    """
    got = final_digits(response)
    return Grade(correct=got is not None and got == str(answer).strip(), extracted=got, error=None)
