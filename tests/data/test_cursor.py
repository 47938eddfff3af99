"""opsd.data's cursor: deterministic epochs, sharding across ranks and an exact resume."""

from __future__ import annotations

import json

import pytest

from opsd.data import (
    DataCursor,
)

# ---------------------------------------------------------------------------------------------------
# Cursor


def test_cursor_deterministic_and_epochs() -> None:
    a, b = DataCursor(10, seed=3), DataCursor(10, seed=3)
    draws = [a.next_indices(4) for _ in range(5)]  # 20 indices = exactly 2 epochs
    assert draws == [b.next_indices(4) for _ in range(5)]
    flat = [i for d in draws for i in d]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new permutation each epoch
    assert flat[:10] != list(range(10))
    assert a.epoch == 2
    assert DataCursor(10, seed=4).next_indices(10) != flat[:10]
    assert DataCursor(10, seed=3, shuffle=False).next_indices(12) == [*range(10), 0, 1]


def test_cursor_epoch_boundary_is_seamless() -> None:
    c = DataCursor(7, seed=0)
    first = c.next_indices(5)
    second = c.next_indices(5)  # 2 from epoch 0, 3 from epoch 1
    assert c.epoch == 1
    assert sorted(first + second[:2]) == list(range(7))
    whole = DataCursor(7, seed=0).next_indices(10)
    assert whole == first + second


def test_cursor_sharding_disjoint_and_covering() -> None:
    world = 3
    cursors = [DataCursor(24, seed=5, rank=r, world_size=world) for r in range(world)]
    single = DataCursor(24, seed=5)
    for _ in range(2):  # two global batches of 4 * 3 = 12 inside epoch 0
        parts = [c.next_indices(4) for c in cursors]
        assert sum(parts, []) == single.next_indices(12)  # rank r takes slice [r*k, (r+1)*k)
        assert len(set(sum(parts, []))) == 12
    assert all(c.state_dict() == cursors[0].state_dict() for c in cursors)


def test_cursor_exact_resume() -> None:
    c = DataCursor(13, seed=11, rank=1, world_size=2)
    for _ in range(3):
        c.next_indices(4)
    state = json.loads(json.dumps(c.state_dict()))  # survives serialisation
    expected = [c.next_indices(4) for _ in range(5)]
    fresh = DataCursor(13, seed=11, rank=1, world_size=2)
    fresh.load_state_dict(state)
    assert [fresh.next_indices(4) for _ in range(5)] == expected
    assert fresh.epoch == c.epoch


def test_cursor_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_examples"):
        DataCursor(0, seed=0)
    with pytest.raises(ValueError, match="rank"):
        DataCursor(5, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="k must be > 0"):
        DataCursor(5, seed=0).next_indices(0)
    with pytest.raises(ValueError, match="this dataset has 6"):
        DataCursor(6, seed=0).load_state_dict(DataCursor(5, seed=0).state_dict())
