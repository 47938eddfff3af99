"""Every user mistake of `opsd train` is one line naming the thing, a non-zero exit, no traceback."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import ROOT

from opsd.cli import main
from opsd.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("errs")
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [
        {"problem": f"What is {a} + 1?", "solution": f"{a} + 1 = {a + 1}.", "answer": str(a + 1)}
        for a in range(4)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "noanswers.jsonl").write_text("".join(json.dumps({"problem": r["problem"]}) + "\n" for r in rows))
    cfg = {
        "model": {"path": str(root / "model"), "lora": {"r": 4, "alpha": 8}},
        "data": {"path": str(root / "train.jsonl"), "max_prompt_len": 128},
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 4},
        "optim": {"max_steps": 1},
        "logging": {"progress": False, "sample_every": 0},
        "device": "cpu",
    }
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    return {"root": root, "config": str(root / "run.yaml")}


def _train(setup, tmp_path, *overrides: str) -> list[str]:
    # rollout.engine=hf: the tiny model (head_dim 8) is one vLLM-CPU cannot serve where vLLM is installed
    run = ["train", "--config", setup["config"], f"logging.run_dir={tmp_path / 'run'}", "rollout.engine=hf"]
    return [*run, *overrides]


def _one_line_error(capsys, code: int, *needles: str, status: int = 2) -> str:
    err = capsys.readouterr().err
    assert code == status, err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("opsd "))
    for n in needles:
        assert n in line, (n, line)
    return line


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("data.path=my_dataset_that_does_not_exist", ["my_dataset_that_does_not_exist"]),
        ("data.path=runs/typo/train.jsonl", ["runs/typo/train.jsonl", "no such"]),
        ("model.path=no_such_model", ["no_such_model"]),
        ("model.path=models/typo/dir", ["models/typo/dir"]),
        ("device=gpu", ["device", "gpu"]),
        ("loss.beta=7", ["loss.beta", "7"]),
        ("optim.max_stepz=3", ["optim.max_stepz"]),
    ],
)
def test_train_user_mistakes(setup, tmp_path, capsys, monkeypatch, override, needles):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _one_line_error(capsys, main(_train(setup, tmp_path, override)), *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(setup, tmp_path, capsys):
    _one_line_error(capsys, main(_train(setup, tmp_path, "device=cuda")), "device=cuda", "device=cpu")


def test_eval_data_without_answers_fails_at_startup(setup, tmp_path, capsys):
    noans = str(setup["root"] / "noanswers.jsonl")
    code = main(_train(setup, tmp_path, f"eval.path={noans}", "eval.every=1"))
    _one_line_error(capsys, code, "noanswers.jsonl", "answer")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was spent before the error


def test_full_disk_during_save(setup, tmp_path, capsys, monkeypatch):
    import opsd.checkpoint as ck

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", no_space)
    line = _one_line_error(
        capsys, main(_train(setup, tmp_path)), "failed", "disk full", str(tmp_path / "run"), status=1
    )
    assert "no earlier checkpoint" in line
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_missing_config_and_resume_dir(setup, tmp_path, capsys):
    _one_line_error(capsys, main(["train", "--config", str(tmp_path / "nope.yaml")]), "nope.yaml")
    _one_line_error(capsys, main(["train", "--resume", str(tmp_path / "nope")]), "nope")


def test_debug_shows_the_traceback(setup, tmp_path):
    cmd = [sys.executable, "-m", "opsd.cli", "--debug", *_train(setup, tmp_path, "device=gpu")]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "Traceback" in res.stderr and "UserError" in res.stderr


def test_a_row_without_its_target_is_named(setup, tmp_path, capsys):
    """data.target_key: every row needs the field; the one that lacks it is named with its file."""
    rows = [
        {"problem": "What is 1 + 1?", "solution": "1 + 1 = 2.", "target": "2."},
        {"problem": "What is 2 + 2?", "solution": "2 + 2 = 4."},
    ]
    path = tmp_path / "targets.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(_train(setup, tmp_path, f"data.path={path}", "objective=sft", "data.target_key=target"))
    _one_line_error(capsys, code, str(path), "line 2 (row 1)", "'target'")


def test_an_eval_set_without_answers_is_named_before_any_step(setup, tmp_path, capsys):
    noans = str(setup["root"] / "noanswers.jsonl")
    train = str(setup["root"] / "train.jsonl")
    code = main(_train(setup, tmp_path, f"eval.path={train}", f"eval.sets.extra.path={noans}"))
    _one_line_error(capsys, code, noans, "row 0", "'answer'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["eval.path={train}", "eval.sets.my-set.path={train}"],
            ["eval.sets.my-set", "letters, digits and _"],
        ),
        (["data.sft_targets=teacher"], ["data.sft_targets=teacher", "objective=sft"]),
    ],
    ids=["set-name", "sft-targets"],
)
def test_eval_set_and_sft_target_settings_are_checked(setup, tmp_path, capsys, overrides, needles):
    train = str(setup["root"] / "train.jsonl")
    code = main(_train(setup, tmp_path, *(o.format(train=train) for o in overrides)))
    _one_line_error(capsys, code, *needles)
