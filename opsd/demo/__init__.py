"""`opsd demo`: OPSD shown end to end on a synthetic task, on a CPU, in minutes (docs/demo.md).

``task``: the problems, worked solutions and grader (pure Python). ``base``: the cached tiny base model.
``run``: one seed's run (base model, OPSD with held-out evaluations, report) and the CLI.
"""
