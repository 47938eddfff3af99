"""The order of examples: a resumable, rank-sharded cursor over the training rows.

Every rank draws the same seeded permutation per epoch and takes its own slice of each global
batch, so the examples a run sees depend on the seed and the global batch only, and a checkpoint's
``state_dict`` resumes the order exactly (at the same number of ranks or another).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd.errors import UserError

if TYPE_CHECKING:
    import numpy as np


class DataCursor:
    """Deterministic shuffled epochs with a seed, sharded by rank, exactly resumable.

    Epoch e uses the permutation numpy.random.default_rng([seed, e]).permutation(num_examples), so
    order depends only on (seed, epoch). The cursor walks one global stream of indices: each call draws
    the next k * world_size indices (crossing epoch boundaries seamlessly) and rank r keeps the
    contiguous slice [r*k, (r+1)*k). Every rank's cursor therefore holds the same state, so the state
    of any rank resumes all of them, even under a different world_size.
    Ranks are disjoint within a global batch unless that batch crosses an epoch boundary or is larger
    than the dataset (then an example can appear once per epoch it spans).
    """

    def __init__(
        self, num_examples: int, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True
    ):
        if num_examples <= 0:
            raise ValueError(f"num_examples must be > 0, got {num_examples}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        self.num_examples = num_examples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0  # epoch of the next index to be drawn
        self._pos = 0  # position of the next index within this epoch's permutation
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            import numpy as np  # here, so that importing opsd.data stays light

            n = self.num_examples
            self._perm = (
                np.random.default_rng([self.seed, self.epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
        return self._perm

    def next_indices(self, k: int) -> list[int]:
        if k <= 0:
            raise ValueError(f"k must be > 0, got {k}")
        need = k * self.world_size
        drawn: list[int] = []
        while len(drawn) < need:
            take = min(need - len(drawn), self.num_examples - self._pos)
            drawn.extend(self._permutation()[self._pos : self._pos + take].tolist())
            self._pos += take
            if self._pos == self.num_examples:
                self.epoch, self._pos, self._perm = self.epoch + 1, 0, None
        return drawn[self.rank * k : (self.rank + 1) * k]

    def state_dict(self) -> dict:
        return {
            "num_examples": self.num_examples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self._pos,
        }

    def load_state_dict(self, s: dict) -> None:
        missing = {"num_examples", "seed", "shuffle", "epoch", "position"} - set(s)
        if missing:
            raise ValueError(f"cursor state is missing keys {sorted(missing)}; got {sorted(s)}")
        if s["num_examples"] != self.num_examples:
            raise UserError(
                f"cursor state is for {s['num_examples']} examples but this dataset has {self.num_examples}; "
                "the data changed since the checkpoint"
            )
        if not 0 <= s["position"] < self.num_examples:
            raise ValueError(f"cursor state position {s['position']} is outside [0, {self.num_examples})")
        self.seed, self.shuffle = int(s["seed"]), bool(s["shuffle"])
        self.epoch, self._pos, self._perm = int(s["epoch"]), int(s["position"]), None
