"""Subprocesses that end with opsd: started, forwarded signals, waited for, and swept.

Why: a child started with ``subprocess.call`` outlives its parent when the parent is stopped. SIGTERM
ends the parent at once (Python's default action), and the child, a vLLM API server holding a port and
gigabytes of KV cache, keeps running under init; SIGINT from a terminal reaches the whole foreground
group only if nobody moved the child out of it. So every subprocess opsd starts runs through
:func:`run_owned`:

* the child leads its own process group, so a signal reaches it exactly once, from opsd;
* while opsd waits, SIGTERM, SIGINT and SIGHUP are forwarded to that group (vLLM's API server and its
  engine core shut down as they do on a terminal's Ctrl-C), then opsd waits for the child and returns
  its exit status (``128 + N`` for a child ended by signal ``N``, as a shell reports it);
* on Linux the child gets SIGTERM if opsd dies without forwarding (SIGKILL, a crash):
  ``prctl(PR_SET_PDEATHSIG)``;
* when the child has ended, whatever it left in its group (an engine core its parent did not reap)
  is killed, and a timeout ends the whole group: SIGTERM, then SIGKILL after ``grace_s``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 30.0  # after a timeout's SIGTERM, before SIGKILL: vLLM's shutdown takes a few seconds
_PR_SET_PDEATHSIG = 1


def exit_status(returncode: int) -> int:
    """A shell's exit status for ``Popen.returncode``: ``-N`` (ended by signal N) is ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_owned(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd)`` as the leader of its own process group, tied to this process's life."""
    linux = sys.platform.startswith("linux")
    return subprocess.Popen(
        list(cmd), start_new_session=True, preexec_fn=_die_with_parent if linux else None, **popen_kwargs
    )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to every process in ``proc``'s group (its leader included); nothing if none is left."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def forwarding(proc: subprocess.Popen, signals: Sequence[int] = FORWARDED) -> Iterator[list[int]]:
    """While the block runs, each of ``signals`` that reaches this process goes to ``proc``'s group
    instead; yields the list of signals forwarded. Only the main thread can install handlers: elsewhere
    nothing is installed (the main thread's own handlers stand)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum: int, frame) -> None:
        received.append(signum)
        signal_group(proc, signum)

    old = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@dataclass
class Finished:
    """A child's end: its exit status (shell convention), its output when captured, and whether opsd
    ended it for running past its timeout."""

    status: int
    stdout: str | None = None
    stderr: str | None = None
    timed_out: bool = False


def run_owned(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    capture: bool = False,
    grace_s: float = GRACE_S,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    **popen_kwargs,
) -> Finished:
    """Runs ``cmd`` to its end as a child opsd owns (the module docstring says what that means).

    ``capture``: its stdout and stderr as text; ``timeout_s``: past it the group gets SIGTERM, then
    SIGKILL after ``grace_s``, and ``timed_out`` is set. ``on_start`` sees the child once it runs."""
    if capture:
        popen_kwargs |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = start_owned(cmd, env=None if env is None else dict(env), **popen_kwargs)
    timed_out = False
    try:
        with forwarding(proc):
            if on_start is not None:
                on_start(proc)
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                out, err = _stop(proc, grace_s)
    except BaseException:  # opsd itself is failing: the child must not outlive it
        _stop(proc, grace_s)
        raise
    finally:
        signal_group(proc, signal.SIGKILL)  # whatever the child left behind in its group
    return Finished(exit_status(proc.returncode), out, err, timed_out)


def _stop(proc: subprocess.Popen, grace_s: float) -> tuple[str | None, str | None]:
    """SIGTERM to the child's group, SIGKILL after ``grace_s``; returns what it still wrote."""
    signal_group(proc, signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        return proc.communicate()
