"""Guards against a run going bad (opsd.guard): the repetition metric, each guard's logic, and a
synthetic collapse on the tiny trainer (a scripted engine whose responses shrink step after step, a
scripted held-out accuracy) that each guard stops, while a healthy run is never stopped; the best
checkpoint survives keep_last=1 and a resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from helpers import build_assets, make_cfg

from opsd import Trainer
from opsd.checkpoint import list_checkpoints
from opsd.cli import main
from opsd.config import GuardConfig
from opsd.guard import StopRules
from opsd.metrics import repetition
from opsd.records import read_best, read_stops, write_best
from opsd.report import run_marks
from opsd.rollout import Completion, HFEngine
from opsd.rundir import GracefulStop, StopReason


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("guard_assets"))


# --- the repetition metric ----------------------------------------------------------------------


def test_repetition_is_the_share_of_repeated_4grams():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0.0  # 3 distinct 4-grams of 3
    assert repetition([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 4 / 5)  # (1,2,3,4) twice of 5
    assert repetition([7] * 10) == pytest.approx(1 - 1 / 7)  # one 4-gram, 7 times
    assert repetition([7, 8, 7, 8, 7, 8]) == pytest.approx(1 / 3)  # (7,8,7,8) twice of 3
    assert repetition([1, 2, 3]) is None and repetition([]) is None  # no 4-gram to count
    assert repetition([1, 1, 1], n=2) == pytest.approx(1 / 2)


# --- the guards' logic on records -----------------------------------------------------------------


def _guard(tmp_path, **cfg) -> StopRules:
    return StopRules(GuardConfig(**cfg), metric="eval/avg@1", run_dir=tmp_path)


def _rec(step, length=100.0, truncated=0.0, acc=None) -> dict:
    rec = {"step": step, "resp_len_mean": length, "truncated_frac": truncated}
    return rec | ({"eval/avg@1": acc} if acc is not None else {})


def test_length_guard_compares_a_trailing_mean_with_the_first_steps(tmp_path):
    g = _guard(tmp_path, min_length_ratio=0.5, window=3)
    # Steps 1-3 average 100; the trailing 3-step mean falls: (100+100+40)/3 = 80, (100+40+40)/3 = 60,
    # (40+40+40)/3 = 40 < 0.5 * 100.
    fired = [g.observe(_rec(s, n)) for s, n in enumerate([90, 100, 110, 40, 40, 40], start=1)]
    assert fired[:5] == [None] * 5
    f = fired[5]
    assert f.guard == "guard.min_length_ratio" and f.step == 6 and f.limit == 0.5
    assert f.value == pytest.approx(0.4)
    assert "mean response length 40.0 over steps 4-6 is 0.400 of its 100.0 over steps 1-3" in f.detail


def test_no_guard_checks_before_its_window(tmp_path):
    g = _guard(tmp_path, min_length_ratio=0.9, max_truncation=0.1, window=4)
    # At step 4 the trailing window is the baseline (ratio 1); the truncation mean is 1.0 > 0.1.
    assert [g.observe(_rec(s, 10.0 * s, truncated=1.0)) for s in (1, 2, 3)] == [None] * 3
    assert g.observe(_rec(4, 40.0, truncated=1.0)).guard == "guard.max_truncation"


def test_truncation_guard_fires_above_its_limit_only(tmp_path):
    g = _guard(tmp_path, max_truncation=0.5, window=2)
    # Means over 2 steps: 0.25, 0.5 (not above 0.5), 0.75.
    fired = [g.observe(_rec(s, truncated=t)) for s, t in enumerate([0.0, 0.5, 0.5, 1.0], start=1)]
    assert fired[:3] == [None, None, None]
    assert fired[3].guard == "guard.max_truncation" and fired[3].value == pytest.approx(0.75)
    assert "0.750 of the responses over steps 3-4 were cut at rollout.max_new_tokens" in fired[3].detail


def test_accuracy_guard_measures_the_drop_from_the_best_evaluation(tmp_path):
    g = _guard(tmp_path, max_accuracy_drop=0.1)
    accs = [0.5, None, 0.8, 0.75, None, 0.65]  # every other step has no evaluation
    fired = [g.observe(_rec(s, acc=a)) for s, a in enumerate(accs, start=1)]
    assert fired[:5] == [None] * 5
    f = fired[5]
    assert f.guard == "guard.max_accuracy_drop" and f.step == 6 and f.value == pytest.approx(0.15)
    assert "eval/avg@1 0.650 is 0.150 below its best 0.800 (step 3), more than the limit 0.1" in f.detail


def test_guards_off_and_other_ranks_never_fire(tmp_path):
    off = _guard(tmp_path)
    quiet = StopRules(
        GuardConfig(min_length_ratio=0.9, max_truncation=0.0, window=1),
        metric="eval/avg@1",
        run_dir=tmp_path,
        active=False,
    )
    for s in range(1, 6):
        rec = _rec(s, 100.0 / s, truncated=1.0, acc=1.0 / s)
        assert off.observe(rec) is None and quiet.observe(rec) is None
    stop = GracefulStop()
    assert not quiet.stops(_rec(6, 1.0, truncated=1.0), stop) and stop.requested is None
    stop.requested = StopReason("signal", "SIGTERM")  # a signal still stops every rank
    assert quiet.stops(_rec(7), stop) and stop.requested == StopReason("signal", "SIGTERM")


def test_stop_names_the_guard_and_the_line_the_best_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000003").mkdir()
    (run / "checkpoints" / "step_000003" / "state.pt").write_bytes(b"")
    write_best(run, 2, "eval/avg@1", 0.75, run / "checkpoints" / "step_000002")
    g = StopRules(GuardConfig(max_truncation=0.2, window=1), metric="eval/avg@1", run_dir=run)
    stop = GracefulStop()
    assert g.stops(_rec(3, truncated=0.5), stop) and stop.requested == StopReason("guard", "max_truncation")
    assert str(stop.requested) == "guard.max_truncation"
    assert g.line() == (
        "guard.max_truncation stopped the run after step 3: 0.500 of the responses over steps 3-3 were cut "
        "at rollout.max_new_tokens, above the limit 0.2; best checkpoint: "
        f"{run}/checkpoints/step_000002 (eval/avg@1=0.750 at step 2); resume with: opsd train --resume {run}"
    )


def test_a_stop_reason_is_a_value_whose_words_the_messages_print():
    assert str(StopReason("signal", "SIGTERM")) == "SIGTERM"
    assert str(StopReason("guard", "max_truncation")) == "guard.max_truncation"
    assert str(StopReason("peer")) == "a signal to another rank"
    stop = GracefulStop()
    stop.join_peers()  # another rank asked: this one stops with it
    assert stop.requested == StopReason("peer")
    stop.requested = StopReason("signal", "SIGINT")
    stop.join_peers()  # its own reason stays
    assert stop.requested == StopReason("signal", "SIGINT")


# --- a synthetic collapse on the tiny trainer ---------------------------------------------------------


def collapsing_engine(lengths: list[int]):
    """A rollout engine class whose i-th generate call answers every prompt with ``lengths[i]`` tokens
    (the last length repeats) of a looping phrase 7, 8, 7, 8, ...; a response as long as
    rollout.max_new_tokens is cut ("length"), a shorter one stopped. ``calls`` counts the calls."""
    calls: list[int] = []

    class Collapsing(HFEngine):
        def __init__(self, rollout, model, tokenizer, **kwargs) -> None:
            super().__init__(model, tokenizer)

        def generate(self, prompts, n, params):
            length = lengths[min(len(calls), len(lengths) - 1)]
            calls.append(length)
            toks = [7, 8] * (length // 2) + [7] * (length % 2)
            reason = "length" if length >= params.max_new_tokens else "stop"
            return [
                Completion(i, list(toks), [0.0] * length, reason)
                for i in range(len(prompts))
                for _ in range(n)
            ]

    Collapsing.calls = calls
    return Collapsing


class _ScriptedEvaluation:
    """What ``Trainer.evaluate`` returns, reduced to the one figure the guard reads."""

    def __init__(self, accuracy: float):
        self.accuracy = accuracy

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {f"{prefix}avg@1": self.accuracy}


def _scripted_accuracy(monkeypatch, accs: dict[int, float]) -> None:
    """Held-out accuracy by step instead of an evaluation (the guard reads eval/avg@1)."""
    monkeypatch.setattr(Trainer, "evaluate", lambda self: _ScriptedEvaluation(accs[self.step_num]))


GUARDED = {"checkpoint.keep_last": 1, "optim.max_steps": 8, "logging.sample_every": 0}


def test_length_collapse_stops_the_run_with_one_line_and_exit_0(assets, tmp_path, monkeypatch, capsys):
    """`opsd train` itself: the guard stops after step 5, saves it, prints the line and exits 0."""
    engine = collapsing_engine([6, 6, 6, 2, 1])
    monkeypatch.setattr("opsd.setup.make_engine", engine)
    run = tmp_path / "run"
    cfg = make_cfg(assets, run, **GUARDED, **{"guard.min_length_ratio": 0.5, "guard.window": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    # Steps 1-2 average 6 tokens; the 2-step mean is 4 at step 4 (0.667), then (2 + 1) / 2 = 1.5 (0.25).
    line = (
        "guard.min_length_ratio stopped the run after step 5: mean response length 1.5 over steps 4-5 is "
        "0.250 of its 6.0 over steps 1-2, below the limit 0.5; no best checkpoint recorded (eval.every at "
        f"a saved step); latest: {run}/checkpoints/step_000005; resume with: opsd train --resume {run}"
    )
    assert [x for x in err.splitlines() if "stopped the run" in x] == [line]
    assert engine.calls == [6, 6, 6, 2, 1]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["resp_len_mean"] for s in steps] == [6, 6, 6, 2, 1]
    assert [s["truncated_frac"] for s in steps] == [1, 1, 1, 0, 0]
    # 7, 8, 7, 8, 7, 8: 3 four-grams, 2 distinct; 2 or 1 tokens: no four-gram, 0.
    assert [s["repetition"] for s in steps] == pytest.approx([1 / 3] * 3 + [0.0] * 2)
    assert [c.name for c in list_checkpoints(run)] == ["step_000005"]
    (stop,) = read_stops(run)
    assert stop["guard"] == "guard.min_length_ratio" and stop["step"] == 5 and stop["line"] == line
    assert stop["value"] == pytest.approx(0.25) and stop["limit"] == 0.5


def test_truncation_guard_stops_a_run_running_into_the_limit(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("opsd.setup.make_engine", collapsing_engine([3, 3, 6]))
    tr = Trainer(
        make_cfg(assets, tmp_path / "run", **GUARDED, **{"guard.max_truncation": 0.5, "guard.window": 2})
    )
    hist = tr.train()
    # Truncated share per step 0, 0, 1, 1: the 2-step mean is 0.5 at step 3 (not above), 1.0 at step 4.
    assert [h["truncated_frac"] for h in hist] == [0, 0, 1, 1] and tr.stopped
    err = capsys.readouterr().err
    assert "guard.max_truncation stopped the run after step 4: 1.000 of the responses over steps 3-4" in err


def test_accuracy_drop_stops_and_the_best_checkpoint_survives_rotation_and_resume(
    assets, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr("opsd.setup.make_engine", collapsing_engine([3]))
    _scripted_accuracy(monkeypatch, {1: 0.5, 2: 0.75, 3: 0.6, 4: 0.5, 5: 0.5, 6: 0.9, 7: 0.7, 8: 0.8})
    run = tmp_path / "run"
    over = GUARDED | {"eval.path": assets["data"], "eval.every": 1, "guard.max_accuracy_drop": 0.2}
    tr = Trainer(make_cfg(assets, run, **over))
    hist = tr.train()
    # Best 0.75 at step 2; 0.6 is 0.15 below it, 0.5 is 0.25 below: stopped after step 4.
    assert len(hist) == 4 and tr.stopped
    assert [c.name for c in list_checkpoints(run)] == ["step_000002", "step_000004"]  # keep_last=1 + best
    assert read_best(run) == {"step": 2, "metric": "eval/avg@1", "value": 0.75, "checkpoint": "step_000002"}
    best = f"best checkpoint: {run}/checkpoints/step_000002 (eval/avg@1=0.750 at step 2)"
    err = capsys.readouterr().err
    assert (
        "guard.max_accuracy_drop stopped the run after step 4: eval/avg@1 0.500 is 0.250 below its best "
        f"0.750 (step 2), more than the limit 0.2; {best}; resume with: opsd train --resume {run}"
    ) in err
    marks, lines = run_marks(run)
    assert marks == {"best checkpoint (step 2)": 2.0, "guard.max_accuracy_drop stop (step 4)": 4.0}
    assert any("step_000002" in x for x in lines)

    # Resumed with the guard on: the best (0.75) is read back from metrics.jsonl, so 0.5 at step 5 stops.
    tr = Trainer(make_cfg(assets, run, **over), resume=True)
    assert len(tr.train()) == 1 and tr.step_num == 5
    assert "after step 5: eval/avg@1 0.500 is 0.250 below its best 0.750 (step 2)" in capsys.readouterr().err
    assert [c.name for c in list_checkpoints(run)] == ["step_000002", "step_000005"]
    assert [s["step"] for s in read_stops(run)] == [4, 5]

    # Resumed without it: step 6 (0.9) becomes the best and the old best is pruned; step 7 keeps it.
    tr = Trainer(make_cfg(assets, run, **over | {"guard.max_accuracy_drop": "null"}), resume=True)
    assert len(tr.train()) == 3 and not tr.stopped
    assert [c.name for c in list_checkpoints(run)] == ["step_000006", "step_000008"]
    assert read_best(run)["step"] == 6 and read_best(run)["value"] == 0.9


def test_a_healthy_run_is_never_stopped(assets, tmp_path, monkeypatch, capsys):
    """Every guard on, a run whose length, truncation and accuracy move within their limits."""
    engine = collapsing_engine([6, 5, 6, 4, 6, 5, 6, 4])  # 2-step means >= 5.0, of 5.5 at first
    monkeypatch.setattr("opsd.setup.make_engine", engine)
    _scripted_accuracy(
        monkeypatch, {s: a for s, a in enumerate([0.5, 0.6, 0.55, 0.7, 0.6, 0.65, 0.7, 0.6], 1)}
    )
    over = GUARDED | {"eval.path": assets["data"], "eval.every": 1}
    over |= {"guard.max_accuracy_drop": 0.15, "guard.min_length_ratio": 0.7, "guard.max_truncation": 0.75}
    tr = Trainer(make_cfg(assets, tmp_path / "run", **over | {"guard.window": 2}))
    assert len(tr.train()) == 8 and not tr.stopped and tr.step_num == 8
    assert "stopped" not in capsys.readouterr().err
    assert read_stops(tmp_path / "run") == []
    assert read_best(tmp_path / "run")["step"] == 4  # 0.7 first reached at step 4, not replaced by a tie
    names = [c.name for c in list_checkpoints(tmp_path / "run")]
    assert names == ["step_000004", "step_000008"]


def test_guard_config_is_refused_with_one_line():
    from opsd.config import load_config
    from opsd.errors import UserError

    with pytest.raises(UserError, match=r"guard\.max_accuracy_drop needs eval\.every > 0"):
        load_config(None, ["data.path=x.jsonl", "guard.max_accuracy_drop=0.1"])
    with pytest.raises(UserError, match=r"guard\.min_length_ratio: Input should be less than 1"):
        load_config(None, ["data.path=x.jsonl", "guard.min_length_ratio=1.5"])
    assert SimpleNamespace(**GuardConfig().model_dump()) == SimpleNamespace(
        max_accuracy_drop=None, min_length_ratio=None, max_truncation=None, window=3
    )
