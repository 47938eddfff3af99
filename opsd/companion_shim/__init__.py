"""Not imported by opsd: a directory that :mod:`opsd.companions` prepends to ``PYTHONPATH`` for the
`opsd` command's subprocesses, so that its ``sitecustomize`` runs at their start. A package only so
that it ships with opsd."""
