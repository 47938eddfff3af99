"""Config loading, overrides and the combinations that are refused up front."""

from __future__ import annotations

import pytest
import yaml
from helpers import ROOT

from opsd.config import Config, load_config, save_config
from opsd.errors import UserError

EXAMPLES = ROOT / "examples"


def test_yaml_plus_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"data": {"path": "x.jsonl"}, "loss": {"beta": 0.5}}))
    cfg = load_config(
        p,
        [
            "loss.beta=0",
            "optim.lr=5e-6",
            "rollout.stop_strings=['</s>']",
            "data.solution_key=null",
            "teacher.privileged=false",
        ],
    )
    assert cfg.loss.beta == 0 and cfg.optim.lr == 5e-6 and cfg.rollout.stop_strings == ["</s>"]
    assert cfg.data.solution_key is None
    assert (
        cfg.loss.to_spec(cfg.rollout.temperature).temperature == cfg.rollout.temperature
    )  # defaults to sampling's


def test_an_override_with_a_colon_in_a_sentence_is_the_sentence():
    """YAML reads "a: b" as a mapping; on the command line a mapping is written in braces, so a string
    key's text with ": " in it stays the text, and a braced mapping stays a mapping."""
    cfg = load_config(
        None,
        [
            "data.path=x.jsonl",
            "data.instruction=Solve it. Finish with: The answer is N.",
            "data.teacher_template=Note: {solution}: {problem}",
            "rollout.horizon={start: 8, end: 16, over_steps: 4}",
        ],
    )
    assert cfg.data.instruction == "Solve it. Finish with: The answer is N."
    assert cfg.data.teacher_template == "Note: {solution}: {problem}"
    assert cfg.rollout.horizon == {"start": 8, "end": 16, "over_steps": 4}
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(None, ["data.path=x.jsonl", "rollout.stop_strings=[a, b"])


def test_the_progress_bar_is_off_a_terminal_and_the_step_lines_stay(capsys):
    """In a log file the bar's carriage-return redraws would interleave with the step lines: off a
    terminal (pytest's captured stderr is none) only the lines are written, as the field's trainers do."""
    from opsd import metrics

    bar = metrics.progress_bar(10, 0, "opsd train", shown=True, end=10)
    assert bar.disable
    rec = {"step": 1, "loss": 0.5, "divergence": 0.5, "tokens_per_s": 10.0, "clip_frac": 0.0}
    rec |= {"agreement": 1.0, "overlap_mass": 1.0, "resp_len_mean": 4.0, "time_step": 1.0}
    metrics.show_step(bar, rec, lines=True)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err and "step     1" in err


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["data.path=x.jsonl", "loss.mode=topk", "loss.topk=20"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(example):
    assert isinstance(load_config(example), Config)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["loss.beta=1.5"], r"loss\.beta: .*less than or equal to 1"),
        (["loss.temperature=0"], r"loss\.temperature"),
        (["loss.mode=topk"], "loss: mode=topk needs topk >= 1"),
        (["loss.mode=sampled", "loss.clip_mode=entry"], "loss: mode=sampled needs clip_mode=none"),
        (["model.lora.enabled=false", "teacher.frozen_copy=none"], "frozen copy"),
        (["teacher.mode=external"], "teacher.path"),
        (["teacher.path=/x"], "only used with teacher.mode=external"),
        (["optim.lr=-1"], r"optim\.lr"),
        (["loss.bta=0"], r"loss\.bta: Extra inputs are not permitted"),
        (["rollout.engine=hf", "rollout.tensor_parallel_size=2"], "engine=vllm"),
        (["eval.every=5"], "eval.path"),
        (["data.solution_key=null"], "data.solution_key"),
        (["loss.clip_mode=sometimes"], r"loss\.clip_mode"),
        (["cpu.tuning=fast"], r"cpu\.tuning: Input should be 'auto' or 'off' \(got 'fast'\)"),
        (["cpu.tune_malloc=sometimes"], r"cpu\.tune_malloc: .*valid boolean"),
        (["rollout.fold_lora=maybe"], r"rollout\.fold_lora: Input should be 'auto', 'on' or 'off'"),
        (["loss.products=bf16"], r"loss\.products: Input should be 'auto' or 'float32'"),
        (["nokey"], "section.key=value"),
    ],
)
def test_bad_configs_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, ["data.path=x.jsonl", *overrides])


def test_cpu_tuning_bad_value_is_one_line_naming_the_key_and_the_choices():
    with pytest.raises(UserError) as e:
        load_config(None, ["data.path=x.jsonl", "cpu.tuning=fast"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == "invalid config: cpu.tuning: Input should be 'auto' or 'off' (got 'fast')"


def test_cpu_section_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["data.path=x.jsonl"])
    assert cfg.cpu.model_dump() == {
        "tuning": "auto",
        "pack_rows": True,
        "bucket_widths": True,
        "frozen_layout": True,
        "trim_heap": True,
        "tune_malloc": None,
    }
    assert cfg.rollout.fold_lora == "auto" and cfg.loss.products == "auto"
    cfg = load_config(
        None, ["data.path=x.jsonl", "cpu.tuning=off", "cpu.tune_malloc=false", "cpu.pack_rows=false"]
    )
    assert (cfg.cpu.tuning, cfg.cpu.tune_malloc, cfg.cpu.pack_rows) == ("off", False, False)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_bare_on_and_off_are_the_words_not_yaml_booleans(tmp_path):
    """YAML 1.1 reads a bare on/off as true/false; the settings spelled with those words take them back."""
    p = tmp_path / "run.yaml"
    p.write_text("data:\n  path: x.jsonl\ncpu:\n  tuning: off\nrollout:\n  fold_lora: on\n")
    cfg = load_config(p)
    assert (cfg.cpu.tuning, cfg.rollout.fold_lora) == ("off", "on")
    assert load_config(p, ["rollout.fold_lora=off"]).rollout.fold_lora == "off"
    with pytest.raises(UserError, match=r"cpu\.tuning: Input should be 'auto' or 'off' \(got 'on'\)"):
        load_config(p, ["cpu.tuning=on"])


def test_missing_data_path_and_file_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path is required"):
        load_config(None, [])
    with pytest.raises(UserError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)


def test_rollout_engine_auto_is_vllm_where_installed(monkeypatch):
    """One resolver for `auto`: vLLM (colocated) where it is installed, the HF engine otherwise; the
    log-prob check follows the engine that runs."""
    import importlib.util

    from opsd.config import RolloutConfig, resolve_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert resolve_engine("auto")[0] == "hf" and "not installed" in resolve_engine("auto")[1]
    assert not RolloutConfig(engine="auto", temperature=1.0).checks_logprobs(resolve_engine("auto")[0])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    assert resolve_engine("auto") == ("vllm", "rollout.engine=auto: vLLM is installed")
    assert RolloutConfig(engine="auto", temperature=1.0).checks_logprobs(resolve_engine("auto")[0])
    assert resolve_engine("hf")[0] == "hf"


@pytest.mark.parametrize(
    "objective, distill_coef, reads",
    [
        ("opsd", 0.0, True),
        ("rlsd", 0.0, True),
        ("grpo", 0.0, False),
        ("grpo", 0.5, True),
        ("sft", 0.0, False),
        ("sft", 0.5, False),
    ],
)
def test_reads_teacher_only_where_the_objective_scores_with_it(objective, distill_coef, reads):
    cfg = load_config(
        None,
        ["data.path=x.jsonl", f"objective={objective}", f"grpo.distill_coef={distill_coef}", "rollout.n=2"],
    )
    assert cfg.reads_teacher() is reads


def test_the_commands_read_the_training_sections_themselves():
    """`opsd eval` and `opsd sft` declare no section of their own: each key has one type and one
    validation in every command."""
    from opsd.config import EvalCommand, SFTCommand

    for schema in (EvalCommand, SFTCommand):
        shared = [n for n in schema.model_fields if n in Config.model_fields]
        assert {"seed", "device", "model", "data", "rollout", "cpu"} <= set(shared)
        for name in shared:
            assert schema.model_fields[name].annotation is Config.model_fields[name].annotation, name
    eval_keys = ["model.path=m", "eval.path=d.jsonl"]
    for bad, key in (("eval.k=0", "eval.k"), ("rollout.batch_size=0", "rollout.batch_size")):
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            load_config(None, [*eval_keys, bad], schema=EvalCommand)
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            load_config(None, ["data.path=d.jsonl", bad])
    with pytest.raises(UserError, match=r"eval\.path is required"):
        load_config(None, ["model.path=m"], schema=EvalCommand)
    with pytest.raises(UserError, match=r"out is required"):
        load_config(None, ["model.path=m", "data.path=d"], schema=SFTCommand)
