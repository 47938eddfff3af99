"""`opsd eval`: metrics on scripted completions, end to end on a tiny random model, and bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from helpers import SHARED_DATA, cli_error

from opsd.cli import main
from opsd.config import DataConfig, EvalCommand, EvalConfig, load_config
from opsd.data import Example, RowKeys, load_examples, student_prompt_ids
from opsd.errors import UserError
from opsd.eval import EvalResult, EvalRun, evaluate_model
from opsd.eval.cli import add_eval_arguments, evaluate, format_eval_table, run_eval
from opsd.grading import GRADERS, Grade
from opsd.rollout import Completion

ROWS = [
    {"problem": "What is 1/2 as a decimal?", "answer": "0.5"},
    {
        "problem": "Natalia sold 48 clips in April and half as many in May. Total?",
        "answer": "Sold 24 in May.\n#### 72",
    },
    {"problem": "What is 2 + 3?", "answer": 5},
]


class ScriptedEngine:
    """Returns fixed response texts per prompt, cycling through `responses[prompt_text]`."""

    def __init__(self, tokenizer, scripts: dict[int, list[tuple[str, str]]]) -> None:
        self.tokenizer, self.scripts, self.calls = tokenizer, scripts, []

    def generate(self, prompts, n, params):
        self.calls.append((len(prompts), n, params.seed))
        out = []
        for i, p in enumerate(prompts):
            key = next(k for k in self.scripts if self.scripts[k][0][0] in self.tokenizer.decode(p))
            for text, reason in self.scripts[key][1 : n + 1]:
                ids = self.tokenizer.encode(text)
                out.append(Completion(i, ids, [-1.0] * len(ids), reason))
        return out


def _examples() -> list[Example]:
    return [Example(r["problem"], "", str(r["answer"]), i) for i, r in enumerate(ROWS)]


def _command(model: Path | str, data: Path | str, *keys: str) -> EvalCommand:
    """`opsd eval`'s settings for ``model`` on ``data``, with dotted ``keys`` on top."""
    return load_config(None, [f"model.path={model}", f"eval.path={data}", *keys], schema=EvalCommand)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_metrics_on_scripted_completions(tiny_tokenizer) -> None:
    scripts = {
        0: [
            ("1/2 as a decimal", ""),
            (r"\boxed{\frac{1}{2}}", "stop"),
            (r"\boxed{0.4}", "stop"),
            ("no box", "length"),
        ],
        1: [("Natalia", ""), (r"\boxed{72}", "stop"), (r"\boxed{72}", "stop"), (r"\boxed{072}", "stop")],
        2: [("2 + 3", ""), (r"\boxed{6}", "stop"), (r"\boxed{6", "length"), (r"\boxed{4}", "stop")],
    }
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    run = EvalRun(engine=engine, name="scripted", seed=7)
    res = evaluate_model(None, tiny_tokenizer, _examples(), EvalConfig(k=3, temperature=0.6), run=run)
    assert engine.calls == [(3, 3, 7)]  # non-HF engines get every prompt in one call
    assert res.num_problems == 3 and res.k == 3
    assert res.avg_at_k == pytest.approx(4 / 9)
    assert res.pass_at_k == pytest.approx(2 / 3)
    assert res.truncated_frac == pytest.approx(2 / 9)
    assert res.no_answer_frac == pytest.approx(2 / 9)  # "no box" and the unbalanced \boxed{6
    assert res.grading_errors == 0
    assert [it["num_correct"] for it in res.items] == [1, 3, 0]
    assert res.items[1]["gold_normalized"] == "72"
    assert res.items[0]["extracted"] == [r"\frac{1}{2}", "0.4", None]
    assert res.metrics()["eval/avg@3"] == pytest.approx(4 / 9)
    assert res.metrics()["eval/pass@3"] == pytest.approx(2 / 3)
    table = format_eval_table({"scripted": res})
    assert "avg@3" in table and "0.4444" in table and "0.6667" in table


def test_evaluate_model_on_live_tiny_model(tiny_model, tiny_tokenizer) -> None:
    """The trainer's path: a live model object, HF engine built inside, model left in training mode."""
    tiny_model.train()
    e = EvalConfig(k=2, temperature=0.6, max_new_tokens=4)
    res = evaluate_model(tiny_model, tiny_tokenizer, _examples(), e, run=EvalRun(batch_size=2, seed=1))
    assert tiny_model.training
    assert res.num_problems == 3
    for it in res.items:
        assert len(it["responses"]) == 2 and len(it["correct"]) == 2
        assert all(1 <= n <= 4 for n in it["response_tokens"])
        assert set(it["finish_reasons"]) <= {"stop", "length"}
    assert 0.0 <= res.avg_at_k <= res.pass_at_k <= 1.0
    again = evaluate_model(tiny_model, tiny_tokenizer, _examples(), e, run=EvalRun(batch_size=2, seed=1))
    assert [it["responses"] for it in again.items] == [it["responses"] for it in res.items]  # seeded


def test_evaluate_uses_the_training_prompt(tiny_model, tiny_tokenizer) -> None:
    seen = []

    class Spy:
        def generate(self, prompts, n, params):
            seen.extend(prompts)
            return [
                Completion(i, [tiny_tokenizer.eos_token_id], [0.0], "stop")
                for i in range(len(prompts))
                for _ in range(n)
            ]

    data = DataConfig(instruction="Box it.")
    evaluate_model(tiny_model, tiny_tokenizer, _examples()[:1], EvalConfig(), data, EvalRun(engine=Spy()))
    assert seen == [student_prompt_ids(tiny_tokenizer, ROWS[0]["problem"], instruction="Box it.")[0]]


@pytest.fixture
def tiny_model_dir(tmp_path: Path, tiny_model, tiny_tokenizer) -> Path:
    d = tmp_path / "tiny"
    tiny_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def test_cli_end_to_end_two_models(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write_jsonl(
        tmp_path / "data.jsonl", [{"question": r["problem"], "ans": r["answer"]} for r in ROWS]
    )
    p = argparse.ArgumentParser()
    add_eval_arguments(p)
    out = tmp_path / "out"
    args = p.parse_args(
        ["--model", str(tiny_model_dir), "--model", str(tiny_model_dir), "--data", str(data), "--k", "2"]
        + ["--max-new-tokens", "3", "--problem-key", "question", "--answer-key", "ans", "--limit", "2"]
        + ["--temperature", "0", "--out", str(out), "--no-thinking"]
    )
    assert args.enable_thinking is False
    assert run_eval(args) == 0
    printed = capsys.readouterr().out
    assert "tiny-2" in printed and "avg@2" in printed  # side-by-side rows, duplicate label disambiguated

    combined = json.loads((out / "summary.json").read_text())
    assert set(combined["models"]) == {"tiny", "tiny-2"}
    for label in ("tiny", "tiny-2"):
        summary = json.loads((out / f"{label}.summary.json").read_text())
        assert summary["num_problems"] == 2 and summary["k"] == 2
        assert summary["settings"]["temperature"] == 0 and summary["settings"]["enable_thinking"] is False
        assert summary["rows_in_file"] == 3
        lines = (out / f"{label}.items.jsonl").read_text().splitlines()
        assert len(lines) == 2
        items = [json.loads(x) for x in lines]
        assert items[1]["gold"] == "Sold 24 in May.\n#### 72" and items[1]["gold_normalized"] == "72"
        for it in items:
            assert {
                "problem",
                "gold",
                "responses",
                "extracted",
                "correct",
                "errors",
                "finish_reasons",
            } <= set(it)
            assert len(it["responses"]) == 2
            assert it["responses"][0] == it["responses"][1]  # greedy


def test_missing_answer_field_names_row_and_keys(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = _write_jsonl(
        tmp_path / "d.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "solution": "x"}]
    )
    with pytest.raises(ValueError, match=r"row 1.*'answer'.*available keys: \['problem', 'solution'\]"):
        evaluate(_command(tiny_model_dir, data))


def test_unreadable_model_path(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(UserError, match="nope"):
        evaluate(_command(tmp_path / "nope", data))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="empty_dir"):
        evaluate(_command(tmp_path / "empty_dir", data))


@pytest.mark.parametrize(
    "key, match",
    [
        ("eval.k=0", r"eval\.k.*got 0"),
        ("eval.k=-2", r"eval\.k.*got -2"),
        ("eval.limit=0", r"eval\.limit.*got 0"),
        ("eval.temperature=-1.0", r"eval\.temperature"),
        ("eval.top_p=0.0", r"eval\.top_p"),
        ("rollout.engine=tgi", "tgi"),
        ("rollout.engine=vllm_server", "hf or vllm"),
    ],
)
def test_bad_settings(tmp_path: Path, tiny_model_dir: Path, key: str, match: str) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(UserError, match=match):
        _command(tiny_model_dir, data, key)


def test_evaluate_model_rejects_k0_and_missing_gold(tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match="k"):
        evaluate_model(None, tiny_tokenizer, _examples(), EvalConfig(k=0))
    with pytest.raises(ValueError, match="no gold answer"):
        evaluate_model(None, tiny_tokenizer, [Example("q", "", None, 4)], EvalConfig())


@pytest.mark.shared_data
def test_shared_gsm8k_loads_for_eval() -> None:
    path = SHARED_DATA / "gsm8k_test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    rep = load_examples(
        str(path), RowKeys(problem="question", solution=None, answer="answer"), require_answer=True
    )
    assert len(rep.examples) == 1319
    from opsd.grading import normalize_gold

    assert normalize_gold(rep.examples[0].answer).isdigit()


def test_eval_result_summary_is_json(tiny_tokenizer) -> None:
    r = EvalResult("m", 1, 1, 1.0, 1.0, 3.0, 0.0, 0.0, 0, 0, 0.1, {"k": 1}, [{"x": 1}])
    s = r.summary()
    assert "items" not in s and json.loads(json.dumps(s))["avg_at_k"] == 1.0


# ----------------------------------------------------------------------------------------------
# A task's own grader and prompts (the demo's), and the CLI's configuration dialect and user errors


def test_custom_grader_and_prompts(tiny_tokenizer) -> None:
    """``grader`` replaces math-verify; ``prompts`` replace the student prompt, one per example."""
    scripts = {0: [("1/2 as a decimal", ""), ("half", "stop")], 1: [("Natalia", ""), ("72 clips", "stop")]}
    prompts = [
        student_prompt_ids(tiny_tokenizer, "1/2 as a decimal, with a hint", instruction="")[0],
        student_prompt_ids(tiny_tokenizer, "Natalia, with a hint", instruction="")[0],
    ]
    seen = []

    def by_first_word(response: str, gold: str) -> Grade:
        seen.append((response, gold))
        word = response.split()[0]
        return Grade(correct=word == gold, extracted=word, error=None)

    run = EvalRun(engine=ScriptedEngine(tiny_tokenizer, scripts), grader=by_first_word, prompts=prompts)
    res = evaluate_model(None, tiny_tokenizer, _examples()[:2], EvalConfig(), run=run)
    assert seen == [("half", "0.5"), ("72 clips", "Sold 24 in May.\n#### 72")]
    assert res.avg_at_k == 0.0 and res.no_answer_frac == 0.0
    assert res.items[1]["extracted"] == ["72"]
    assert res.settings["grader"].endswith("by_first_word")
    with pytest.raises(ValueError, match="one per example"):
        evaluate_model(None, tiny_tokenizer, _examples(), EvalConfig(), run=EvalRun(prompts=prompts))


def test_config_file_and_overrides(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`opsd eval --config eval.yaml key=value`, the dialect and the sections of `opsd train`; flags are
    shorthands for those keys."""
    from opsd.config import flag_overrides
    from opsd.eval.cli import EVAL_FLAGS

    cfg_path = tmp_path / "eval.yaml"
    cfg_path.write_text(f"model:\n  path: {tiny_model_dir}\neval:\n  path: d.jsonl\n  k: 4\n")
    cfg = load_config(cfg_path, ["eval.temperature=0", "eval.limit=2"], schema=EvalCommand)
    assert cfg.model_paths() == [str(tiny_model_dir)] and cfg.eval.k == 4
    assert cfg.eval.temperature == 0 and cfg.eval.limit == 2 and cfg.eval.top_p == 0.95
    assert load_config(cfg_path, schema=EvalCommand).eval.temperature == 0.6  # the command's default
    assert cfg.eval.grader == "math"
    assert load_config(cfg_path, ["eval.grader=lenient"], schema=EvalCommand).eval.grader == "lenient"
    for name in GRADERS:  # every grader training's eval.grader names
        assert load_config(cfg_path, [f"eval.grader={name}"], schema=EvalCommand).eval.grader == name

    p = argparse.ArgumentParser()
    add_eval_arguments(p)
    args = p.parse_args(["--model", "a", "b", "eval.k=3", "--data", "1e5.jsonl", "--no-thinking"])
    assert args.model == ["a", "b", "eval.k=3"]  # argparse's view; run_eval hands eval.k=3 back
    flags = flag_overrides(args, EVAL_FLAGS)
    assert 'eval.path="1e5.jsonl"' in flags and "data.student_thinking=false" in flags
    cfg = load_config(None, ["model.path=a", *flags], schema=EvalCommand)
    assert cfg.eval.path == "1e5.jsonl"  # a file name stays a string, not the number 100000.0
    with pytest.raises(UserError, match=r"eval\.tempreature"):
        load_config(cfg_path, ["eval.tempreature=0"], schema=EvalCommand)
    with pytest.raises(UserError, match=r"data\.path.*eval\.path"):
        load_config(cfg_path, ["data.path=d.jsonl"], schema=EvalCommand)


def test_grader_from_a_module_as_in_training(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """`opsd eval --grader mod:fn` is training's ``eval.grader: mod:fn``: one key, one resolution."""
    (tmp_path / "my_grader_mod.py").write_text("def every_answer(response, gold):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out)]
    argv += ["--grader", "my_grader_mod:every_answer", "--max-new-tokens", "2", "--limit", "2"]
    assert main(argv) == 0
    summary = json.loads((out / "tiny.summary.json").read_text())
    assert summary["avg_at_k"] == 1.0 and summary["num_problems"] == 2
    train_keys = ["data.path=t.jsonl", f"eval.path={data}", "eval.grader=my_grader_mod:every_answer"]
    from opsd.config import Config

    assert load_config(None, train_keys, schema=Config).eval.grader == "my_grader_mod:every_answer"
    err = "eval.grader=my_grader_mod:nothing_here"
    with pytest.raises(UserError, match="nothing_here"):
        evaluate(_command(tiny_model_dir, data, err))


def test_cli_config_and_stray_override(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "out"
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(f"eval:\n  path: {data}\n  max_new_tokens: 2\n  temperature: 0\n")
    argv = ["eval", "--config", str(cfg), "--out", str(out), "--model", str(tiny_model_dir), "eval.limit=1"]
    assert main(argv) == 0
    summary = json.loads((out / "tiny.summary.json").read_text())
    assert summary["num_problems"] == 1 and summary["settings"]["max_new_tokens"] == 2
    assert summary["settings"]["temperature"] == 0


def test_cli_user_errors(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    good = str(_write_jsonl(tmp_path / "d.jsonl", ROWS))
    model = ["--model", str(tiny_model_dir)]
    missing = str(tmp_path / "missing.jsonl")
    assert missing in cli_error(capsys, ["eval", *model, "--data", missing])
    nope = str(tmp_path / "no_such_model")
    assert "no_such_model" in cli_error(capsys, ["eval", "--model", nope, "--data", good])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": \n')
    err = cli_error(capsys, ["eval", *model, "--data", str(bad)])
    assert "bad.jsonl" in err and "line 2" in err
    no_answers = _write_jsonl(tmp_path / "no_answers.jsonl", [{"problem": "a", "solution": "x"}])
    err = cli_error(capsys, ["eval", *model, "--data", str(no_answers)])
    assert "no_answers.jsonl" in err and "'answer'" in err
    assert "eval.k" in cli_error(capsys, ["eval", *model, "--data", good, "eval.k=0"])
    assert "model.path" in cli_error(capsys, ["eval", "--data", good])
    err = cli_error(capsys, ["eval", *model, "--data", good, "--device", "gpu"])
    assert "device" in err and "cuda:N" in err  # opsd.devices' spelling check, as for `opsd train`
    if not torch.cuda.is_available():
        assert "device=cpu" in cli_error(capsys, ["eval", *model, "--data", good, "--device", "cuda"])


def test_cli_takes_the_cpu_section(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """`opsd eval` reads training's ``cpu`` section: its plan lays the weights out and tunes the engine
    (``cpu.tuning: off`` is the plain path), and a mistyped key is refused."""
    import opsd.eval.cli as eval_cli

    plans = []
    real = eval_cli.make_engine

    def spy(*a, **kw):
        plans.append(kw["run"].plan)
        return real(*a, **kw)

    monkeypatch.setattr(eval_cli, "make_engine", spy)
    data = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    argv = ["eval", "--model", str(tiny_model_dir), "--data", str(data)]
    keys = ["eval.max_new_tokens=2", "eval.limit=1", "device=cpu"]
    assert main([*argv, "--out", str(tmp_path / "auto"), *keys]) == 0
    assert main([*argv, "--out", str(tmp_path / "off"), *keys, "cpu.tuning=off"]) == 0
    auto, off = plans
    assert not auto.empty and auto.static_cache and not auto.pack_rows  # nothing trains: nothing packed
    assert off.empty and "cpu.tuning=off" in off.notes
    with pytest.raises(UserError, match=r"cpu\.tunning"):
        load_config(None, ["model.path=m", "eval.path=d", "cpu.tunning=off"], schema=EvalCommand)
