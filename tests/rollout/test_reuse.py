"""rollout.reuse: rollouts generated every K steps for the steps up to the next refresh, stored in the
run directory and read back by the steps in between and by a resume (opsd/rollout/reuse.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import build_assets, make_cfg, spawn

from opsd import Trainer, load_config
from opsd.errors import UserError
from opsd.rollout.base import Completion
from opsd.rollout.reuse import RolloutReuse


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("assets"))


def _watched(tr: Trainer) -> tuple[list, dict]:
    """Record, in order, each engine generate() (the step it ran at, its seed, its responses) and each
    weight sync; and each step's problems and responses as the queue hands them to the trainer."""
    events, steps = [], {}
    generate, sync, next_ = tr.run.engine.generate, tr.run.engine.sync_weights, tr.run.queue.next

    def generated(prompts, n, params):
        out = generate(prompts, n, params)
        events.append(("generate", tr.step_num, params.seed, out))
        return out

    def synced(model):
        events.append(("sync", tr.step_num))
        return sync(model)

    def drawn(step, timer):
        got = next_(step, timer)
        steps[step] = got
        return got

    tr.run.engine.generate, tr.run.engine.sync_weights, tr.run.queue.next = generated, synced, drawn
    return events, steps


def _same(a: list[Completion], b: list[Completion]) -> bool:
    key = [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in a]
    return key == [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in b]


F64 = {"model.dtype": "float64", "optim.max_steps": 6}


@pytest.fixture(scope="module")
def off_run(assets, tmp_path_factory) -> tuple[list, dict]:
    """The run without reuse that the reuse settings are held against: its records, and each step's
    problems and responses as the trainer drew them (only read by the tests)."""
    off = Trainer(make_cfg(assets, tmp_path_factory.mktemp("off") / "off", **F64))
    _, steps = _watched(off)
    return off.train(), steps


def test_refresh_every_1_is_reuse_off(assets, tmp_path, off_run):
    on = Trainer(make_cfg(assets, tmp_path / "on", **F64, **{"rollout.reuse.refresh_every": 1}))
    _, on_steps = _watched(on)
    (a, off_steps), b = off_run, on.train()
    for key in ("loss", "divergence", "grad_norm", "agreement", "resp_len_mean"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for t in range(6):
        assert off_steps[t][0] == on_steps[t][0] and _same(off_steps[t][2], on_steps[t][2])
    assert [r["rollout/reused"] for r in b] == [0] * 6
    made = [sum(len(c.token_ids) for c in on_steps[t][2]) for t in range(6)]
    assert [r["rollout/generated_tokens"] for r in b] == made
    assert "rollout/reused" not in a[0]


def test_refresh_every_4_generates_at_steps_0_and_4_only(assets, tmp_path, off_run):
    off_steps = off_run[1]
    tr = Trainer(make_cfg(assets, tmp_path / "run", **F64, **{"rollout.reuse.refresh_every": 4}))
    events, steps = _watched(tr)
    recs = tr.train()
    calls = [e for e in events if e[0] == "generate"]
    assert [e[1] for e in calls] == [0, 0, 0, 0, 4, 4]
    assert [e[2] for e in calls] == [tr.run.queue.sampling(t).seed for t in range(6)]  # each step's own seed
    for t in range(6):
        assert _same(steps[t][2], calls[t][3]), t  # step t trains on what its refresh generated for it
        assert steps[t][0] == off_steps[t][0]  # the problems of a run without reuse, in its order
    assert [r["rollout/reused"] for r in recs] == [0, 1, 1, 1, 0, 1]
    made = [sum(len(c.token_ids) for e in calls if e[1] == s for c in e[3]) for s in (0, 4)]
    assert [r["rollout/generated_tokens"] for r in recs] == [made[0], 0, 0, 0, made[1], 0]
    stored = sorted(p.name for p in (tmp_path / "run" / "rollouts").iterdir())
    assert stored == [f"step_{t:06d}-rank0.jsonl" for t in range(6)]


def test_refresh_every_inf_generates_everything_before_the_first_update(assets, tmp_path):
    tr = Trainer(make_cfg(assets, tmp_path / "run", **F64, **{"rollout.reuse.refresh_every": "inf"}))
    events, steps = _watched(tr)
    recs = tr.train()
    kinds = [e[0] for e in events]
    assert kinds[:6] == ["generate"] * 6 and "generate" not in kinds[6:]  # the initial student's only
    assert all(e[1] == 0 for e in events[:6])
    assert [r["rollout/reused"] for r in recs] == [0, 1, 1, 1, 1, 1]
    assert all(_same(steps[t][2], events[t][3]) for t in range(6))


def test_resume_reads_the_stored_rollouts_and_trains_as_an_uninterrupted_run(assets, tmp_path):
    over = {**F64, "rollout.reuse.refresh_every": 4, "optim.scheduler": "cosine", "optim.warmup_steps": 2}
    full = Trainer(make_cfg(assets, tmp_path / "a", **over)).train()
    Trainer(make_cfg(assets, tmp_path / "b", **over)).train(until_step=3)
    resumed = Trainer(make_cfg(assets, tmp_path / "b", **over), resume=True)
    events, _ = _watched(resumed)
    rest = resumed.train()
    assert [r["step"] for r in rest] == [4, 5, 6]
    assert [e[1] for e in events if e[0] == "generate"] == [4, 4]  # step 3 read step 0's batch
    for key in ("loss", "divergence", "grad_norm", "rollout/reused", "rollout/generated_tokens"):
        assert [r[key] for r in full[3:]] == [r[key] for r in rest], key
    for t in range(6):
        name = f"rollouts/step_{t:06d}-rank0.jsonl"
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text(), name


def test_a_resume_at_a_refresh_its_run_had_stored_reports_that_refresh(assets, tmp_path):
    """A run that stored step 4's refresh (the rollouts of steps 4 and 5) and stopped before step 4's
    checkpoint resumes at 4 reading them: its records are the uninterrupted run's, a refresh at 4."""
    over = {**F64, "rollout.reuse.refresh_every": 4}
    full = Trainer(make_cfg(assets, tmp_path / "a", **over)).train()
    Trainer(make_cfg(assets, tmp_path / "b", **over)).train(until_step=4)
    for t in (4, 5):
        name = f"step_{t:06d}-rank0.jsonl"
        (tmp_path / "b" / "rollouts" / name).write_bytes((tmp_path / "a" / "rollouts" / name).read_bytes())
    stray = (tmp_path / "a" / "rollouts" / "step_000005-rank0.jsonl").read_bytes()
    (tmp_path / "b" / "rollouts" / "step_000007-rank0.jsonl").write_bytes(stray)  # past the refresh's span
    resumed = Trainer(make_cfg(assets, tmp_path / "b", **over), resume=True)
    events, _ = _watched(resumed)
    rest = resumed.train()
    assert [e for e in events if e[0] == "generate"] == []  # read back, not generated again
    assert [r["rollout/reused"] for r in rest] == [0, 1]
    assert full[4]["rollout/generated_tokens"] > 0
    for key in ("loss", "rollout/reused", "rollout/generated_tokens"):
        assert [r[key] for r in full[4:]] == [r[key] for r in rest], key


def test_a_changed_sampling_setting_is_not_read_from_the_store(assets, tmp_path):
    over = {**F64, "optim.max_steps": 4, "rollout.reuse.refresh_every": 4}
    Trainer(make_cfg(assets, tmp_path / "run", **over)).train(until_step=2)
    resumed = Trainer(make_cfg(assets, tmp_path / "run", **over, **{"rollout.temperature": 0.5}), resume=True)
    events, _ = _watched(resumed)
    recs = resumed.train()
    assert [e[1] for e in events if e[0] == "generate"] == [2, 2]
    assert [r["rollout/reused"] for r in recs] == [0, 1]


def test_low_agreement_on_reused_rollouts_refreshes_early(assets, tmp_path):
    over = {**F64, "optim.max_steps": 5, "rollout.reuse.refresh_every": "inf"}
    over["rollout.reuse.refresh_below_agreement"] = 1.0
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over))
    events, _ = _watched(tr)
    recs = tr.train()
    reused, agree = [r["rollout/reused"] for r in recs], [r["agreement"] for r in recs]
    expect = [0]
    for t in range(4):
        expect.append(0 if reused[t] and agree[t] < 1.0 else 1)
    assert reused == expect and 0 in reused[1:], (reused, agree)
    at = [e[1] for e in events if e[0] == "generate"]
    refreshes = [t for t in range(5) if not reused[t]]
    assert at == [t for t in refreshes for _ in range(t, 5)]  # each refresh covers the rest of the run


REPLAY = {**F64, "rollout.reuse.refresh_every": 3, "rollout.reuse.replay": True}


def test_replay_trains_k_steps_on_each_refresh_batch_and_draws_only_at_refreshes(assets, tmp_path, off_run):
    off_steps = off_run[1]
    tr = Trainer(make_cfg(assets, tmp_path / "run", **REPLAY))
    events, steps = _watched(tr)
    recs = tr.train()
    calls = [e for e in events if e[0] == "generate"]
    assert [e[1] for e in calls] == [0, 3]  # one generation per refresh, for its own step only
    for t in range(6):
        start = t - t % 3
        assert steps[t][0] == steps[start][0] and steps[t][1] == steps[start][1], t
        assert _same(steps[t][2], calls[start // 3][3]), t
    assert steps[0][0] == off_steps[0][0] and steps[3][0] == off_steps[1][0]  # the cursor drew twice
    assert steps[0][0] != steps[3][0]
    assert [r["rollout/reused"] for r in recs] == [0, 1, 1, 0, 1, 1]
    made = [sum(len(c.token_ids) for c in e[3]) for e in calls]
    assert [r["rollout/generated_tokens"] for r in recs] == [made[0], 0, 0, made[1], 0, 0]
    assert [r["loss"] for r in recs[:3]] != [recs[0]["loss"]] * 3  # the weights moved between replays
    stored = sorted(p.name for p in (tmp_path / "run" / "rollouts").iterdir())
    assert stored == ["step_000000-rank0.jsonl", "step_000003-rank0.jsonl"]


@pytest.mark.parametrize("stop", [2, 3])  # mid-batch, and at the next refresh
def test_replay_resumes_as_an_uninterrupted_run(assets, tmp_path, stop):
    full = Trainer(make_cfg(assets, tmp_path / "a", **REPLAY)).train()
    Trainer(make_cfg(assets, tmp_path / "b", **REPLAY)).train(until_step=stop)
    resumed = Trainer(make_cfg(assets, tmp_path / "b", **REPLAY), resume=True)
    events, _ = _watched(resumed)
    rest = resumed.train()
    assert [r["step"] for r in rest] == list(range(stop + 1, 7))
    assert [e[1] for e in events if e[0] == "generate"] == [3]  # step 2 replayed the checkpoint's batch
    for key in (
        "loss",
        "divergence",
        "grad_norm",
        "policy_lag",
        "rollout/reused",
        "rollout/generated_tokens",
    ):
        assert [r[key] for r in full[stop:]] == [r[key] for r in rest], key
    assert [r["policy_lag"] for r in full] == [0, 1, 2, 0, 1, 2]


def test_replay_mid_batch_finishes_the_checkpoint_batch_and_switching_it_on_refreshes(assets, tmp_path):
    Trainer(make_cfg(assets, tmp_path / "a", **REPLAY)).train(until_step=2)
    hotter = Trainer(make_cfg(assets, tmp_path / "a", **REPLAY, **{"rollout.temperature": 0.5}), resume=True)
    events, steps = _watched(hotter)
    recs = hotter.train(until_step=3)  # the batch of step 0, as checkpointed, whatever the temperature now
    assert not [e for e in events if e[0] == "generate"] and recs[0]["rollout/reused"] == 1
    rows = (tmp_path / "a" / "rollouts" / "step_000000-rank0.jsonl").read_text().splitlines()
    assert [c.row() for c in steps[2][2]] == [json.loads(r) for r in rows[1:]]
    stale = {**F64, "rollout.reuse.refresh_every": 3}
    Trainer(make_cfg(assets, tmp_path / "b", **stale)).train(until_step=4)
    switched = Trainer(make_cfg(assets, tmp_path / "b", **REPLAY), resume=True)
    events, steps = _watched(switched)
    recs = switched.train()  # no batch in the checkpoint: step 4 refreshes (its stored rollouts)
    assert [r["rollout/reused"] for r in recs] == [0, 1]
    assert steps[5][0] == steps[4][0] and _same(steps[5][2], steps[4][2])


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["rollout.reuse.refresh_every=inf"],
        ["rollout.reuse.refresh_every=4", "rollout.reuse.refresh_below_agreement=0.5"],
    ],
)
def test_replay_needs_a_finite_refresh_without_early_refresh(extra):
    with pytest.raises(UserError, match="replay=true trains K steps") as e:
        load_config(None, ["data.path=x.jsonl", "rollout.reuse.replay=true", *extra])
    assert "\n" not in str(e.value)


def test_a_failed_write_leaves_no_file_to_read(tmp_path):
    reuse = RolloutReuse(4, None, tmp_path, rank=0, max_steps=8)
    reuse.dir.mkdir()
    with pytest.raises(TypeError):
        reuse.write(3, {"step": 3}, [Completion(0, [1, 2], [object()], "stop")], generated_at=0)  # type: ignore[list-item]
    assert not reuse.path(3).exists() and reuse.read(3, {"step": 3}) is None


@pytest.mark.parametrize("value", ["0", "abc", "-3", "2.5", "true"])
def test_bad_refresh_every_is_one_line_naming_the_key(value):
    with pytest.raises(UserError) as e:
        load_config(None, ["data.path=x.jsonl", f"rollout.reuse.refresh_every={value}"])
    msg = str(e.value)
    assert "\n" not in msg and "rollout.reuse.refresh_every" in msg and ">= 1" in msg and "inf" in msg


def test_reuse_combinations_are_refused():
    with pytest.raises(UserError, match="refresh_below_agreement needs rollout.reuse.refresh_every"):
        load_config(None, ["data.path=x.jsonl", "rollout.reuse.refresh_below_agreement=0.5"])
    over = ["rollout.engine=vllm_server", "rollout.servers=[http://h:1]", "rollout.overlap=1"]
    with pytest.raises(UserError, match="rollout.overlap=0"):
        load_config(None, ["data.path=x.jsonl", "rollout.reuse.refresh_every=4", *over])
    for v in ("inf", ".inf", "4"):
        cfg = load_config(None, ["data.path=x.jsonl", f"rollout.reuse.refresh_every={v}"])
        assert cfg.rollout.reuse.refresh_every == ("inf" if "inf" in v else 4)


@pytest.mark.parametrize("objective", ["grpo", "rlsd"])
def test_policy_gradients_on_reused_rollouts_need_the_importance_weight(objective):
    base = ["data.path=x.jsonl", f"objective={objective}", "rollout.temperature=1.0", "rollout.n=2"]
    for refresh in ("4", "inf"):
        with pytest.raises(UserError, match="needs grpo.tis_cap >= 1") as e:
            load_config(None, [*base, f"rollout.reuse.refresh_every={refresh}", "grpo.tis_cap=0"])
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="needs grpo.tis_cap >= 1"):
        load_config(None, [*base, "rollout.reuse.refresh_every=4", "rollout.top_p=0.9"])
    cfg = load_config(None, [*base, "rollout.reuse.refresh_every=4"])  # the default cap weighs them
    assert cfg.grpo.tis_cap == 2
    off = [*base, "rollout.reuse.refresh_every=1", "grpo.tis_cap=0"]  # 1 is reuse off: nothing is older
    assert load_config(None, off).rollout.reuse.refresh_every == 1


def test_the_startup_line_names_the_setting(assets, tmp_path, capsys):
    Trainer(make_cfg(assets, tmp_path / "run", **{"rollout.reuse.refresh_every": 4}))
    err = capsys.readouterr().err
    assert "rollout reuse: rollouts generated every 4 steps and reused in between" in err


def _two_ranks_worker(d, paths: dict, root: str) -> None:
    over = {"rollout.reuse.refresh_every": 2, "optim.max_steps": 4}
    Trainer(make_cfg(paths, Path(root) / "full", **over), dist=d).train()
    Trainer(make_cfg(paths, Path(root) / "part", **over), dist=d).train(until_step=1)
    Trainer(make_cfg(paths, Path(root) / "part", **over), resume=True, dist=d).train()


@pytest.mark.slow
def test_two_ranks_store_their_own_rollouts_and_agree_when_to_refresh(assets, tmp_path):
    spawn(_two_ranks_worker, assets, str(tmp_path))
    recs = {}
    for name in ("full", "part"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        recs[name] = [json.loads(x) for x in lines]
    full = recs["full"]
    assert [r["rollout/reused"] for r in full] == [0, 1, 0, 1]
    made = []
    for t in range(4):
        files = [tmp_path / "full" / "rollouts" / f"step_{t:06d}-rank{rank}.jsonl" for rank in (0, 1)]
        rows = [json.loads(x) for f in files for x in f.read_text().splitlines()[1:]]
        made.append(sum(len(row[1]) for row in rows))
    # a refresh counts what both ranks generated for the two steps it covers; a reused step nothing
    assert [r["rollout/generated_tokens"] for r in full] == [made[0] + made[1], 0, made[2] + made[3], 0]
    for key in ("loss", "divergence", "rollout/reused", "rollout/generated_tokens"):
        assert [r[key] for r in recs["part"]] == [r[key] for r in full], key
