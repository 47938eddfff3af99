"""data.rows and eval.rows: a slice of a file's rows, so that a dev slice of the training file is
evaluated on and never trained on."""

from __future__ import annotations

import pytest

from opsd.config import load_config
from opsd.data.sources import Example, take_rows
from opsd.errors import UserError


def _examples(n: int) -> list[Example]:
    return [Example(problem=f"p{i}", solution=f"s{i}", answer=str(i), row=i) for i in range(n)]


def test_a_dev_slice_and_the_training_rows_never_share_a_row():
    rows = _examples(10)
    train = take_rows(rows, (0, 8), "data.rows", "f.jsonl")
    dev = take_rows(rows, (8, 10), "eval.rows", "f.jsonl")
    assert [e.row for e in train] == list(range(8)) and [e.row for e in dev] == [8, 9]
    assert take_rows(rows, None, "data.rows", "f.jsonl") is rows
    assert [e.row for e in take_rows(rows, (8, 100), "eval.rows", "f.jsonl")] == [8, 9]  # END past the file


@pytest.mark.parametrize(
    "rows, message",
    [((5, 5), "0 <= START < END"), ((6, 2), "0 <= START < END"), ((10, 20), "selects no rows of f.jsonl")],
)
def test_a_bad_slice_is_one_line_naming_the_key(rows, message):
    with pytest.raises(UserError, match=message) as err:
        take_rows(_examples(10), rows, "eval.rows", "f.jsonl")
    assert "eval.rows" in str(err.value) and "\n" not in str(err.value)


def test_the_keys_take_a_two_number_list_from_the_command_line():
    cfg = load_config(None, ["data.path=x.jsonl", "data.rows=[0,1869]", "eval.rows=[1869,2069]"])
    assert cfg.data.rows == (0, 1869) and cfg.eval.rows == (1869, 2069)
    with pytest.raises(ValueError, match="eval.rows"):
        load_config(None, ["data.path=x.jsonl", "eval.rows=1869"])
