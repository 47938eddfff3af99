"""The tree's prose speaks of the software, not of how it was made.

Comments (read with ``tokenize``), docstrings (read with ``ast``) and Markdown in README.md, docs/,
opsd/, bench/ and tests/ must not name a work period or a tracker ticket: the patterns are in
``PATTERNS``. Code is not prose: pytest's ``scope=...`` argument or a variable with such a name is
neither a comment nor a docstring, so it is not read.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from helpers import ROOT

PLACES = ("README.md", "docs", "opsd", "bench", "tests")
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
PATTERNS = (
    re.compile(r"\b(session|sitting)s?\b", re.IGNORECASE),
    re.compile(r"\bissue [0-9]+", re.IGNORECASE),
)


def _bad(text: str) -> bool:
    return any(p.search(text) for p in PATTERNS)


def comment_lines(source: str) -> list[tuple[int, str]]:
    """(line, text) of every ``#`` comment in Python source."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def docstring_lines(source: str) -> list[tuple[int, str]]:
    """(line, text) of every line of every module, class and function docstring."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            continue
        value = body[0].value.value
        if isinstance(value, str):
            out += [(body[0].lineno + i, line) for i, line in enumerate(value.splitlines())]
    return out


def prose_hits(path: Path, text: str) -> list[str]:
    """``file:line: text`` for each prose line of one file that matches a pattern."""
    if path.suffix == ".py":
        lines = comment_lines(text) + docstring_lines(text)
    elif path.suffix == ".md":
        lines = list(enumerate(text.splitlines(), start=1))
    else:
        return []
    return [f"{path}:{n}: {line.strip()}" for n, line in sorted(set(lines)) if _bad(line)]


def prose_files() -> list[Path]:
    files = []
    for place in PLACES:
        path = ROOT / place
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in sorted(path.rglob("*"))
                if p.suffix in (".py", ".md") and p.is_file() and not SKIP_DIRS & set(p.parts)
            ]
    return files


def test_the_prose_names_no_work_period_or_ticket():
    hits = []
    for path in prose_files():
        hits += prose_hits(path.relative_to(ROOT), path.read_text(encoding="utf-8"))
    assert not hits, "prose that speaks of the work, not the software:\n" + "\n".join(hits)


def test_the_scanner_reads_every_place():
    names = {p.relative_to(ROOT).parts[0] for p in prose_files()}
    assert {"README.md", "docs", "opsd", "bench", "tests"} <= names


PLANTED_PY = '''"""A module."""
import pytest


@pytest.fixture(scope="session")
def model(session):
    """Built once."""
    session = 1  # the fourth SITTING measured this
    return session


def f():
    """Moved here in
    Issue 12."""
'''


def test_the_scanner_catches_planted_prose_and_ignores_code():
    hits = prose_hits(Path("x.py"), PLANTED_PY)
    assert [h.split(":")[1] for h in hits] == ["8", "14"], hits
    md = "# Title\n\nPlain text.\n\nMeasured in the third Session.\n"
    assert [h.split(":")[1] for h in prose_hits(Path("x.md"), md)] == ["5"]
    assert prose_hits(Path("x.py"), 'X = "issue 5"\n@pytest.fixture(scope="session")\ndef g(): pass\n') == []
    assert not _bad("an issue with 5 rows") and not _bad("sessional") and _bad("Sessions")
