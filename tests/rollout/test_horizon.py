"""rollout.horizon: the rollouts' token limit grows from start to end over over_steps steps."""

from __future__ import annotations

import pytest
from helpers import build_assets, make_cfg

from opsd.config import load_config
from opsd.rollout.queue import horizon_tokens
from opsd.trainer import Trainer


def test_the_limit_grows_linearly_then_holds():
    h = {"start": 16, "end": 64, "over_steps": 4}
    assert [horizon_tokens(h, s) for s in range(7)] == [16, 28, 40, 52, 64, 64, 64]
    assert horizon_tokens({"start": 8, "end": 8, "over_steps": 1}, 0) == 8


@pytest.mark.parametrize(
    "value, message",
    [
        ("{start: 10, end: 5, over_steps: 2}", "1 <= N <= M"),
        ("{start: 10, end: 20}", "over_steps"),
        ("{start: 10, end: 2000, over_steps: 2}", "exceeds rollout.max_new_tokens"),
    ],
)
def test_a_bad_horizon_is_one_line_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message) as err:
        load_config(None, ["data.path=x.jsonl", f"rollout.horizon={value}"])
    assert "rollout.horizon" in str(err.value)


def test_the_trainer_samples_at_each_steps_horizon(tmp_path):
    assets = build_assets(tmp_path / "assets")
    cfg = make_cfg(
        assets,
        tmp_path / "run",
        **{"rollout.horizon": "{start: 2, end: 6, over_steps: 2}", "checkpoint.enabled": "false"},
    )
    trainer = Trainer(cfg)
    try:
        assert [trainer.run.queue.sampling(s).max_new_tokens for s in (0, 1, 2, 3)] == [2, 4, 6, 6]
        out = trainer.step()  # step 0: at most 2 tokens a response
        assert max(len(c.token_ids) for c in out.completions) <= 2
    finally:
        trainer.close()
