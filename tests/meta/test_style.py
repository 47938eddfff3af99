"""The house style, enforced where CI looks (``.ci/run`` runs the test command, which runs this): ruff's lint
rules with E501 at the declared line length, and ``ruff format``. ruff is pinned in the dev extra
because its formatting changes between releases."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff is in the dev extra: pip install -e '.[dev]'")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_check_passes_with_line_lengths_enforced():
    res = _ruff("check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_leaves_every_file_unchanged():
    res = _ruff("format", "--check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_line_length_is_declared_and_enforced():
    """E501 is on (not ignored) at the length the formatter uses."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert cfg["line-length"] == 110
    assert "E501" not in cfg["lint"].get("ignore", [])
    assert "E" in cfg["lint"]["select"]
