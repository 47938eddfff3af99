"""Rollouts reused across steps (``rollout.reuse``, after Semi-OPD): the student generates the rollouts
of several steps at once and the steps in between read theirs back, so generation, about half of a
step on a CPU, runs once per refresh instead of once per step.

At a refresh step s the engine, holding the weights of step s, generates the rollouts of every step
in [s, s + refresh_every): each for the problems that step draws anyway and with that step's own seed
(:meth:`~opsd.rollout.queue.RolloutQueue.sampling`), so data order and seeds are those of a run without
reuse, and ``refresh_every=1`` is exactly that run (the prompts of the steps ahead are built at the
refresh, so ``prompt_truncated_*`` counts a cut prompt then rather than at its own step). ``inf``
generates every step's rollouts at step 0: only step 0 sees the initial student, since the engine
keeps following the live weights (the HF engine shares the trainer's model, and held-out evaluation
generates on the engine too), so generating in chunks later would sample from a trained student.

``replay`` trains the steps after a refresh again on the refresh step's own problems and responses
(K optimizer steps on one batch, as PPO's epochs): generation and the problems drawn drop K-fold, and
the data cursor draws at refresh steps only. The batch being replayed is kept with each checkpoint (as
``rollout.overlap``'s batch requested ahead), so a resume mid-batch finishes it exactly, even where a
sampling setting changed; a resume on another number of ranks, or without one, refreshes at once. Its
refresh step's file serves a resume at that very step.

Each step's rollouts are one file, ``<run_dir>/rollouts/step_000123-rank0.jsonl``: a header (the
problems, the student prompt ids, ``n`` and the sampling settings, seed included) and one line per
response with its token ids and log-probs, which JSON carries exactly. A step reads its file only
where the header matches what it would generate, and refreshes where none matches: a resume trains on
the very rollouts the interrupted run stored, and one that changed a sampling setting generates anew.
A file is written under a temporary name and renamed, so a crash never leaves half of one.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from opsd import distributed
from opsd.rollout.base import Completion, batch_from_state, batch_state

if TYPE_CHECKING:
    from opsd.config import Config


class QueueView(Protocol):
    """What the cache reads from :class:`opsd.rollout.queue.RolloutQueue`, which imports this module:
    its rollout settings, engine, data cursor and CPU plan, and the draw, sampling, generation and call it
    makes."""

    cfg: Any
    engine: Any
    cursor: Any
    plan: Any

    def call(self, fn: Callable) -> Any: ...

    def draw(self, cursor: Any = None) -> tuple[list[int], list]: ...

    def sampling(self, step: int) -> Any: ...

    def generate(self, prompts: list[list[int]], *, step: int) -> list[Completion]: ...


REUSE_DIR = "rollouts"  # under logging.run_dir


@dataclass
class ReplayBatch:
    """``replay``'s batch: the problems, prompt pairs and responses of the step that generated them."""

    example_indices: list[int]
    prompts: list[tuple[list[int], list[int]]]
    completions: list[Completion]
    generated_at: int


class RolloutReuse:
    """The rollout cache of one rank: which steps refresh, their files, and the step's metrics.

    ``refresh_every``: steps per refresh, or ``"inf"`` (one refresh, at step 0); ``below``: the
    agreement under which a reused step makes the next one refresh (``refresh_below_agreement``)."""

    def __init__(
        self,
        refresh_every: int | str,
        below: float | None,
        run_dir: Path,
        rank: int,
        max_steps: int,
        *,
        replay: bool = False,
    ) -> None:
        self.refresh_every = refresh_every
        self.below = below
        self.replay = replay  # the steps in between train on the refresh step's own batch
        self.batch: ReplayBatch | None = None  # replay: the batch being replayed
        self.dir = Path(run_dir) / REUSE_DIR
        self.rank = rank
        self.max_steps = max_steps
        self.reused = False  # the last step read its rollouts from the cache
        self.generated_tokens = 0  # response tokens this rank generated in the last step

    @classmethod
    def from_config(cls, cfg: Config, rank: int) -> RolloutReuse | None:
        """The cache ``cfg.rollout.reuse`` asks for (None: off); rank 0 names it on stderr at startup."""
        r = cfg.rollout.reuse
        if r.refresh_every is None:
            return None
        reuse = cls(
            r.refresh_every,
            r.refresh_below_agreement,
            cfg.logging.run_dir,
            rank,
            cfg.optim.max_steps,
            replay=r.replay,
        )
        if rank == 0:
            print(f"rollout reuse: {reuse.describe()}", file=sys.stderr)
        return reuse

    def describe(self) -> str:
        """The setting in words, for the startup lines."""
        k = self.refresh_every
        if k == "inf":
            what = "the initial student's rollouts for every step, generated at step 0"
        elif k == 1:
            what = "fresh rollouts every step (refresh_every=1)"
        elif self.replay:
            what = f"one batch generated every {k} steps and trained on for {k} steps (replay)"
        else:
            what = f"rollouts generated every {k} steps and reused in between"
        early = f"; early when agreement < {self.below}" if self.below is not None else ""
        return f"{what}{early} (stored in {self.dir})"

    # ------------------------------------------------------------------------------------------
    # The step's rollouts

    def rollouts(self, queue: QueueView, step: int) -> tuple[list[int], list, list[Completion], float]:
        """``step``'s problems (example indices and prompt pairs), their responses and the responses' age
        in optimizer steps: read from the cache, or from a refresh where any rank has none stored."""
        self.generated_tokens = 0
        if self.replay:
            return self.replayed(queue, step)
        ex_idx, prompts, key, stored = self.drawn(queue, step)
        if stored is None:
            return ex_idx, prompts, queue.call(lambda: self.refresh(queue, step, key)), 0.0
        completions, generated_at = stored
        if not distributed.any_rank(generated_at != step):  # a resume at a refresh its run had stored
            self.reused = False  # reported as that refresh, on every rank
            self.generated_tokens = self.tokens_generated_at(step)
        return ex_idx, prompts, completions, float(step - generated_at)

    def drawn(self, queue: QueueView, step: int) -> tuple[list[int], list, dict, Any]:
        """Draw ``step``'s problems, and the rollouts stored for exactly them at ``step`` (by a refresh,
        or by a resumed run) where every rank has its own; sets ``reused``."""
        ex_idx, prompts = queue.draw()
        key = self.key(queue, step, ex_idx, prompts)
        stored = self.read(step, key)
        self.reused = not distributed.any_rank(stored is None)
        return ex_idx, prompts, key, stored if self.reused else None

    def replayed(self, queue: QueueView, step: int) -> tuple[list[int], list, list[Completion], float]:
        """``replay``: the batch being replayed, until K steps after the one that generated it; then (or
        where any rank has none) the step draws its problems and generates them, or reads them where an
        interrupted run stored them at this step. A refresh reports its tokens either way, as a run
        without the interruption does."""
        b = self.batch
        due = b is None or step - b.generated_at >= self.refresh_every
        self.reused = not distributed.any_rank(due)
        if self.reused:
            return b.example_indices, b.prompts, b.completions, float(step - b.generated_at)
        ex_idx, prompts, key, stored = self.drawn(queue, step)
        self.reused = False
        if stored is not None:
            completions = stored[0]
        else:
            completions = queue.call(lambda: queue.generate(key["prompts"], step=step))
            self.dir.mkdir(parents=True, exist_ok=True)
            self.write(step, key, completions, generated_at=step)
        self.generated_tokens = sum(len(c.token_ids) for c in completions)
        self.batch = ReplayBatch(ex_idx, prompts, completions, step)
        return ex_idx, prompts, completions, 0.0

    def state_dict(self) -> dict | None:
        """The batch being replayed, in types a weights-only load accepts (None: nothing to replay)."""
        b = self.batch
        if b is None:
            return None
        return batch_state(b.example_indices, b.prompts, b.completions) | {"generated_at": b.generated_at}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's replayed batch; none on any rank (another number of ranks) drops it on all."""
        self.batch = None
        if state:
            self.batch = ReplayBatch(*batch_from_state(state), state["generated_at"])
        if distributed.any_rank(self.batch is None):
            self.batch = None

    def refresh(self, queue: QueueView, step: int, key: dict) -> list[Completion]:
        """Generate and store the rollouts of the steps from ``step`` to the next refresh, each for the
        problems a copy of the data cursor draws for it; return ``step``'s. The engine wakes once and
        generates once per step: it takes one seed per call, and each step keeps its own."""
        ahead = copy.deepcopy(queue.cursor)  # the live cursor draws each step's problems when it runs
        self.dir.mkdir(parents=True, exist_ok=True)
        first = None
        queue.engine.wake()
        try:
            for t in range(step, self.span_end(step)):
                if t > step:
                    key = self.key(queue, t, *queue.draw(ahead))
                completions = queue.engine.generate(key["prompts"], queue.cfg.n, queue.sampling(t))
                self.write(t, key, completions, generated_at=step)
                self.generated_tokens += sum(len(c.token_ids) for c in completions)
                first = completions if first is None else first
        finally:
            queue.engine.sleep()
        queue.plan.after_generation()
        return first

    def span_end(self, step: int) -> int:
        """The step after the last one whose rollouts a refresh at ``step`` generates."""
        k = self.refresh_every
        end = self.max_steps if k == "inf" else min(step + k, self.max_steps)
        return max(end, step + 1)

    def key(self, queue: QueueView, step: int, ex_idx: list[int], prompts: list) -> dict[str, Any]:
        """What ``step`` generates from, as JSON reads it back: a stored file is used only where its
        header equals this (the problems, the student prompts, ``n``, the sampling settings and seed)."""
        key = {
            "step": step,
            "example_indices": ex_idx,
            "prompts": [list(s) for s, _ in prompts],
            "n": queue.cfg.n,
            "sampling": asdict(queue.sampling(step)),
        }
        return json.loads(json.dumps(key))

    # ------------------------------------------------------------------------------------------
    # The files

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}-rank{self.rank}.jsonl"

    def write(self, step: int, key: dict, completions: list[Completion], *, generated_at: int) -> None:
        """``step``'s rollouts, written whole or not at all (a temporary file, synced, then renamed)."""
        path = self.path(step)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(key | {"generated_at": generated_at}) + "\n")
            for c in completions:
                f.write(json.dumps(c.row()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read(self, step: int, key: dict) -> tuple[list[Completion], int] | None:
        """``step``'s stored rollouts and the step that generated them, or None where none match ``key``."""
        path = self.path(step)
        if not path.is_file():
            return None
        lines = path.read_text(encoding="utf-8").splitlines()
        head = json.loads(lines[0])
        generated_at = head.pop("generated_at")
        if head != key:
            return None
        rows = [json.loads(line) for line in lines[1:]]
        return [Completion.from_row(r) for r in rows], generated_at

    def tokens_generated_at(self, step: int) -> int:
        """The response tokens this rank's stored files of the steps a refresh at ``step`` covers hold
        from it: what that refresh generated, reported again by a resume that reads them instead."""
        total = 0
        for t in range(step, self.span_end(step)):
            path = self.path(t)
            if not path.is_file():
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
            if json.loads(lines[0])["generated_at"] == step:
                total += sum(len(Completion.from_row(json.loads(line)).token_ids) for line in lines[1:])
        return total

    def drop_from(self, step: int) -> None:
        """Forget the stored rollouts of ``step`` and later (an early refresh), lowest first, so that an
        interrupted drop leaves only later steps stored, which a replay drops again."""
        stored = sorted(self.dir.glob(f"step_*-rank{self.rank}.jsonl"))
        for path in stored:
            if int(path.name[5:11]) >= step:
                path.unlink()

    # ------------------------------------------------------------------------------------------
    # The step's metrics

    def observe(self, rec: dict) -> dict[str, int]:
        """The step's reuse metrics over all ranks (every rank calls it), given its record ``rec``;
        with ``refresh_below_agreement``, a reused step whose agreement is below it drops the stored
        rollouts of the steps after it, so that the next step refreshes (on a resume too)."""
        if self.reused and self.below is not None and rec["agreement"] < self.below:
            self.drop_from(rec["step"])  # rec["step"] counts from 1: the next step's index
        tokens = torch.tensor([float(self.generated_tokens)], dtype=torch.float64)
        total = int(distributed.all_reduce_sum(tokens).item())
        return {"rollout/generated_tokens": total, "rollout/reused": int(self.reused)}
