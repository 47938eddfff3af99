"""`opsd demo`: the task generator and grader, and a shortened demo against its control."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from demo_small import SMALL, small_demo_settings
from helpers import ROOT

from opsd.cli import main
from opsd.data import RowKeys, load_examples
from opsd.demo import base, compare, task
from opsd.demo import cli as demo_cli
from opsd.demo import run as demo_run
from opsd.errors import UserError
from opsd.grading import Grade
from opsd.metrics import LOSS_STAT_KEYS, StepFigures, step_record

# ----------------------------------------------------------------------------------------------
# Generator


def test_worked_solution_is_column_addition_with_carries():
    assert task.worked_solution(437, 285, 3) == "12 12 07 so 0722"
    assert task.worked_solution(999, 999, 3) == "18 19 19 so 1998"
    assert task.worked_solution(100, 100, 3) == "00 00 02 so 0200"
    assert task.worked_solution(55, 45, 2) == "10 10 so 100"


def test_worked_solution_totals_add_up_for_many_problems():
    for row in task.make_rows(300, seed=5, digits=3):
        a, b = (int(x) for x in row["problem"].rstrip("=").split("+"))
        totals = row["solution"].split(" so ")[0].split()
        carry = 0
        for i, t in enumerate(totals):
            assert int(t) == (a // 10**i) % 10 + (b // 10**i) % 10 + carry
            carry = int(t) // 10
        assert row["answer"] == f"{a + b:04d}"
        assert row["solution"].endswith(" so " + row["answer"])


def test_generator_is_deterministic_and_seeded():
    assert task.make_rows(50, seed=3, digits=3) == task.make_rows(50, seed=3, digits=3)
    assert task.make_rows(50, seed=3, digits=3) != task.make_rows(50, seed=4, digits=3)
    assert task.make_splits(1, 3, 100, 100, 50) == task.make_splits(1, 3, 100, 100, 50)


def test_splits_are_disjoint_and_distinct():
    split = task.make_splits(0, 3, 500, 500, 200)
    problems = {name: [r["problem"] for r in rows] for name, rows in split.items()}
    assert {name: len(p) for name, p in problems.items()} == {"sft": 500, "train": 500, "heldout": 200}
    for p in problems.values():
        assert len(set(p)) == len(p)
    assert not set(problems["heldout"]) & (set(problems["train"]) | set(problems["sft"]))
    assert not set(problems["train"]) & set(problems["sft"])


def test_operands_have_the_requested_width():
    for row in task.make_rows(100, seed=0, digits=2):
        a, b = row["problem"].rstrip("=").split("+")
        assert len(a) == len(b) == 2 and a[0] != "0" and b[0] != "0"


def test_generator_rejects_impossible_requests():
    with pytest.raises(ValueError, match="distinct 1-digit"):
        task.make_rows(82, seed=0, digits=1)  # only 9 * 9 = 81 exist
    with pytest.raises(ValueError, match="digits=0"):
        task.make_rows(1, seed=0, digits=0)


def test_rows_load_with_the_training_data_loader(tmp_path):
    rows = task.make_rows(20, seed=0, digits=3)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = load_examples(str(path), RowKeys(answer="answer"), require_answer=True)
    assert [(e.problem, e.solution, e.answer) for e in rep.examples] == [
        (r["problem"], r["solution"], r["answer"]) for r in rows
    ]


# ----------------------------------------------------------------------------------------------
# Grader


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("12 12 07 so 0722", True),
        ("  12 12 07 so 0722\n", True),
        ("so 0722", True),  # the working is not graded, only the final answer
        ("99 99 99 so 0722", True),
        ("12 12 07 so 0723", False),  # wrong
        ("12 12 07 so 722", False),  # answers are fixed width
        ("12 12 07 so 07220", False),  # one digit too many
        ("12 12 07 so 0722 so", False),  # does not end in the answer
        ("12 12 07 so 0722x", False),
        ("12 12 07 so 07 22", False),
        ("12 12 07 0722", False),  # no final-answer marker
        ("0722", False),
        ("12 12 07 also0722", False),
        ("12 12 07 so -722", False),
        ("", False),
        ("   ", False),
        (None, False),
    ],
)
def test_grade(response, expected):
    assert task.grade_digits(response, "0722").correct is expected


def test_final_digits_take_the_last_one():
    assert task.final_digits("so 0100 so 0722") == "0722"
    assert task.final_digits("no answer here") is None


def test_grade_is_a_grader_for_opsd_eval():
    """The task grader speaks opsd.grading's Grade, so opsd eval's loop counts answers and misses."""
    assert task.grade_digits("12 12 07 so 0722", "0722") == Grade(correct=True, extracted="0722", error=None)
    assert task.grade_digits("12 12 07 so 0723", "0722") == Grade(correct=False, extracted="0723", error=None)
    assert task.grade_digits("no answer", "0722") == Grade(correct=False, extracted=None, error=None)


def test_generation_budget_is_the_solution_plus_stop_plus_one():
    assert task.max_response_tokens(3) == len("12 12 07 so 0722") + 2
    assert task.max_response_tokens(2) == len("10 10 so 100") + 2


def test_demo_accuracy_goes_through_opsd_eval(monkeypatch):
    """The demo's accuracy is opsd.eval.evaluate_model with the task's grader and the demo's prompts."""
    import opsd.eval

    seen = {}

    def spy(model, tok, examples, e, run):
        seen.update(e.model_dump(), examples=examples)
        seen.update(vars(run))  # the run's grader, not the section's name
        return opsd.eval.EvalResult("x", 1, len(examples), 0.25, 0.25, 17.0, 0.0, 0.0, 0, 0, 0.0)

    monkeypatch.setattr(opsd.eval, "evaluate_model", spy)
    tok = base.build_tokenizer()
    rows = task.make_rows(4, seed=0, digits=3)
    assert demo_run.demo_accuracy(None, tok, rows, 3, with_solution=True) == 0.25
    assert seen["grader"] is task.grade_digits and seen["temperature"] == 0.0 and seen["k"] == 1
    assert seen["max_new_tokens"] == task.max_response_tokens(3)
    assert seen["prompts"] == [base.prompt_ids(tok, r, with_solution=True) for r in rows]
    assert [e.answer for e in seen["examples"]] == [r["answer"] for r in rows]


# ----------------------------------------------------------------------------------------------
# The model side: prompts and the cache


def test_prompts_differ_only_by_the_solution():
    tok = base.build_tokenizer()
    row = task.make_row(437, 285, 3)
    student = tok.decode(base.prompt_ids(tok, row, with_solution=False))
    teacher = tok.decode(base.prompt_ids(tok, row, with_solution=True))
    assert "437+285=" in student and row["solution"] not in student
    assert "437+285=" in teacher and f"Worked: {row['solution']}" in teacher
    # character level: every digit of the solution is one token
    assert len(tok.encode(row["solution"], add_special_tokens=False)) == len(row["solution"])


def test_base_key_changes_with_every_base_setting():
    s = base.DemoSettings()
    assert s.base_key() == base.DemoSettings().base_key()
    changes = ({"seed": 1}, {"digits": 2}, {"sft_steps": 10}, {"sft_teacher_frac": 0.3}, {"hidden": 64})
    for change in (*changes, {"sft_schedule": "cosine"}):
        assert base.DemoSettings(**change).base_key() != s.base_key()
    assert base.DemoSettings(opsd_steps=5).base_key() == s.base_key()  # OPSD settings do not rebuild


# ----------------------------------------------------------------------------------------------
# Shipped bases


def _no_training(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("a shipped base was trained instead of loaded")

    monkeypatch.setattr(base, "train_base_model", refuse)


def test_shipped_bases_match_their_hashes_and_load_without_training(tmp_path, monkeypatch):
    _no_training(monkeypatch)
    assert set(base.SHIPPED) >= {0, 1, 2}  # the demo's seed and `--compare --seeds 0,1,2`'s
    for seed, sha in base.SHIPPED.items():
        assert base.file_sha256(base.shipped_path(seed)) == sha
        s = base.DemoSettings(seed=seed)
        assert base.is_shipped(s)
        out = base.build_base_model(s, cache=tmp_path, progress=False)
        info = json.loads((out / "demo_base.json").read_text())
        assert info["sha256"] == sha and info["seed"] == seed
        assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    # the stored weights are exactly what the HF directory holds, in float32
    from opsd.models import load_model

    model = load_model(str(base.build_base_model(base.DemoSettings(), cache=tmp_path, progress=False)))
    weights = base.load_shipped_weights(0)
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in weights.items()}
    for k, v in model.state_dict().items():
        assert v.equal(weights[k]), k


def test_only_the_shipped_recipe_and_seeds_load_shipped_weights():
    assert base.is_shipped(base.DemoSettings(seed=0, opsd_steps=5, opsd_lr=1e-4))  # OPSD settings: same base
    assert not base.is_shipped(base.DemoSettings(seed=max(base.SHIPPED) + 1))
    assert not base.is_shipped(base.DemoSettings(seed=0, sft_steps=10))
    assert not base.is_shipped(base.DemoSettings(seed=0, n_heldout=200))  # the SFT split depends on it


def test_a_damaged_shipped_base_is_a_one_line_error(tmp_path):
    data = bytearray(base.shipped_path(0).read_bytes())
    data[-1] ^= 1  # one bit of one weight
    bad = tmp_path / "seed0.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(UserError, match="SHA-256") as e:
        base.load_shipped_weights(0, bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
    with pytest.raises(UserError, match="missing"):
        base.load_shipped_weights(0, tmp_path / "absent.safetensors")


def test_shipped_bases_are_declared_package_data():
    """A wheel keeps only declared package data: pyproject must name the files, and importlib finds them."""
    import fnmatch
    import importlib.resources

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = ROOT
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for seed in base.SHIPPED:
        rel = base.shipped_path(seed).relative_to(root / "opsd" / "demo").as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in declared["opsd.demo"]), rel
        assert importlib.resources.files("opsd.demo").joinpath(rel).is_file()


def test_run_dir_that_is_not_a_demo_run_is_refused(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an `opsd demo` run"):
        demo_run.run_opsd(base.DemoSettings(), tmp_path, cache=tmp_path / "cache", progress=False)
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    # through the CLI: one line naming the directory, exit status 2, no traceback
    assert main(["demo", "--run-dir", str(tmp_path), "--cache", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "not an `opsd demo` run" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # refused before any work


def test_cli_rejects_zero_steps(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--steps" in err and "Traceback" not in err


def test_plot_uses_the_report_plotting(tmp_path):
    """demo.png: the accuracy curve and the divergence from metrics.jsonl, drawn by opsd.report."""
    lines = []
    for step in range(1, 4):
        rec = step_record(
            StepFigures(
                step=step,
                loss=1.0 / step,
                loss_stats={k: 0.5 / step for k in LOSS_STAT_KEYS},
                grad_norm=1.0,
                lr=1e-3,
                response_lens=[17],
                truncated=0,
                tokens=17,
                real_tokens={"teacher": 1, "student": 1},
                padded_tokens={"teacher": 1, "student": 1},
                skipped=False,
                prompt_truncated={"teacher": 0, "student": 0},
                epoch=0,
                times={},
                elapsed=1.0,
                peak_mem_gb=0.0,
            )
        )
        lines.append(json.dumps(rec))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    path = demo_run.plot_curve(tmp_path, [(0, 0.1), (3, 0.5)], control=False, teacher_acc=1.0)
    assert path == tmp_path / "demo.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_table(monkeypatch, capsys, tmp_path):
    fake = {
        "student_before": 0.1,
        "student_after": 0.7,
        "teacher_with_solution": 1.0,
        "gain": 0.6,
        "gap_closed": 0.6 / 0.9,
        "plot": str(tmp_path / "demo.png"),
        "seconds": 100.0,
        "seconds_base_model": 40.0,
        "settings": {"opsd_steps": 7},
    }
    seen = {}

    def fake_run(s, run_dir, **kw):
        seen.update(settings=s, run_dir=run_dir, **kw)
        return fake

    monkeypatch.setattr(demo_run, "run_opsd", fake_run)
    p = argparse.ArgumentParser()
    demo_cli.add_demo_arguments(p)
    assert (
        demo_cli.run_demo(
            p.parse_args(["--control", "--seed", "2", "--steps", "7", "--run-dir", str(tmp_path)])
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| student before OPSD (problem only) | 10.0% |" in out
    assert "| student after 7 OPSD steps (problem only) | 70.0% |" in out
    assert "100.0%" in out and "closes 67% of the student-teacher gap" in out
    assert f"plot: {tmp_path / 'demo.png'}" in out
    assert seen["control"] is True and seen["settings"].seed == 2 and seen["settings"].opsd_steps == 7


# ----------------------------------------------------------------------------------------------
# The demo itself, end to end, against its control

# Seed 0's shipped base on its 300 held-out problems: 75 right without the solution, 293 with it. Greedy
# decoding of the same weights picks the same tokens with the AVX512 and the AVX2 kernels (docs/demo.md),
# so these are exact on any CPU that rounds alike.
SHIPPED_SEED0 = (75 / 300, 293 / 300)


@pytest.mark.slow
def test_demo_gains_without_a_dip_and_its_control_does_not(tmp_path, monkeypatch):
    _no_training(monkeypatch)
    s = base.DemoSettings(seed=0)  # the real `opsd demo`: shipped base, 100 steps, 10 evaluations
    cache = tmp_path / "cache"
    r = demo_run.run_opsd(s, tmp_path / "run", cache=cache, progress=False)
    # The control: same base model, no solution in the teacher's context. Its teacher equals the
    # student, so its gradient is exactly zero from the first step: two steps show it as well as many.
    c = demo_run.run_opsd(
        base.DemoSettings(seed=0, opsd_steps=2, eval_every=2),
        tmp_path / "control",
        control=True,
        cache=cache,
        progress=False,
        plot=False,
    )
    assert (r["student_before"], r["teacher_with_solution"]) == SHIPPED_SEED0
    assert c["student_before"] == r["student_before"]  # same base model, same held-out set
    # Training itself may round differently by CPU. Measured: 98.3% after 100 steps with either kernel
    # level (AVX512, AVX2), no evaluation below the one before; 90% leaves 8 points of room, against a
    # binomial standard deviation of 1.3 points for 300 problems near 95%.
    summary = {k: r[k] for k in ("student_before", "student_after", "teacher_with_solution", "curve")}
    assert r["student_after"] >= 0.9, summary
    # no dip: the base is not annealed to a point OPSD's first steps throw it out of (docs/demo.md)
    assert min(acc for _, acc in r["curve"]) >= r["student_before"] - 0.10, summary
    assert c["student_after"] == c["student_before"]
    ctrl = [json.loads(x) for x in (tmp_path / "control" / "metrics.jsonl").read_text().splitlines()]
    assert all(rec["divergence"] == 0.0 and rec["grad_norm"] == 0.0 for rec in ctrl)

    run_dir = tmp_path / "run"
    assert (run_dir / "demo.png").stat().st_size > 0 and r["plot"] == str(run_dir / "demo.png")
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "config.yaml").is_file()
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == list(range(0, 101, 10))
    assert len(list(cache.glob("base-*"))) == 1  # the control reused the same base directory


# ----------------------------------------------------------------------------------------------
# `opsd demo --compare`


def _demo_arm(arm: str, s) -> list[str]:
    """What `opsd compare` changes for ``arm`` on the demo's configuration (untuned GRPO settings)."""
    from opsd import compare as general

    budget = general.Budget(s.opsd_steps, s.prompts_per_step, s.eval_every)
    grpo = general.GRPOSettings(s.grpo_lr, s.temperature, s.grpo_n, False)
    return general.method_overrides(arm, grpo, 1.0, budget)


def test_arms_differ_from_opsd_only_where_they_say():
    s = base.DemoSettings()
    assert _demo_arm("opsd", s) == ["objective=opsd"]  # whatever the config says
    assert _demo_arm("control_a", s) == ["objective=opsd", "teacher.privileged=false"]
    assert _demo_arm("control_b", s) == ["objective=opsd", "teacher.solution_source=other"]
    grpo = _demo_arm("grpo", s)
    assert "objective=grpo" in grpo
    # as many responses a step as OPSD: 64 problems x 1 = 8 problems x 8 samples
    assert compare.grpo_prompts(s) * s.grpo_n == s.prompts_per_step
    assert "rollout.n=8" in grpo and "rollout.prompts_per_step=8" in grpo
    assert f"optim.lr={s.grpo_lr}" in grpo  # its own: at OPSD's lr it collapses
    assert _demo_arm("mixed", s) == [*grpo, "grpo.distill_coef=1.0"]


def test_grpo_arm_configures_the_trainer(tmp_path):
    """Every trainer arm's overrides make a valid `opsd train` config."""
    from opsd.config import load_config

    s = base.DemoSettings()
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(task.make_row(437, 285, 3)) + "\n")
    for arm in ("opsd", "grpo", "mixed", "control_a", "control_b"):
        cfg = load_config(
            None,
            demo_run.train_overrides(s, tmp_path, data, tmp_path / arm, control=False, progress=False)
            + ["grpo.grader=opsd.demo.task:grade_digits", *_demo_arm(arm, s)],
        )
        assert cfg.rollout.prompts_per_step * cfg.rollout.n == s.prompts_per_step
    assert cfg.teacher.solution_source == "other" and cfg.objective == "opsd"


def _point(step, acc, tokens):
    return {"step": step, "accuracy": acc, "generated_tokens": tokens, "train_seconds": step / 10}


def _fake_result(seeds=(0,)):
    curves = {
        "opsd": [(0, 0.1, 0), (10, 0.5, 1000), (20, 0.9, 2000)],
        "grpo": [(0, 0.1, 0), (10, 0.2, 1100), (20, 0.5, 2200)],
        "sft": [(0, 0.1, 0), (10, 0.6, 0), (20, 0.95, 0)],
        "control_a": [(0, 0.1, 0), (10, 0.1, 1000), (20, 0.1, 2000)],
        "control_b": [(0, 0.1, 0), (10, 0.15, 1000), (20, 0.2, 2000)],
    }
    return {
        "settings": {**vars(base.DemoSettings()), "opsd_steps": 20},
        "seeds": [
            {
                "seed": sd,
                "student_before": 0.1,
                "teacher_with_solution": 1.0,
                "arms": [
                    {"arm": a, "seed": sd, "points": [_point(*x) for x in c], "seconds": 3.0}
                    for a, c in curves.items()
                ],
            }
            for sd in seeds
        ],
    }


def test_compare_table_and_token_efficiency():
    table = compare.format_compare_table(_fake_result())
    assert "| OPSD | 90.0% | +80.0 | 2,000 | 2 s |" in table
    assert "| GRPO | 50.0% | +40.0 | 2,200 | 2 s |" in table
    assert "| SFT on worked solutions | 95.0% | +85.0 | 0 | 2 s |" in table
    assert "| control A: teacher without the solution | 10.0% | +0.0 |" in table
    # OPSD first reaches GRPO's final 50% at step 10, after 1,000 generated tokens; GRPO spent 2,200
    assert "OPSD reached it after 1,000 (2.2x fewer)" in table
    many = compare.format_compare_table(_fake_result(seeds=(0, 1)))
    assert "| OPSD | 90.0% (90.0 / 90.0) | +80.0 |" in many and "mean, then per seed" in many
    assert compare.tokens_to_reach([_point(0, 0.1, 0), _point(5, 0.3, 50)], 0.4) is None


def test_cli_compare_prints_the_table(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_compare(s, seeds, out, **kw):
        seen.update(settings=s, seeds=seeds, out=out)
        return {**_fake_result(), "plot": str(out / "compare.png"), "seconds": 12.0}

    monkeypatch.setattr(compare, "run_demo_compare", fake_compare)
    assert main(["demo", "--compare", "--seeds", "0,1,2", "--steps", "20", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| OPSD | 90.0% | +80.0 |" in out and f"plot: {tmp_path / 'compare.png'}" in out
    assert seen["seeds"] == [0, 1, 2] and seen["settings"].opsd_steps == 20 and seen["out"] == tmp_path
    assert main(["demo", "--compare", "--run-dir", str(tmp_path)]) == 0
    assert seen["seeds"] == [0] and seen["settings"].opsd_steps == demo_run.COMPARE_STEPS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare", "--control"], "--control and --compare"),
        (["--seeds", "0,1"], "--seeds is for --compare"),
    ],
)
def test_cli_compare_user_errors(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_rejects_bad_seed_lists(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--compare", "--seeds", "0,x"])
    assert "expected integers separated by commas" in capsys.readouterr().err


def test_compare_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an `opsd compare` directory"):
        compare.run_demo_compare(base.DemoSettings(), [0], tmp_path, cache=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()


# Tiny on purpose: the point is every arm running end to end and the outputs, not the figures.
TINY = dict(
    SMALL, sft_steps=20, sft_batch=16, n_sft=100, n_train=100, n_heldout=20, opsd_steps=2, eval_every=1
)


@pytest.mark.slow
def test_short_compare_writes_the_table_and_plot_and_control_a_stays_put(tmp_path):
    out = tmp_path / "compare"
    settings = base.DemoSettings(**TINY)
    r = compare.run_demo_compare(settings, [0], out, cache=tmp_path / "cache", progress=False)
    arms = {a["arm"]: a for a in r["seeds"][0]["arms"]}
    assert list(arms) == list(compare.ARMS)
    for a in arms.values():
        assert [p["step"] for p in a["points"]] == [0, 1, 2]
        assert (out / "seed0" / a["arm"] / "compare_eval.jsonl").is_file()
    assert arms["sft"]["points"][-1]["generated_tokens"] == 0
    for name in ("opsd", "grpo", "mixed", "control_a", "control_b"):
        assert arms[name]["points"][-1]["generated_tokens"] > arms[name]["points"][1]["generated_tokens"] > 0
    # control A: the teacher reads what the student reads with the initial weights: nothing moves
    assert compare.gain(r, "control_a") == [0.0]
    metrics = {
        name: [json.loads(x) for x in (out / "seed0" / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("opsd", "grpo", "control_a", "control_b")
    }
    ctrl = metrics["control_a"]
    assert len(ctrl) == 2 and all(rec["divergence"] == 0.0 and rec["grad_norm"] == 0.0 for rec in ctrl)
    # GRPO is the trainer's GRPO objective; control B's teacher reads other solutions than OPSD's
    assert all("reward_mean" in rec and "flat_group_frac" in rec for rec in metrics["grpo"])
    assert metrics["control_b"][0]["divergence"] != metrics["opsd"][0]["divergence"]
    row = next(x for x in compare.format_compare_table(r).splitlines() if x.startswith("| control A"))
    assert row.split(" | ")[2] == "+0.0", row
    assert Path(r["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "compare_result.json").read_text())["seeds"][0]["seed"] == 0


@pytest.mark.slow
def test_compare_runs_on_the_shipped_base(tmp_path, monkeypatch):
    """`opsd demo --compare` on seed 0's shipped base: loaded, not trained, and the arms run on it."""
    _no_training(monkeypatch)
    s = base.DemoSettings(opsd_steps=2, eval_every=2)
    arms = ("opsd", "control_a")
    r = compare.run_demo_compare(s, [0], tmp_path / "c", arms=arms, cache=tmp_path, progress=False)
    sd = r["seeds"][0]
    assert (sd["student_before"], sd["teacher_with_solution"]) == SHIPPED_SEED0
    assert compare.gain(r, "control_a") == [0.0]
    assert [p["step"] for p in compare.arm_runs(r, "opsd")[0]["points"]] == [0, 2]


def test_compare_with_grpo_tuning_runs_from_the_command_line(tmp_path, monkeypatch, capsys):
    """`opsd demo --compare --seeds 0 --tune-grpo 1`, as written, on a small base: the tuning runs first
    on its own seeds and writes its choice, the comparison's GRPO reads it back, the table prints."""
    from opsd import compare as general

    monkeypatch.setattr(demo_cli, "DemoSettings", small_demo_settings())
    out = tmp_path / "cmp"
    argv = ["--compare", "--seeds", "0", "--tune-grpo", "1", "--steps", "2", "--run-dir", str(out)]
    assert main(["demo", *argv, "--cache", str(tmp_path / "cache")]) == 0
    assert (out / general.tune_file("grpo")).is_file()
    result = json.loads((out / "compare_result.json").read_text())
    assert "opsd compare --tune grpo" in result["grpo_source"]
    assert [a["arm"] for a in result["seeds"][0]["arms"]] == list(compare.ARMS)
    assert "| OPSD |" in capsys.readouterr().out
