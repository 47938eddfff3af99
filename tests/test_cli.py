"""The command line's own behaviour: version, help, every registered subcommand builds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opsd import __version__
from opsd.cli import COMMANDS, build_parser, main


def test_version_and_help_without_heavy_imports():
    code = "import sys, opsd.cli; opsd.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    res = subprocess.run([sys.executable, "-m", "opsd.cli", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and __version__ in res.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_subcommand_builds_and_has_help(name, capsys):
    parser = build_parser(name)
    with pytest.raises(SystemExit) as e:
        parser.parse_args([name, "--help"])
    assert e.value.code == 0
    assert "usage: opsd " + name in capsys.readouterr().out
