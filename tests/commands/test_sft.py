"""`opsd sft`: training's ``objective: sft`` on the training sections, the shared optimizer and schedule
(there and in the demo base's own loop), the YAML + overrides dialect, and one-line user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import cli_error

import opsd.optim
from opsd.cli import main
from opsd.optim import lr_factor

ROWS = [{"problem": f"What is {i} + {i}?", "solution": f"{i} + {i} = {2 * i}"} for i in range(6)]


@pytest.fixture
def tiny_model_dir(tmp_path: Path, tiny_model, tiny_tokenizer) -> Path:
    d = tmp_path / "tiny"
    tiny_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _data(tmp_path: Path, rows: list[dict] = ROWS) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_demo_base_loop_follows_the_shared_schedule(tiny_model, tiny_tokenizer, monkeypatch) -> None:
    """The LR at each step is opsd.optim.lr_factor's: one schedule for `opsd train`, `opsd sft` and the
    demo base's own SFT loop."""
    from opsd.demo.base import DemoSettings, demo_sft

    eos = [tiny_tokenizer.eos_token_id]
    pairs = [(tiny_tokenizer.encode("1+1="), tiny_tokenizer.encode("2") + eos)]
    lrs = []
    opt_holder = {}
    real = opsd.optim.make_optimizer

    def spy(params, optim):
        opt_holder["opt"], sched = real(params, optim)
        return opt_holder["opt"], sched

    monkeypatch.setattr(opsd.optim, "make_optimizer", spy)
    s = DemoSettings(sft_steps=8, sft_lr=1e-2, sft_batch=2, sft_schedule="cosine")
    losses = demo_sft(
        tiny_model,
        pairs,
        s,
        pad_id=0,
        warmup=3,
        progress=False,
        callback=lambda step, loss: lrs.append(opt_holder["opt"].param_groups[0]["lr"]),
    )
    # after step s the scheduler has moved to s: the LR the next step will use
    assert lrs == pytest.approx(
        [1e-2 * lr_factor(s, warmup=3, total=8, schedule="cosine") for s in range(1, 9)]
    )
    assert losses[-1] < losses[0]


def test_sft_is_trainings_objective_sft_with_the_shared_schedule(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`opsd sft` runs `opsd train objective=sft` on its sections: its run's metrics are training's, each
    step's LR opsd.optim.lr_factor's, and the model written to --out loads and differs from the start."""
    from opsd.config import SFTCommand, load_config
    from opsd.models import load_model

    out = tmp_path / "out"
    keys = ["optim.max_steps=4", "optim.warmup_steps=2", "rollout.prompts_per_step=2", "device=cpu"]
    argv = ["sft", "--model", str(tiny_model_dir), "--data", str(_data(tmp_path)), "--out", str(out), *keys]
    assert main([*argv, "--lr", "1e-2"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["objective"] == "sft" and saved["model"]["lora"]["enabled"] is False
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    # recorded after the step, as in the demo loop's test: the LR the next step will use
    assert lrs == pytest.approx(
        [1e-2 * lr_factor(s, warmup=2, total=4, schedule="cosine") for s in range(1, 5)]
    )
    trained = load_model(str(out))
    start = load_model(str(tiny_model_dir))
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters(), strict=True))
    cfg = load_config(None, ["model.path=m", "data.path=d", "out=o"], schema=SFTCommand).training_config()
    assert (cfg.objective, cfg.optim.lr, cfg.optim.scheduler, cfg.rollout.prompts_per_step) == (
        "sft",
        1e-5,
        "cosine",
        8,
    )


def test_cli_config_overrides_and_flags(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    cfg = tmp_path / "sft.yaml"
    out = tmp_path / "out"
    cfg.write_text(f"model:\n  path: {tiny_model_dir}\ndata:\n  path: {_data(tmp_path)}\n  instruction: ''\n")
    argv = ["sft", "--config", str(cfg), "--out", str(out), "optim.max_steps=2", "rollout.prompts_per_step=2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "6 rows, 2 steps" in printed and (out / "config.json").is_file()


def test_cli_user_errors(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    base = ["sft", "--model", str(tiny_model_dir), "--out", str(tmp_path / "out")]
    missing = str(tmp_path / "missing.jsonl")
    assert missing in cli_error(capsys, [*base, "--data", missing])
    no_solution = _data(tmp_path, [{"problem": "a", "answer": "1"}])
    assert "'solution'" in cli_error(capsys, [*base, "--data", str(no_solution)])
    assert "optim.lrr" in cli_error(capsys, [*base, "--data", str(_data(tmp_path)), "optim.lrr=1"])
    assert "no_such_model" in cli_error(
        capsys,
        ["sft", "--model", str(tmp_path / "no_such_model"), "--data", str(_data(tmp_path)), "--out", "x"],
    )
    assert "out" in cli_error(capsys, ["sft", "--model", str(tiny_model_dir), "--data", str(_data(tmp_path))])
    err = cli_error(capsys, [*base, "--data", str(_data(tmp_path)), "device=gpu"])
    assert "device" in err and "cuda:N" in err  # opsd.devices' spelling check, as for `opsd train`
    if not torch.cuda.is_available():
        assert "device=cpu" in cli_error(capsys, [*base, "--data", str(_data(tmp_path)), "device=cuda"])


def test_cli_takes_the_cpu_section(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """`opsd sft` reads training's ``cpu`` section: the plan it trains under is the section's."""
    import opsd.trainer

    plans = []
    real = opsd.trainer.Trainer.train

    def spy(self, *a, **kw):
        plans.append(self.run.plan)
        return real(self, *a, **kw)

    monkeypatch.setattr(opsd.trainer.Trainer, "train", spy)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model:\n  path: {tiny_model_dir}\ndata:\n  path: {_data(tmp_path)}\n  instruction: ''\n")
    keys = ["optim.max_steps=1", "rollout.prompts_per_step=2", "device=cpu", "model.dtype=bfloat16"]
    assert main(["sft", "--config", str(cfg), "--out", str(tmp_path / "a"), *keys]) == 0
    assert (
        main(["sft", "--config", str(cfg), "--out", str(tmp_path / "b"), *keys, "cpu.bucket_widths=false"])
        == 0
    )
    assert plans[0].bucket_widths and not plans[1].bucket_widths


def test_out_never_overlaps_the_model_or_the_data(tmp_path: Path) -> None:
    """``out`` is a run directory that ``--overwrite`` deletes: the data's or the model's place, a folder
    around them, or one inside the model's folder is refused before anything is loaded or removed."""
    from opsd.config import SFTCommand, load_config
    from opsd.errors import UserError

    data = tmp_path / "rows" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"problem": "1+1?", "solution": "2"}\n')
    model = tmp_path / "model"
    model.mkdir()
    cases = [
        (tmp_path, "model.path"),
        (data.parent, "data.path"),
        (model, "model.path"),
        (model / "out", "model.path"),
    ]
    for out, key in cases:
        with pytest.raises(UserError, match=rf"overlaps {key}") as info:
            load_config(None, [f"model.path={model}", f"data.path={data}", f"out={out}"], schema=SFTCommand)
        assert "\n" not in str(info.value)
    beside = tmp_path / "rows" / "out"  # beside the data file: --overwrite deletes only itself
    ok = load_config(None, [f"model.path={model}", f"data.path={data}", f"out={beside}"], schema=SFTCommand)
    assert ok.out == str(beside)


@pytest.mark.parametrize(
    "key",
    [
        "rollout.temperature=0",
        "rollout.top_p=1",
        "rollout.max_new_tokens=8",
        "data.split=validation",
        "data.answer_key=gold",
    ],
)
def test_eval_refuses_training_names_of_its_own_keys(key: str) -> None:
    """`opsd eval` reads temperature, top_p, max_new_tokens, split and answer_key from its `eval` section:
    set under the training sections' names they would be ignored, so each is refused, naming eval's."""
    from opsd.config import EvalCommand, load_config
    from opsd.errors import UserError

    name = key.split("=")[0].split(".")[1]
    with pytest.raises(UserError, match=rf"`opsd eval` reads eval\.{name}"):
        load_config(None, ["model.path=m", "eval.path=e.jsonl", key], schema=EvalCommand)
    assert load_config(
        None, ["model.path=m", "eval.path=e.jsonl", f"eval.{key.split('.', 1)[1]}"], schema=EvalCommand
    )
