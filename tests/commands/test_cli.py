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


def test_the_entry_point_stays_light():
    """The console script's start (torch companions looked up in the package metadata) imports neither
    torch nor transformers: `opsd --version` stays instant."""
    code = (
        "import sys\nsys.argv = ['opsd', '--version']\nfrom opsd.cli import entry\n"
        "try:\n    entry()\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["False", "False"]


def test_openmp_waiting_is_set_before_torch_unless_the_user_chose():
    """The command line sets passive waiting after a short spin before torch loads OpenMP; a user's own
    OMP_WAIT_POLICY or GOMP_SPINCOUNT stands, and then the other is not added."""
    import os

    from opsd.cpu.openmp import OPENMP_SPIN, openmp_waiting

    code = (
        "import os, sys, opsd.cli\n"
        "try:\n    opsd.cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split()[-3:] == ["PASSIVE", OPENMP_SPIN, "False"]
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(mine)
        openmp_waiting(env)
        assert env == mine


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
