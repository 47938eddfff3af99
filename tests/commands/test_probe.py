"""`opsd probe` on the tiny model: every figure it promises, its verdict rules, and one-line errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from functools import partial

import pytest
from helpers import ROOT, WritingEngine, build_assets

from opsd import probe
from opsd.cli import main
from opsd.compare import paired_interval
from opsd.errors import UserError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    a = build_assets(root)
    rows = [
        {
            "problem": f"What is {x} + 3?",
            "solution": f"{x} + 3 = {x + 3}. The answer is {x + 3}.",
            "answer": str(x + 3),
        }
        for x in range(6)
    ]
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return a | {"heldout": str(root / "heldout.jsonl")}


def _overrides(assets, *more: str) -> list[str]:
    return [
        f"model.path={assets['model']}",
        f"data.path={assets['data']}",
        "model.lora.r=4",
        "model.lora.alpha=8",
        "model.dtype=float32",
        "rollout.engine=hf",
        "rollout.temperature=1.0",
        "rollout.max_new_tokens=5",
        "data.max_prompt_len=256",
        f"eval.path={assets['heldout']}",
        "eval.max_new_tokens=5",
        "eval.grader=last_number",
        "loss.clip_mode=entry",
        "loss.clip=0.05",
        *more,
    ]


def test_the_probe_measures_everything_and_saves_its_verdict(assets, tmp_path, capsys):
    out = tmp_path / "probe"
    res = probe.run_probe(None, _overrides(assets), out, limit=4, progress=False)
    saved = json.loads((out / "probe.json").read_text())
    assert saved["verdict"] == res["verdict"] in ("go", "no-go") and saved["reasons"]
    assert saved["problems"] == 4
    for key in ("student", "sampled", "ceiling", "ceiling_other", "ceiling_wrong_answer"):
        a = saved[key]
        assert 0 <= a["accuracy"] <= 1 and 0 <= a["truncated"] <= 1 and 1 <= a["resp_len"] <= 5
    mean, lo, hi = saved["headroom"]
    assert lo <= mean <= hi
    t = saved["tokens"]
    assert t["tokens"] >= 4  # one sampled response a problem, at least one token each
    for key in ("top1_differs", "overlap_mass", "clip_removed", "steps_away"):
        assert 0 <= t[key] <= 1, key
    assert t["divergence"] >= 0 and math.isfinite(t["divergence"])
    assert t["solution_ratio"] > 0 and math.isfinite(t["solution_ratio"])  # the two prompts differ
    assert 0 <= t["solution_top1_differs"] <= 1
    ref = saved["reference_end"]
    assert 0 < ref["teacher"] < 1 and 0 < ref["student"] < 1
    assert "clip_mode=entry" in saved["settings"]["loss"]
    phases = saved["phase_seconds"]
    assert list(phases) == ["setup", "student", "ceilings", "sampled", "token_stats", "reference_end"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= saved["seconds"] + 0.1
    captured = capsys.readouterr()
    printed = captured.out
    assert "teacher ceiling" in printed and f"verdict: {saved['verdict']}" in printed
    # How many rows share their solution with another: none here, every held-out row has its own.
    assert f"data: 0 of 4 rows of {assets['heldout']} share their solution with another row" in captured.err


def test_the_controls_answer_fewer_problems_and_the_greedy_answers_stop_at_their_answer(
    assets, tmp_path, capsys, monkeypatch
):
    """An engine that writes a correct answer and goes on: the greedy answers stop after it, the sampled
    ones do not, and the cut changes no grade; the controls' ceilings answer the first 2 problems."""
    write = partial(
        WritingEngine, write=lambda a, b: f"{a} + {b} = {a + b}. The answer is {a + b}. So 1, 2, 3."
    )
    monkeypatch.setattr("opsd.setup.make_engine", write)
    lengths = ["eval.max_new_tokens=48", "rollout.max_new_tokens=48", "eval.grader=answer_is"]
    overrides = _overrides(assets, *lengths)
    out = tmp_path / "probe"
    probe.run_probe(None, overrides, out, limit=4, progress=False, control_limit=2)
    saved = json.loads((out / "probe.json").read_text())
    assert saved["settings"]["control_problems"] == 2
    for key, n in (("student", 4), ("sampled", 4), ("ceiling", 4), ("ceiling_other", 2)):
        a = saved[key]
        lo, hi = a["interval"]
        assert a["problems"] == n and lo <= a["accuracy"] == 1.0 <= hi, key
    assert saved["ceiling_wrong_answer"]["problems"] <= 2
    for key in ("student", "ceiling", "ceiling_other"):
        assert saved[key]["cut"] == 1.0 and saved[key]["truncated"] == 0.0, key
    assert saved["sampled"]["cut"] == 0.0
    assert saved["cut"]["sampled"] == {"responses": 4, "stopped": 4, "changed": 0}
    assert saved["student"]["resp_len"] < saved["sampled"]["resp_len"]
    captured = capsys.readouterr()
    assert "probe: answer cut on the greedy answers: answer_is:" in captured.err
    assert "greedy answers stopped once their first answer was complete" in captured.out
    assert "| ceiling, another problem's solution | 2 | 100.0% [" in captured.out

    whole = probe.run_probe(None, overrides, tmp_path / "whole", limit=4, progress=False, cut=False)
    assert whole["cut"] is None and whole["student"]["cut"] == 0.0
    assert whole["student"]["resp_len"] == whole["sampled"]["resp_len"] > saved["student"]["resp_len"]
    assert "no answer cut (--no-cut)" in capsys.readouterr().err


def test_the_control_limit_is_checked_before_anything_loads(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    assert main(["probe", "--config", str(config), "--control-limit", "0"]) == 2
    assert "--control-limit 0" in capsys.readouterr().err


def _figures(student=0.05, ceiling=0.9, ceiling_trunc=0.2, sampled_trunc=0.3, other=0.05, ratio=2.0, cut=0.0):
    n = 100
    s = [i < student * n for i in range(n)]
    c = [i < ceiling * n for i in range(n)]
    return {
        "problems": n,
        "settings": {"rollout_temperature": 0.7},
        "student": {"accuracy": student, "truncated": 0.3},
        "sampled": {"accuracy": student, "truncated": sampled_trunc},
        "ceiling": {"accuracy": ceiling, "truncated": ceiling_trunc, "cut": cut},
        "ceiling_other": {"accuracy": other, "truncated": 0.3},
        "headroom": paired_interval(c, s),
        "tokens": {"steps_away": 0.0, "end_teacher": 0.5, "end_student": 0.6, "solution_ratio": ratio},
    }


@pytest.mark.parametrize(
    "figures, verdict, reason",
    [
        (_figures(), "go", "headroom +85.0%"),
        (
            _figures(student=0.0, ceiling=0.0),
            "no-go",
            "with the solution in its prompt the model scores 0.0%",
        ),
        (_figures(ceiling_trunc=0.8), "no-go", "the teacher rarely stops: 20%"),
        (_figures(sampled_trunc=0.9), "no-go", "90% of the student's rollouts run to rollout.max_new_tokens"),
        (_figures(other=0.9), "go", "another problem's solution gives the teacher 90.0%"),
        (_figures(ratio=0.3), "go", "departs from OPSD's by 0.30 of OPSD's own size"),
        (_figures(cut=0.5), "go", "whether the teacher stops is open: 30% of its answers ended"),
        (_figures(ceiling_trunc=0.6, cut=0.3), "no-go", "the teacher rarely stops: 40%"),
    ],
)
def test_the_verdict_names_its_reason(figures, verdict, reason):
    got, reasons = probe.verdict(figures)
    assert got == verdict
    assert any(reason in r for r in reasons), reasons


def test_the_headroom_interval_is_paired():
    # d = [1, 0, 0, -1]: mean 0, sample variance 2/3, half-width 1.96 sqrt(2/3 / 4) (float64, exact to ~u)
    mean, lo, hi = paired_interval([True, True, False, False], [False, True, False, True])
    assert mean == 0 and hi == pytest.approx(1.96 * math.sqrt(2 / 3 / 4), rel=1e-12) and lo == -hi
    with pytest.raises(ValueError):
        paired_interval([], [])


@pytest.mark.parametrize(
    "more, message",
    [
        (["data.solution_key=null"], "needs data.solution_key"),
        (["eval.path=null"], "needs eval.path"),
        (["eval.rows=[50,60]"], "selects no rows"),
    ],
)
def test_bad_input_is_one_line(assets, tmp_path, more, message):
    with pytest.raises(UserError, match=message):
        probe.run_probe(None, _overrides(assets, *more), tmp_path / "p", limit=2, progress=False)


def test_rows_without_solutions_or_answers_are_one_line(assets, tmp_path, capsys):
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"problem": "What is 1 + 1?", "solution": "", "answer": "2"}) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    argv = ["probe", "--config", str(config), "--out", str(tmp_path / "p"), "--limit", "1"]
    assert main([*argv, *_overrides(assets, f"eval.path={bare}")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "have no 'solution'" in err[0]
    unanswered = tmp_path / "unanswered.jsonl"
    unanswered.write_text(json.dumps({"problem": "What is 1 + 1?", "solution": "1 + 1 = 2."}) + "\n")
    assert main([*argv, *_overrides(assets, f"eval.path={unanswered}")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "answer" in err[0]
    assert main([*argv[:-1], "0", *_overrides(assets)]) == 2
    assert "--limit 0" in capsys.readouterr().err


def test_control_b_is_left_out_where_every_row_shares_one_solution(assets, tmp_path, capsys):
    """Questions on one text: control B's teacher would read the row's own, so it is not measured."""
    shared = tmp_path / "shared.jsonl"
    solution = "Ana was born in 1984 and works as a pilot."
    rows = [
        {"problem": q, "solution": solution, "answer": a} for q, a in (("Year?", "1984"), ("Job?", "pilot"))
    ]
    shared.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = probe.run_probe(
        None, _overrides(assets, f"eval.path={shared}"), tmp_path / "p", limit=2, progress=False
    )
    assert res["ceiling_other"] is None and res["tokens"]["solution_ratio"] is None
    assert res["ceiling"] is not None
    assert f"data: 2 of 2 rows of {shared} share their solution with another row" in capsys.readouterr().err


@pytest.mark.parametrize("mode, away", [("entry", 1), ("token", 0), ("scale", 0), ("none", 0)])
def test_the_clip_effect_finds_the_token_entry_turns_away(mode, away):
    """The counter-example of docs/configuration.md: teacher [0.6, 0.3, 0.1], student [0.2, 0.4, 0.4]."""
    import torch

    from opsd.loss import DistillSpec, per_token_loss_dense

    zs = torch.tensor([[0.2, 0.4, 0.4]], dtype=torch.float64).log()
    zt = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64).log()
    spec = DistillSpec(clip_mode=mode, clip=0.05 if mode != "none" else 0.0)
    raw_spec = DistillSpec()
    raw = per_token_loss_dense(zs, zt, spec=raw_spec)
    removed, stepped_away = probe._clip_effect(zs, zt, raw, spec, raw_spec)
    assert stepped_away == away
    assert (removed > 0) == (mode != "none")


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_the_solution_signal_measures_control_bs_step_against_opsds(temperature):
    """Two teachers alike depart by 0; a control B teacher at the student's distribution departs by the
    teacher's whole distance from the student (the ratio 1); the top-1 count is the teachers' own.
    Float64 sums of 5 x 11 probabilities: rounding far below 1e-12."""
    import torch

    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    same, pull, none = probe.solution_signal(zs, zt, zt.clone(), temperature)
    assert abs(same) < 1e-12 and none == 0 and pull > 0
    apart, pull2, split = probe.solution_signal(zs, zt, zs, temperature)
    assert apart == pytest.approx(pull2, rel=1e-12) and pull2 == pull
    p, s_ = (zt / temperature).softmax(-1), (zs / temperature).softmax(-1)
    assert pull == pytest.approx((p - s_).abs().sum().item(), rel=1e-12)
    assert split == int((zt.argmax(-1) != zs.argmax(-1)).sum())


@pytest.mark.parametrize("mode", ["sampled", "topk"])
def test_the_probe_runs_under_every_loss_mode(assets, tmp_path, mode):
    more = [f"loss.mode={mode}", "loss.clip_mode=none", *(["loss.topk=4"] if mode == "topk" else [])]
    res = probe.run_probe(None, _overrides(assets, *more), tmp_path / "p", limit=3, progress=False)
    t = res["tokens"]
    assert t["tokens"] >= 3 and math.isfinite(t["divergence"]) and math.isfinite(t["solution_ratio"])


def test_the_bench_script_parses_its_arguments_and_renders_a_probe(assets, tmp_path):
    """bench/probe_speed.py times the real probe (not here: SmolLM2 on arith); its flags and its table,
    on a tiny probe's figures, run here."""
    root = ROOT
    script = root / "bench" / "probe_speed.py"
    helped = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=root)
    assert helped.returncode == 0 and "--control-limit" in helped.stdout and "--whole" in helped.stdout
    overrides = _overrides(assets, "eval.grader=answer_is")  # the HF engine checking each token's text
    res = probe.run_probe(None, overrides, tmp_path / "p", limit=2, progress=False, control_limit=1)
    assert res["cut"]["sampled"]["responses"] == 2
    res.update(name="cut", command="opsd probe", wall_s=12.0, load_before=0.1, load_after=0.9, engine="hf")
    (tmp_path / "run.json").write_text(json.dumps(res))
    render = (
        "import json, sys; sys.path.insert(0, 'bench'); import probe_speed; "
        f"print(probe_speed.render([json.load(open({str(tmp_path / 'run.json')!r}))], 'today'))"
    )
    shown = subprocess.run([sys.executable, "-c", render], capture_output=True, text=True, cwd=root)
    assert shown.returncode == 0, shown.stderr[-2000:]
    row = next(line for line in shown.stdout.splitlines() if line.startswith("| cut |"))
    assert "0 min 12 s (met)" in row and " of 1 |" in row and row.endswith(f"| {res['verdict']} |")
