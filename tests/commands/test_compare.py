"""`opsd compare` on the tiny model: every method at one budget, resume without rerunning, and GRPO's
tuning on seeds whose held-out set it never reads."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, SHARED_DATA, build_assets

import opsd.trainer as trainer_mod
from opsd import compare
from opsd.errors import UserError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    a = build_assets(root)
    rows = [
        {"problem": f"What is {x} + 3?", "solution": f"{x} + 3 = {x + 3}.", "answer": str(x + 3)}
        for x in range(4)
    ]
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Boxed final answers: the wrong-answer control has one to replace in every row.
    train = [
        {"problem": f"What is {x} + 4?", "solution": f"{x} + 4 = \\boxed{{{x + 4}}}.", "answer": str(x + 4)}
        for x in range(8)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    return a | {"heldout": str(root / "heldout.jsonl"), "data": str(root / "train.jsonl")}


def _overrides(assets) -> list[str]:
    return [
        f"model.path={assets['model']}",
        f"data.path={assets['data']}",
        "model.lora.r=4",
        "model.lora.alpha=8",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        "optim.lr=0.01",
        "loss.clip_mode=none",
        "model.dtype=float32",
        "data.max_prompt_len=256",
        f"eval.path={assets['heldout']}",
        "eval.limit=2",
        "eval.max_new_tokens=4",
        "eval.divergence=true",
        "grpo.grader=helpers:letter_e_reward",
        "logging.sample_every=0",
        "rollout.engine=hf",
    ]


def test_every_method_at_one_budget(assets, tmp_path):
    out = tmp_path / "cmp"
    methods = list(compare.METHODS)
    overrides = [*_overrides(assets), "eval.lenient_grader=last_number"]
    result = compare.run_compare(
        None,
        overrides,
        out,
        compare.ComparePlan(methods=methods, seeds=[0], steps=2, eval_every=1, progress=False, ceiling=True),
    )
    assert json.loads((out / "compare.json").read_text())["methods"] == methods
    assert (out / "compare.png").stat().st_size > 0
    table = (out / "compare.md").read_text()
    assert all(compare.METHODS[m] in table for m in methods)
    assert "| base model |" in table and "Teacher's ceiling" in table and "95% CI" in table
    ceiling = json.loads((out / "ceiling.json").read_text())
    assert ceiling["problems"] == 2 and 0 <= ceiling["accuracy"] <= 1 and ceiling["lenient"] is not None
    report = json.loads((out / "seed0" / "control_wrong" / "data_report.json").read_text())
    assert report["wrong_answer_refused"] == 0 and report["rows"] == 8
    runs = {r["method"]: r for r in result["runs"]}
    base = runs["opsd"]["points"][0]
    for m in methods:
        points = runs[m]["points"]
        assert [p["step"] for p in points] == [0, 1, 2]
        assert points[0] == base  # one base evaluation per seed, shared
        assert all(p["divergence"] is None or p["divergence"] >= 0 for p in points)
        assert all(p["problems"] == 2 and p["lenient"] is not None for p in points)
        assert all(
            0 <= p["repetition"] <= 1 and 0 <= p["truncated"] <= 1 and p["resp_len"] > 0 for p in points
        )
        assert (out / "seed0" / m / "metrics.jsonl").is_file()  # a run directory `opsd report` reads
    # Equal responses per step: OPSD 2 problems x 2, GRPO 1 problem x 4 samples, SFT 4 solutions.
    assert result["grpo"]["n"] == 4 and result["budget"]["responses_per_step"] == 4
    assert (
        runs["grpo"]["points"][-1]["generated_tokens"] > 0
        and runs["sft"]["points"][-1]["generated_tokens"] == 0
        and runs["sft"]["points"][-1]["teacher_tokens"] == 0
    )
    sft = [json.loads(x) for x in (out / "seed0" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(sft) == 2 and all(r["tokens"] == 4 * r["resp_len_mean"] for r in sft)  # 4 whole solutions
    # Control A's teacher is the initial student on the same prompt: zero gradient, so no movement.
    assert runs["control_a"]["points"][-1]["accuracy"] == base["accuracy"]


def test_sft_is_the_trainer_with_the_sft_objective(assets):
    """SFT's overrides: its own learning rate (--sft-lr), as many solutions a step as the others'
    responses, the token mean, and nothing that would add a second SFT term or generate ahead."""
    budget = compare.Budget(steps=2, responses_per_step=4, eval_every=1)
    grpo = compare.GRPOSettings(1e-4, 1.0, 2, False)
    keys = compare.method_overrides("sft", grpo, 1.0, budget, sft_lr=2e-5)
    user = [*_overrides(assets), "loss.sft_coef=0.5", "loss.reduction=sequence"]
    cfg = compare.arm_config(None, user, keys)
    assert cfg.objective == "sft" and cfg.optim.lr == 2e-5 and cfg.loss.sft_coef == 0
    assert cfg.rollout.prompts_per_step * cfg.rollout.n == 4 and cfg.loss.reduction == "token"
    assert "optim.lr" not in " ".join(compare.method_overrides("sft", grpo, 1.0, budget))  # the config's


def test_teacher_tokens_count_where_a_teacher_scores(assets, tmp_path):
    # Without eval.divergence the ceiling reads the held-out solutions itself.
    overrides = [*_overrides(assets), "eval.divergence=false"]
    result = compare.run_compare(
        None,
        overrides,
        tmp_path / "cmp",
        compare.ComparePlan(
            ceiling=True, methods=["opsd", "grpo"], seeds=[0], steps=1, eval_every=1, progress=False
        ),
    )
    runs = {r["method"]: r["points"][-1] for r in result["runs"]}
    assert runs["opsd"]["teacher_tokens"] > 0 and runs["grpo"]["teacher_tokens"] == 0
    assert result["ceiling"]["problems"] == 2 and result["ceiling"]["lenient"] is None


def test_wilson_interval_and_word_repetition():
    lo, hi = compare.wilson(0.5, 200)
    assert lo == pytest.approx(0.4314, abs=1e-3) and hi == pytest.approx(0.5686, abs=1e-3)
    assert compare.wilson(0.0, 200)[0] == 0.0 and 0 < compare.wilson(0.0, 200)[1] < 0.02
    # the repetition column: training's metric (opsd.metrics.repetition) over the response's words
    from opsd.metrics import repetition

    assert repetition("a b c d e f".split()) == 0.0
    assert repetition(("x y z w " * 10).split()) == pytest.approx(1 - 4 / 37)
    assert repetition("too short".split()) is None


def _result(methods: list[str], *, steps: int, runs: list[dict], ceiling: dict, variants=None) -> dict:
    """A comparison's result as `run_compare` writes it, around the given runs."""
    return {
        "methods": methods,
        "variants": variants or {},
        "seeds": [0],
        "lr": {"opsd": 1e-5, "sft": 1e-5, "grpo": 1e-5},
        "budget": {"steps": steps, "responses_per_step": 4, "eval_every": 2},
        "grpo": {},
        "grpo_source": "config",
        "distill_coef": 1.0,
        "runs": runs,
        "ceiling": ceiling,
    }


def test_the_table_reads_older_points_and_marks_the_best():
    def point(step, acc, **kw):
        return {
            "step": step,
            "accuracy": acc,
            "generated_tokens": 10 * step,
            "train_seconds": float(step),
            "divergence": None,
            **kw,
        }

    result = _result(
        ["opsd"],
        steps=4,
        runs=[
            {
                "method": "opsd",
                "seed": 0,
                "points": [point(0, 0.1), point(2, 0.4, problems=200), point(4, 0.4, problems=200)],
            }
        ],
        ceiling={"accuracy": 0.9, "lenient": 0.95, "problems": 200},
    )
    table = compare.format_comparison_table(result)
    row = next(x for x in table.splitlines() if x.startswith("| OPSD"))
    assert "40.0% [33.5, 46.9]" in row and "+30.0" in row and "| 2 | 20 |" in row
    assert "Teacher's ceiling" in table and "90.0% [85.1, 93.4], lenient 95.0%" in table


def test_variants_paired_differences_and_the_gap_closed():
    """Per-problem records give each gain a paired interval and each OPSD method a difference against
    every other kind of method; a variant is named by its method and keys."""

    def point(step, correct):
        acc = sum(correct) / len(correct)
        return {
            "step": step,
            "accuracy": acc,
            "generated_tokens": 0,
            "train_seconds": 0.0,
            "correct": correct,
        }

    base = [1.0, 0.0, 0.0, 0.0]  # 25% at step 0
    result = _result(
        ["opsd", "opsd_entry", "sft"],
        steps=2,
        variants={"opsd_entry": {"method": "opsd", "overrides": ["loss.clip_mode=entry"]}},
        runs=[
            {
                "method": "opsd",
                "seed": 0,
                "lr": 1e-4,
                "points": [point(0, base), point(2, [1.0, 1.0, 1.0, 0.0])],
            },
            {"method": "opsd_entry", "seed": 0, "lr": 1e-4, "points": [point(0, base), point(2, base)]},
            {
                "method": "sft",
                "seed": 0,
                "lr": 2e-5,
                "points": [point(0, base), point(2, [1.0, 1.0, 0.0, 0.0])],
            },
        ],
        ceiling={"accuracy": 0.75, "problems": 4},
    )
    table = compare.format_comparison_table(result)
    opsd = next(x for x in table.splitlines() if x.startswith("| OPSD |"))
    # d = [0, 1, 1, 0]: mean 0.5, sample variance 1/3, half-width 1.96 sqrt(1/12) = 0.566
    assert "| +50.0 [-6.6, +106.6] | 100.0% |" in opsd  # the whole gap: 25% -> 75% with a 75% ceiling
    assert "| OPSD (loss.clip_mode=entry) |" in table
    # d = [0, 0, 1, 0]: mean 0.25, sample variance 1/4, half-width 1.96 sqrt(1/16) = 0.49
    assert "| OPSD | SFT on the solutions (or data.target_key) | +25.0 [-24.0, +74.0] |" in table
    with pytest.raises(UserError, match="NAME=METHOD:KEY=VALUE"):
        compare.Variant.parse("opsd_entry=opsd")
    with pytest.raises(UserError, match="unknown method"):
        compare.Variant.parse("x=nope:loss.clip=1")
    assert compare.Variant.parse("e=opsd:loss.clip_mode=entry,loss.clip=0.05").overrides == (
        "loss.clip_mode=entry",
        "loss.clip=0.05",
    )


def test_a_comparison_resumes_without_rerunning_finished_methods(assets, tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    kw = dict(methods=["opsd", "grpo"], seeds=[0], steps=2, eval_every=1, progress=False)
    first = compare.run_compare(None, _overrides(assets), out, compare.ComparePlan(**kw))
    # "opsd" stops after its checkpoint at step 2 but before its last evaluation was recorded.
    opsd_dir = out / "seed0" / "opsd"
    (opsd_dir / "compare_method.json").unlink()
    log = opsd_dir / "compare_eval.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1]))

    built, stepped = [], []
    real_init, real_step = trainer_mod.Trainer.__init__, trainer_mod.Trainer.step

    def init(self, cfg, **k):
        built.append((cfg.logging.run_dir, k.get("resume")))
        real_init(self, cfg, **k)

    def step(self):
        stepped.append(self.cfg.logging.run_dir)
        return real_step(self)

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", init)
    monkeypatch.setattr(trainer_mod.Trainer, "step", step)
    again = compare.run_compare(None, _overrides(assets), out, compare.ComparePlan(**kw))
    assert built == [(str(opsd_dir), True)]  # grpo is read back; opsd resumes from its checkpoint
    assert stepped == []  # its checkpoint is at the last step: only the missing evaluation runs
    assert again["runs"] == first["runs"]


def test_tuning_never_reads_a_reported_seeds_heldout_set(assets, tmp_path, monkeypatch):
    read = []
    import opsd.setup as setup_mod

    real = setup_mod.load_examples

    def spy(path, *a, **k):
        read.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(setup_mod, "load_examples", spy)
    out = tmp_path / "cmp"
    with pytest.raises(UserError, match="also reported"):
        compare.run_tune(
            None, _overrides(assets), out, compare.TunePlan(tune_seeds=[0, 5], reported=[0], steps=2)
        )
    tune = compare.run_tune(
        None,
        _overrides(assets),
        out,
        compare.TunePlan(tune_seeds=[5, 6], reported=[0], steps=2, progress=False),
    )
    assert read and assets["heldout"] not in read
    grid = compare.tune_grid(compare.arm_config(None, _overrides(assets), []), compare.Budget(2, 4, 2))
    assert len(tune["results"]) == len(grid)
    assert tune["chosen"] in [r["setting"] for r in tune["results"]]
    result = compare.run_compare(
        None,
        _overrides(assets),
        out,
        compare.ComparePlan(methods=["grpo"], seeds=[0], steps=1, eval_every=1, progress=False),
    )
    assert result["grpo"] == tune["chosen"] and "--tune grpo" in result["grpo_source"]


def test_grpo_plus_distillation_is_tuned_on_its_own(assets, tmp_path):
    """`--tune mixed` chooses GRPO + distillation's settings with the distillation term on, apart
    from GRPO's; the comparison then trains mixed at them, not at GRPO's."""
    out = tmp_path / "cmp"
    tune = compare.run_tune(
        None,
        _overrides(assets),
        out,
        compare.TunePlan(
            tune_seeds=[5], reported=[0], steps=2, progress=False, method="mixed", distill_coef=0.5
        ),
    )
    assert (out / "tune" / "mixed.json").is_file() and not (out / "tune" / "grpo.json").exists()
    assert all(r["distill"] == ["grpo.distill_coef=0.5"] for r in tune["results"])
    config = (out / "tune" / "mixed_setting0_seed5" / "config.yaml").read_text()
    assert "distill_coef: 0.5" in config
    result = compare.run_compare(
        None,
        _overrides(assets),
        out,
        compare.ComparePlan(
            methods=["mixed"],
            seeds=[0],
            steps=1,
            eval_every=1,
            distill_coef=0.5,
            grpo_lr=0.123,
            progress=False,
        ),
    )
    assert result["mixed"] == tune["chosen"] and "--tune mixed" in result["mixed_source"]
    assert result["grpo"]["lr"] == 0.123 and "from the config" in result["grpo_source"]
    trained = (out / "seed0" / "mixed" / "config.yaml").read_text()
    assert f"lr: {tune['chosen']['lr']}" in trained and "distill_coef: 0.5" in trained
    with pytest.raises(UserError, match="--tune sft"):
        compare.run_tune(
            None,
            _overrides(assets),
            out,
            compare.TunePlan(tune_seeds=[5], reported=[0], steps=1, method="sft"),
        )


def test_a_guard_ends_a_method_early_with_its_evaluation(assets, tmp_path):
    """A guard that fires (here: every response of the random model is cut at 4 tokens) ends the
    method at that step, evaluated there and named in the table, instead of reading as a signal."""
    out = tmp_path / "cmp"
    guard = ["guard.max_truncation=0.0", "guard.window=1"]
    kw = dict(methods=["opsd"], seeds=[0], steps=4, eval_every=4, progress=False)
    result = compare.run_compare(None, [*_overrides(assets), *guard], out, compare.ComparePlan(**kw))
    run = result["runs"][0]
    assert run["stopped_by"] == "guard.max_truncation at step 1"
    assert [p["step"] for p in run["points"]] == [0, 1] and run["finished"]
    assert "stopped by guard.max_truncation at step 1" in (out / "compare.md").read_text()
    again = compare.run_compare(None, [*_overrides(assets), *guard], out, compare.ComparePlan(**kw))
    assert again["runs"] == result["runs"]  # read back, not rerun


def test_a_tuning_without_signal_says_so(tmp_path):
    """Where every group's reward was flat at every setting, the choice is a tie, and the table says so."""
    setting = {"lr": 1e-4, "temperature": 1.0, "n": 4, "scale_rewards": False}
    tune = {"seeds": [9], "chosen": setting, "improves_on_first_step": False}
    (tmp_path / "tune").mkdir()
    for flat, said in ((1.0, True), (0.5, False)):
        tune["results"] = [{"setting": setting, "flat_group_frac": flat}]
        (tmp_path / "tune" / "grpo.json").write_text(json.dumps(tune))
        chosen, source = compare.read_tuned(tmp_path, "grpo", compare.Budget(2, 8, 2))
        assert chosen == compare.GRPOSettings(**setting)
        assert ("no signal" in source) is said and "no setting raised" in source


def test_the_ceiling_fits_the_engines_context(assets):
    """The ceiling generates from teacher prompts (the solution included) on the rollout engine: every
    method's engine gets a context that holds one plus a held-out answer, unless the config sets one."""
    cfg = compare.arm_config(None, _overrides(assets), ["data.max_teacher_prompt_len=300"])
    assert compare.ceiling_context(cfg) == ["rollout.max_model_len=304"]  # 300 + eval's 4 new tokens
    own = compare.arm_config(None, _overrides(assets), ["rollout.max_model_len=999"])
    assert compare.ceiling_context(own) == []


def test_bad_comparisons_are_one_line_errors(assets, tmp_path):
    no_eval = [o for o in _overrides(assets) if not o.startswith("eval.")]
    with pytest.raises(UserError, match="eval.path"):
        compare.run_compare(
            None, no_eval, tmp_path / "a", compare.ComparePlan(methods=["opsd"], seeds=[0], progress=False)
        )
    with pytest.raises(UserError, match="unknown"):
        compare.run_compare(
            None, _overrides(assets), tmp_path / "b", compare.ComparePlan(methods=["ppo"], seeds=[0])
        )
    with pytest.raises(UserError, match="grpo-n"):
        compare.run_compare(
            None,
            _overrides(assets),
            tmp_path / "c",
            compare.ComparePlan(methods=["grpo"], seeds=[0], grpo_n=3, progress=False),
        )
    reuse = [*_overrides(assets), "rollout.reuse.refresh_every=4", "grpo.tis_cap=0"]
    with pytest.raises(UserError, match="--methods grpo: .*needs grpo.tis_cap") as e:  # before OPSD trains
        compare.run_compare(
            None,
            reuse,
            tmp_path / "e",
            compare.ComparePlan(methods=["opsd", "grpo"], seeds=[0], progress=False),
        )
    assert "\n" not in str(e.value) and not (tmp_path / "e" / "seed0").exists()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("mine")
    with pytest.raises(UserError, match="not an `opsd compare` directory"):
        compare.run_compare(
            None, _overrides(assets), tmp_path / "d", compare.ComparePlan(methods=["opsd"], seeds=[0])
        )


class _Trains(Exception):
    """Raised where the first method would start training."""


def _stop_at_training(*args, **kwargs):
    raise _Trains


def test_control_b_notes_rows_sharing_a_solution_before_any_method_trains(
    assets, tmp_path, capsys, monkeypatch
):
    """Where a method's teacher reads another row's solution (control B, or a variant that does): how
    many training rows share theirs, once at the start; every row with one solution is refused there."""
    import opsd.compare.run as compare_run

    monkeypatch.setattr(compare_run, "run_trainer_method", _stop_at_training)
    shared = tmp_path / "shared.jsonl"
    bios = ["Ana was born in Lima.", "Ana was born in Lima.", "Bo was born in Oslo.", "Cy was born in Rome."]
    shared.write_text(
        "".join(json.dumps({"problem": f"Q{i}?", "solution": b}) + "\n" for i, b in enumerate(bios))
    )
    overrides = [*_overrides(assets), f"data.path={shared}"]
    kw = dict(seeds=[0], steps=1, progress=False)
    line = f"data: 2 of 4 rows of {shared} share their solution with another row; control B reads"
    with pytest.raises(_Trains):
        compare.run_compare(
            None, overrides, tmp_path / "a", compare.ComparePlan(methods=["opsd", "control_b"], **kw)
        )
    assert capsys.readouterr().err.count(line) == 1
    variant = compare.Variant("other", "opsd", ("teacher.solution_source=other",))
    with pytest.raises(_Trains):
        compare.run_compare(
            None, overrides, tmp_path / "b", compare.ComparePlan(methods=["other"], variants=[variant], **kw)
        )
    assert line in capsys.readouterr().err
    with pytest.raises(_Trains):
        compare.run_compare(None, overrides, tmp_path / "c", compare.ComparePlan(methods=["opsd"], **kw))
    assert "share their solution" not in capsys.readouterr().err
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"problem": f"Q{i}?", "solution": bios[0]}) + "\n" for i in range(3)))
    with pytest.raises(UserError, match="every row has the same solution") as e:
        compare.run_compare(
            None,
            [*_overrides(assets), f"data.path={same}"],
            tmp_path / "d",
            compare.ComparePlan(methods=["control_b"], **kw),
        )
    assert str(e.value).startswith(f"{same}: ") and "\n" not in str(e.value)


SHARED = SHARED_DATA


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.shared_data
def test_compare_runs_on_smollm2_with_the_math_data(smollm2_path, tmp_path):
    """`opsd compare` end to end on the real model and data at a tiny budget: OPSD, GRPO, SFT and
    the mixed objective, 2 steps, 1 seed, held-out accuracy and divergence on 4 MATH-500 problems."""
    if not (SHARED / "math_train.jsonl").is_file():
        pytest.skip("../shared/data is not here")
    overrides = [
        f"data.path={SHARED / 'math_train.jsonl'}",
        f"eval.path={SHARED / 'math500_test.jsonl'}",
        "eval.limit=4",
        "eval.max_new_tokens=16",
        "eval.divergence=true",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=16",
    ]
    result = compare.run_compare(
        ROOT / "examples" / "smollm2-math.yaml",
        overrides,
        tmp_path / "cmp",
        compare.ComparePlan(
            methods=["opsd", "grpo", "sft", "mixed"],
            seeds=[0],
            steps=2,
            eval_every=2,
            grpo_n=2,
            progress=False,
        ),
    )
    assert [r["method"] for r in result["runs"]] == ["opsd", "grpo", "sft", "mixed"]
    assert all(r["points"][-1]["divergence"] is not None for r in result["runs"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare"], "--config is required"),
        (["compare", "--config", "x.yaml", "--steps", "0"], "--steps 0: must be >= 1"),
        (["compare", "--config", "nope.yaml"], "config file not found"),
        (["serve", "/no/such/model"], "no such model directory"),
    ],
)
def test_command_mistakes_are_one_line(argv, message, capsys):
    from opsd.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _point(step: int, acc: float, sets: dict | None = None) -> dict:
    return {"step": step, "accuracy": acc, "generated_tokens": 0, "train_seconds": 0.0, "sets": sets}


def _sets(test: float, kept: float, drift: float) -> dict:
    return {
        "test": {"accuracy": test, "correct": [test] * 4, "drift": None, "seen": None, "other": None},
        "retention": {"accuracy": kept, "correct": [kept] * 4, "drift": drift, "seen": 1.0, "other": 0.5},
    }


def test_each_run_reports_its_sets_at_the_step_it_picked_on_eval_path(tmp_path):
    """The chosen step is the first at the run's highest eval.path accuracy (where the sets were
    evaluated), never the last or a step chosen on the sets; the frontier plot has every run."""
    from opsd.compare.report import chosen_block, plot_frontier

    base = _point(0, 0.0, _sets(0.0, 0.8, 0.0))
    runs = [
        {
            "method": "opsd_1e-4",
            "seed": 0,
            "lr": 1e-4,
            "points": [base, _point(25, 0.3, _sets(0.25, 0.7, 0.1)), _point(50, 0.2), _point(75, 0.3)],
        },
        {
            "method": "sft_5e-5",
            "seed": 0,
            "lr": 5e-5,
            "points": [base, _point(25, 0.1, _sets(0.5, 0.4, 0.9))],
        },
    ]
    variants = {
        "opsd_1e-4": {"method": "opsd", "overrides": ["optim.lr=1e-4"]},
        "sft_5e-5": {"method": "sft", "overrides": ["optim.lr=5e-5"]},
    }
    result = {"runs": runs, "variants": variants, "methods": ["opsd_1e-4", "sft_5e-5"], "lr": {"opsd": 1e-4}}
    lines = chosen_block(result)
    opsd_row = next(line for line in lines if line.startswith("| OPSD") and "0.0001" in line)
    assert "| 25 | 30.0% | 25.0% | 70.0% | 100.0% / 50.0% | 0.1000 |" in opsd_row
    assert any(line.startswith("| OPSD") and "| base | +25.0 [+25.0, +25.0] |" in line for line in lines)
    assert plot_frontier(tmp_path / "frontier.png", result).is_file()
    assert chosen_block({**result, "runs": [{**r, "points": [_point(0, 0.0)]} for r in runs]}) == []
