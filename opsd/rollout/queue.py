"""What each step trains on: the problems drawn, their responses, and the batch requested ahead.

With ``rollout.overlap`` the next step's responses are requested before this step trains, so the
servers sample them meanwhile; they are collected before the weights move (one step of policy lag)
and saved with a checkpoint, so a resume trains on what the run would have. With ``rollout.reuse``
the responses of several steps are generated at once and stored in the run directory
(:mod:`opsd.rollout.reuse`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opsd import distributed
from opsd.cpu import CpuPlan
from opsd.data.sampler import DataCursor
from opsd.data.solutions import Solutions
from opsd.errors import EngineError
from opsd.rollout.base import Completion, RolloutEngine, SamplingParams, batch_from_state, batch_state
from opsd.rollout.reuse import RolloutReuse


@dataclass
class Pending:
    """Rollouts requested one step ahead: the problems, and the engine's handle until collected."""

    example_indices: list[int]
    prompts: list[tuple[list[int], list[int]]]
    handle: Any = None
    completions: list[Completion] | None = None


class RolloutQueue:
    """Draws each step's problems from ``cursor``, builds their prompt pairs with ``prompts`` and asks
    ``engine`` for ``rollout.n`` responses each, seeded by step and rank (``dist``); ``plan``: the CPU
    plan, whose :meth:`~opsd.cpu.CpuPlan.after_generation` runs once each generation is over."""

    def __init__(
        self,
        cfg,
        engine: RolloutEngine,
        cursor,
        prompts: Callable,
        examples: list,
        dist: distributed.Dist,
        *,
        plan: CpuPlan | None = None,
    ) -> None:
        self.cfg = cfg.rollout
        self.engine = engine
        self.cursor = cursor
        self.prompts = prompts
        self.examples = examples
        self.per_rank = cfg.rollout.prompts_per_rank(dist.world_size)
        self.seed = cfg.seed
        self.rank = dist.rank
        self.max_steps = cfg.optim.max_steps
        self.plan = plan or CpuPlan()
        self.pending: Pending | None = None  # rollout.overlap: the next step's rollouts, in flight
        self.reuse = RolloutReuse.from_config(cfg, dist.rank)  # rollout.reuse: the stored rollouts

    def next(self, step: int, timer) -> tuple[list[int], list, list[Completion], float]:
        """``step``'s problems (example indices and prompt pairs), their responses, and the responses'
        policy lag (optimizer steps between the weights that sampled them and the ones they train)."""
        # (A batch restored from an overlapping run's checkpoint is used even with overlap off.)
        if self.pending is None and self.reuse is not None:  # stored by an earlier step, or generated now
            with timer("rollout"):
                return self.reuse.rollouts(self, step)
        if not self.cfg.overlap and self.pending is None:
            ex_idx, prompts = self.draw()
            with timer("rollout"):
                completions = self.call(lambda: self.generate([s for s, _ in prompts], step=step))
            return ex_idx, prompts, completions, 0.0
        pending, lag = self.pending, 1.0
        if pending is None:  # the first step, or a resume without one: nothing was requested ahead
            pending, lag = self.request(step), 0.0
        with timer("rollout"):
            completions = self.call(lambda: self.collect(pending))
        ahead = self.cfg.overlap and step + 1 < self.max_steps
        self.pending = self.request(step + 1) if ahead else None
        return pending.example_indices, pending.prompts, completions, lag

    def call(self, fn: Callable):
        """``fn()`` on every rank, agreeing on its outcome: an engine failing on one rank (a server
        down) stops every rank with its message, not only that one while the others wait."""
        try:
            result, err = fn(), None
        except EngineError as e:
            result, err = None, e
        found = distributed.first_error(err)
        if found is not None:
            raise err if err is not None else EngineError(f"rank {found[0]}: {found[1]}")
        return result

    def draw(self, cursor: DataCursor | None = None) -> tuple[list[int], list]:
        """The next step's problems from ``cursor`` (the live one by default) and their prompt pairs."""
        ex_idx = (cursor or self.cursor).next_indices(self.per_rank)
        return ex_idx, [self.prompts(i, self.examples[i]) for i in ex_idx]

    def request(self, step: int) -> Pending:
        """Draw ``step``'s problems and ask the engine for their responses without waiting."""
        ex_idx, prompts = self.draw()
        handle = self.engine.submit([s for s, _ in prompts], self.cfg.n, self.sampling(step))
        return Pending(ex_idx, prompts, handle)

    def collect(self, pending: Pending) -> list[Completion]:
        if pending.completions is None:
            pending.completions = self.engine.collect(pending.handle)
            pending.handle = None
        return pending.completions

    def observe(self, rec: dict) -> dict:
        """The step's ``rollout.reuse`` metrics (none without it), given its record ``rec``."""
        return self.reuse.observe(rec) if self.reuse is not None else {}

    def settle(self) -> None:
        """Every rollout requested ahead is sampled before the weights move."""
        if self.pending is not None:
            pending = self.pending
            self.call(lambda: self.collect(pending))

    def generate(self, prompts: list[list[int]], *, step: int, n: int | None = None) -> list[Completion]:
        """``rollout.n`` (or ``n``) responses per prompt, seeded by ``step`` and rank: a resume samples
        what a run would have."""
        self.engine.wake()
        completions = self.engine.generate(prompts, n or self.cfg.n, self.sampling(step))
        self.engine.sleep()
        self.plan.after_generation()
        return completions

    def sampling(self, step: int) -> SamplingParams:
        """``step``'s sampling settings, seeded by step and rank, at its horizon (:func:`horizon_tokens`)."""
        seed = (distributed.rank_seed(self.seed, self.rank) * 1_000_003 + step * 7919) % 2**63
        params = SamplingParams.from_rollout(self.cfg, seed)
        if self.cfg.horizon is not None:
            params.max_new_tokens = horizon_tokens(self.cfg.horizon, step)
        return params

    def state_dict(self) -> dict | None:
        """The rollouts requested ahead, collected, and ``rollout.reuse.replay``'s batch (key ``replay``),
        in types a weights-only load accepts: regenerating them on resume would need earlier weights."""
        state = {}
        if self.pending is not None:
            done = self.collect(self.pending)
            state = batch_state(self.pending.example_indices, self.pending.prompts, done)
        replay = self.reuse.state_dict() if self.reuse is not None else None
        if replay is not None:
            state["replay"] = replay
        return state or None

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's pending batch and replayed batch; one missing on any rank (another number of
        ranks) is dropped on all."""
        state = state or {}
        self.pending = None
        if "completions" in state:
            ex_idx, prompts, completions = batch_from_state(state)
            self.pending = Pending(ex_idx, prompts, None, completions)
        if distributed.any_rank(self.pending is None):
            self.pending = None
        if self.reuse is not None:
            self.reuse.load_state_dict(state.get("replay"))


def horizon_tokens(horizon: dict[str, int], step: int) -> int:
    """``rollout.horizon``'s token limit at ``step``: ``start`` at step 0, growing linearly to ``end`` at
    step ``over_steps``, ``end`` after."""
    start, end, over = horizon["start"], horizon["end"], horizon["over_steps"]
    return round(start + (end - start) * min(1.0, step / over))


class SolutionQueue(RolloutQueue):
    """``objective: sft``'s queue: each step's problems drawn from the cursor as for rollouts
    (``rollout.prompts_per_step`` a step, the run's data order, resumable), with each one's reference
    solution and end token as its one response. Nothing is generated for training; the engine
    serves the held-out evaluation only."""

    def __init__(self, solutions: Solutions, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.solutions = solutions

    def next(self, step: int, timer) -> tuple[list[int], list, list[Completion], float]:
        """``step``'s problems, their prompt pairs (the student prompt twice: no teacher reads them)
        and their solutions as completions, a cut one marked ``length``; no policy lag. Reading the
        solutions is this objective's rollout, timed as one."""
        with timer("rollout"):
            ex_idx = self.cursor.next_indices(self.per_rank)
            pairs = [self.solutions.pair(i) for i in ex_idx]
            end = self.solutions.tokenizer.eos_token_id
            completions = [
                Completion(j, list(target), None, "stop" if target[-1] == end else "length")
                for j, (_, target) in enumerate(pairs)
            ]
        return ex_idx, [(prompt, prompt) for prompt, _ in pairs], completions, 0.0
