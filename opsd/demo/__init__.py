"""`opsd demo`: OPSD shown end to end on a synthetic task, on a CPU, in under a minute (docs/demo.md).

``task``: the problems, worked solutions and grader (pure Python). ``base``: the tiny base model,
shipped for seeds 0-2 (``bases/``), otherwise trained and cached. ``run``: one seed's run (base model,
OPSD with held-out evaluations, report). ``compare``: `--compare`. ``cli``: the command line.
"""
