"""The paper's recipe (examples/qwen3-1.7b-reference.yaml), its evaluation configs (examples/eval/) and
the commands of docs/reproduce.md: the settings as published, one step of the recipe on a tiny model,
and every documented `opsd eval` command parsed to the evaluation it runs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SHARED_DATA
from qwen3_tiny import ASSISTANT_TURN, EMPTY_THINK_BLOCK, save_qwen3_assets

import opsd.eval.cli as eval_cli
from opsd import Trainer, load_config
from opsd.cli import main
from opsd.config import EvalCommand
from opsd.data import RowKeys, load_examples
from opsd.eval import EvalResult

RECIPE = ROOT / "examples" / "qwen3-1.7b-reference.yaml"
EVAL_CONFIGS = {name: ROOT / "examples" / "eval" / f"{name}.yaml" for name in ("aime24", "aime25", "hmmt25")}
EVAL_FILES = {"aime24": "aime24.jsonl", "aime25": "aime25.jsonl", "hmmt25": "hmmt25_feb.jsonl"}
REPRODUCE = ROOT / "docs" / "reproduce.md"
SHARED = SHARED_DATA
THINKING_BUDGET = 38912


def test_the_recipe_has_the_papers_settings():
    cfg = load_config(RECIPE)
    assert cfg.model.path == "Qwen/Qwen3-1.7B"
    lora = cfg.model.lora
    assert lora.enabled and (lora.r, lora.alpha, lora.target_modules) == (64, 128, "all-linear")
    assert cfg.teacher.mode == "fixed"  # with LoRA: the base weights, adapter disabled
    r = cfg.rollout
    assert (r.engine, r.prompts_per_step, r.n, r.max_new_tokens) == ("vllm", 32, 1, 1024)
    assert (r.temperature, r.top_p, r.top_k) == (1.1, 0.95, 20)
    assert (cfg.loss.mode, cfg.loss.beta, cfg.loss.clip_mode, cfg.loss.clip) == ("jsd", 0.0, "entry", 0.05)
    assert cfg.loss.temperature is None  # the loss takes the rollout's 1.1
    o = cfg.optim
    assert (o.lr, o.grad_clip, o.max_steps) == (5e-6, 0.1, 100)
    assert (cfg.data.student_thinking, cfg.data.teacher_thinking) == (False, True)
    assert cfg.checkpoint.every == 25 and cfg.checkpoint.keep_last >= 4  # steps 25, 50, 75, 100 all kept
    assert cfg.checkpoint.save_merged  # what `opsd eval` and vLLM load


def test_the_recipe_runs_one_step_on_a_tiny_model(tmp_path):
    assets = save_qwen3_assets(tmp_path)
    overrides = [
        f"model.path={assets['model']}",
        f"data.path={assets['data']}",
        f"logging.run_dir={tmp_path / 'run'}",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=8",
        "rollout.engine=hf",
        "optim.max_steps=1",
        "device=cpu",
        "logging.progress=false",
    ]
    cfg = load_config(RECIPE, overrides)
    recipe = load_config(RECIPE)
    for section in ("loss", "teacher"):  # nothing else of the recipe was overridden
        assert getattr(cfg, section) == getattr(recipe, section), section
    assert cfg.model.lora == recipe.model.lora and cfg.model.dtype == "bfloat16"
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.optim.lr) == (1.1, 20, 5e-6)
    tr = Trainer(cfg)
    before = [p.detach().clone() for p in tr.run.params]
    hist = tr.train()
    assert len(hist) == 1 and torch.isfinite(torch.tensor(hist[0]["loss"]))
    assert any(not torch.equal(a, p) for a, p in zip(before, tr.run.params, strict=True)), "nothing trained"
    s_ids, t_ids = next(iter(tr.run.prompts._cache.values()))
    assert tr.run.tokenizer.decode(s_ids).endswith(
        ASSISTANT_TURN + EMPTY_THINK_BLOCK
    )  # student: thinking off
    assert tr.run.tokenizer.decode(t_ids).endswith(ASSISTANT_TURN)  # teacher: thinking on
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("step") == 1 for m in metrics)


@pytest.mark.parametrize("name", sorted(EVAL_CONFIGS))
def test_eval_configs_are_avg_at_12_with_thinking_at_the_budget(name):
    cfg = load_config(EVAL_CONFIGS[name], schema=EvalCommand)
    e = cfg.eval
    assert e.k == 12 and cfg.data.student_thinking is True
    assert Path(e.path).name == EVAL_FILES[name]
    assert cfg.rollout.engine == "vllm"
    assert (e.temperature, e.top_p, e.max_new_tokens) == (0.6, 0.95, THINKING_BUDGET)
    # HMMT's rows already carry the \boxed{} instruction; the AIME rows get it appended
    assert (cfg.data.instruction == "") is (name == "hmmt25")


@pytest.mark.shared_data
@pytest.mark.parametrize("name", sorted(EVAL_FILES))
def test_eval_data_has_the_keys_the_configs_read(name):
    path = SHARED / EVAL_FILES[name]
    if not path.exists():
        pytest.skip(f"{path} not present")
    cfg = load_config(EVAL_CONFIGS[name], schema=EvalCommand)
    rep = load_examples(
        str(path),
        RowKeys(problem=cfg.data.problem_key, solution=None, answer=cfg.eval.answer_key),
        split=cfg.eval.split,
        require_answer=True,
    )
    assert len(rep.examples) == 30
    has_instruction = ["\\boxed{}" in ex.problem for ex in rep.examples]
    assert all(has_instruction) if name == "hmmt25" else not any(has_instruction)


def _documented_eval_commands() -> list[list[str]]:
    """Every `opsd eval` command line in docs/reproduce.md's shell blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", REPRODUCE.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["opsd", "eval"]:
                commands.append(words[1:])
    return commands


def test_reproduce_md_eval_commands_run_avg_at_12_with_thinking(monkeypatch):
    calls = []

    def fake_evaluate(cfg, out_dir=None, progress=False):
        calls.append(cfg)
        return {"m": EvalResult("m", cfg.eval.k, 30, 0.5, 0.9, 100.0, 0.0, 0.0, 0, 0, 1.0)}

    monkeypatch.setattr(eval_cli, "evaluate", fake_evaluate)
    monkeypatch.chdir(ROOT)  # the commands run from the repository root; the fake evaluate writes nothing
    commands = _documented_eval_commands()
    assert len(commands) >= 3, commands
    for argv in commands:
        assert main(argv) == 0, argv
    assert {Path(c.eval.path).name for c in calls} >= set(EVAL_FILES.values())
    for c in calls:
        e = c.eval
        assert e.k == 12 and c.data.student_thinking is True and e.max_new_tokens == THINKING_BUDGET
        assert c.rollout.engine == "vllm" and e.temperature in (0.6, 1.0)
        models = c.model_paths()
        assert "Qwen/Qwen3-1.7B" in models and len(models) >= 2  # the base beside a checkpoint
