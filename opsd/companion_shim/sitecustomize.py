"""Runs at the start of every Python whose ``PYTHONPATH`` begins with this directory (the `opsd`
command's subprocesses, see :mod:`opsd.companions`): the packages named in ``OPSD_HIDDEN_COMPANIONS``
are made absent (``importlib.util.find_spec`` reports them missing), then the ``sitecustomize`` this
one shadows, if any, runs as it would have. Standard library only: this Python need not have opsd."""

import importlib.machinery
import importlib.util
import os
import sys

for _name in os.environ.get("OPSD_HIDDEN_COMPANIONS", "").split(","):
    if _name and _name not in sys.modules:
        sys.modules[_name] = None


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_run_shadowed()
