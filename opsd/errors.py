"""The kinds of failure a user sees.

``UserError``: something the user can fix (a config value, a missing file, a bad data row). The CLI
prints its one-line message and exits 2, with no traceback (``--debug`` shows it).
``TrainingError``: training cannot go on (e.g. too many non-finite steps); the last good checkpoint
is intact and the message names it; ``EngineError``, its kind where a rollout engine outside the
process failed.
"""


class UserError(ValueError):
    """A mistake in the user's input, described in one line that names the thing to fix."""


class TrainingError(RuntimeError):
    """Training cannot go on; the last good checkpoint is intact."""


class EngineError(TrainingError):
    """A rollout engine outside this process failed mid-run (a server down, timing out or answering
    with an error); the trainer names the last good checkpoint to resume from."""
