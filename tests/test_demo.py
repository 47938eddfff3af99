"""`opsd demo`: the task generator and grader, and a shortened demo against its control."""

from __future__ import annotations

import argparse
import json

import pytest

from opsd import demo
from opsd.data import load_examples

# ----------------------------------------------------------------------------------------------
# Generator


def test_worked_solution_is_column_addition_with_carries():
    assert demo.worked_solution(437, 285, 3) == "12 12 07 so 0722"
    assert demo.worked_solution(999, 999, 3) == "18 19 19 so 1998"
    assert demo.worked_solution(100, 100, 3) == "00 00 02 so 0200"
    assert demo.worked_solution(55, 45, 2) == "10 10 so 100"


def test_worked_solution_totals_add_up_for_many_problems():
    for row in demo.make_rows(300, seed=5, digits=3):
        a, b = (int(x) for x in row["problem"].rstrip("=").split("+"))
        totals = row["solution"].split(" so ")[0].split()
        carry = 0
        for i, t in enumerate(totals):
            assert int(t) == (a // 10**i) % 10 + (b // 10**i) % 10 + carry
            carry = int(t) // 10
        assert row["answer"] == f"{a + b:04d}"
        assert row["solution"].endswith(" so " + row["answer"])


def test_generator_is_deterministic_and_seeded():
    assert demo.make_rows(50, seed=3, digits=3) == demo.make_rows(50, seed=3, digits=3)
    assert demo.make_rows(50, seed=3, digits=3) != demo.make_rows(50, seed=4, digits=3)
    assert demo.make_splits(1, 3, 100, 100, 50) == demo.make_splits(1, 3, 100, 100, 50)


def test_splits_are_disjoint_and_distinct():
    split = demo.make_splits(0, 3, 500, 500, 200)
    problems = {name: [r["problem"] for r in rows] for name, rows in split.items()}
    assert {name: len(p) for name, p in problems.items()} == {"sft": 500, "train": 500, "heldout": 200}
    for p in problems.values():
        assert len(set(p)) == len(p)
    assert not set(problems["heldout"]) & (set(problems["train"]) | set(problems["sft"]))
    assert not set(problems["train"]) & set(problems["sft"])


def test_operands_have_the_requested_width():
    for row in demo.make_rows(100, seed=0, digits=2):
        a, b = row["problem"].rstrip("=").split("+")
        assert len(a) == len(b) == 2 and a[0] != "0" and b[0] != "0"


def test_generator_rejects_impossible_requests():
    with pytest.raises(ValueError, match="distinct 1-digit"):
        demo.make_rows(82, seed=0, digits=1)  # only 9 * 9 = 81 exist
    with pytest.raises(ValueError, match="digits=0"):
        demo.make_rows(1, seed=0, digits=0)


def test_rows_load_with_the_training_data_loader(tmp_path):
    rows = demo.make_rows(20, seed=0, digits=3)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = load_examples(str(path), answer_key="answer", require_answer=True)
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
    assert demo.grade(response, "0722") is expected


def test_final_answer_takes_the_last_one():
    assert demo.final_answer("so 0100 so 0722") == "0722"
    assert demo.final_answer("no answer here") is None


# ----------------------------------------------------------------------------------------------
# The model side: prompts and the cache


def test_prompts_differ_only_by_the_solution():
    tok = demo.build_tokenizer()
    row = demo.make_row(437, 285, 3)
    student = tok.decode(demo.prompt_ids(tok, row, with_solution=False))
    teacher = tok.decode(demo.prompt_ids(tok, row, with_solution=True))
    assert "437+285=" in student and row["solution"] not in student
    assert "437+285=" in teacher and f"Worked: {row['solution']}" in teacher
    # character level: every digit of the solution is one token
    assert len(tok.encode(row["solution"], add_special_tokens=False)) == len(row["solution"])


def test_base_key_changes_with_every_base_setting():
    s = demo.DemoSettings()
    assert s.base_key() == demo.DemoSettings().base_key()
    for change in ({"seed": 1}, {"digits": 2}, {"sft_steps": 10}, {"sft_teacher_frac": 0.3}, {"hidden": 64}):
        assert demo.DemoSettings(**change).base_key() != s.base_key()
    assert demo.DemoSettings(opsd_steps=5).base_key() == s.base_key()  # OPSD settings do not rebuild


def test_run_dir_that_is_not_a_demo_run_is_refused(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an `opsd demo` run"):
        demo.run(demo.DemoSettings(), tmp_path, cache=tmp_path / "cache", progress=False)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


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

    monkeypatch.setattr(demo, "run", fake_run)
    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    assert (
        demo.run_demo(p.parse_args(["--control", "--seed", "2", "--steps", "7", "--run-dir", str(tmp_path)]))
        == 0
    )
    out = capsys.readouterr().out
    assert "| student before OPSD (problem only) | 10.0% |" in out
    assert "| student after 7 OPSD steps (problem only) | 70.0% |" in out
    assert "100.0%" in out and "closes 67% of the student-teacher gap" in out
    assert f"plot: {tmp_path / 'demo.png'}" in out
    assert seen["control"] is True and seen["settings"].seed == 2 and seen["settings"].opsd_steps == 7


# ----------------------------------------------------------------------------------------------
# A shortened demo, end to end, against its control

SHORT = dict(sft_steps=250, opsd_steps=120, eval_every=120, n_heldout=200, n_sft=2000, n_train=2000)


@pytest.mark.slow
def test_short_demo_gains_and_its_control_does_not(tmp_path):
    s = demo.DemoSettings(seed=0, **SHORT)
    cache = tmp_path / "cache"
    r = demo.run(s, tmp_path / "run", cache=cache, progress=False)
    # The control: same base model (from the cache), no solution in the teacher's context. Its
    # teacher equals the student, so its gradient is exactly zero from the first step: a few steps
    # show it as well as many.
    c = demo.run(
        demo.DemoSettings(seed=0, **{**SHORT, "opsd_steps": 10, "eval_every": 10}),
        tmp_path / "control",
        control=True,
        cache=cache,
        progress=False,
        plot=False,
    )

    assert r["teacher_with_solution"] >= 0.9  # the base model can use the reference
    assert r["student_before"] <= 0.5  # and is an imperfect student without it
    assert c["student_before"] == r["student_before"]  # same base model, same held-out set
    summary = {k: r[k] for k in ("student_before", "student_after", "teacher_with_solution", "seconds")}
    assert r["student_after"] - r["student_before"] >= 0.15, summary
    assert c["student_after"] == c["student_before"]
    ctrl = [json.loads(x) for x in (tmp_path / "control" / "metrics.jsonl").read_text().splitlines()]
    assert all(rec["divergence"] == 0.0 and rec["grad_norm"] == 0.0 for rec in ctrl)

    run_dir = tmp_path / "run"
    assert (run_dir / "demo.png").stat().st_size > 0 and r["plot"] == str(run_dir / "demo.png")
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "config.yaml").is_file()
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 120]
    assert len(list(cache.glob("base-*"))) == 1  # the control reused the cached base model
