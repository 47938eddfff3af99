"""Thinking models: Qwen3's own chat template (tests/data, provenance in tests/qwen3_tiny.py) on the tiny
tokenizer, through the student's and teacher's prompts, evaluation at the thinking budget and a train step.

Qwen3 renders ``enable_thinking=True`` (and no flag) as a bare assistant turn, in which the model opens
its own ``<think>`` block; ``enable_thinking=False`` closes an empty block up front.
"""

from __future__ import annotations

import pytest
import torch
from qwen3_tiny import (
    ASSISTANT_TURN,
    EMPTY_THINK_BLOCK,
    QWEN3_CHAT_TEMPLATE,
    ROWS,
    THINK_TOKENS,
    VENDORED_MESSAGES,
    VENDORED_TARGET,
    qwen3_tokenizer,
    save_qwen3_assets,
)

from opsd import Trainer, load_config
from opsd.config import DataConfig, EvalConfig
from opsd.data import Example, PromptBuilder, student_prompt_ids, teacher_prompt_ids
from opsd.eval import EvalRun, evaluate_model
from opsd.rollout import Completion

THINKING_BUDGET = 38912  # Qwen3's recommended max_new_tokens for competition math in thinking mode


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def _user_turn(text: str) -> str:
    """The content of the (last) user turn of a rendered ChatML prompt."""
    start = text.rindex("<|im_start|>user\n") + len("<|im_start|>user\n")
    return text[start : text.index("<|im_end|>", start)]


def test_the_template_renders_as_its_vendored_expectation(tok):
    assert QWEN3_CHAT_TEMPLATE.startswith("{%- if tools %}") and QWEN3_CHAT_TEMPLATE.endswith("{%- endif %}")
    render = lambda **kw: tok.apply_chat_template(  # noqa: E731
        VENDORED_MESSAGES, tokenize=False, add_generation_prompt=True, **kw
    )
    assert render(enable_thinking=True) == VENDORED_TARGET
    assert render() == VENDORED_TARGET  # thinking is the template's default
    assert render(enable_thinking=False) == VENDORED_TARGET + EMPTY_THINK_BLOCK


def test_think_tags_are_single_tokens_and_any_text_round_trips(tok):
    for tag in THINK_TOKENS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    text = "Déjà vu: ∑ 7² <think>\nx\n</think>\n\n\\boxed{3}"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("flag", [True, None, False])
def test_student_prompt_thinking_on_leaves_the_block_to_the_model(tok, flag):
    ids, cut = student_prompt_ids(tok, "What is 1 + 2?", enable_thinking=flag)
    text = _text(tok, ids)
    assert not cut and _user_turn(text).startswith("What is 1 + 2?\n\nPlease reason step by step")
    if flag is False:
        assert text.endswith(ASSISTANT_TURN + EMPTY_THINK_BLOCK)
        block = tok.encode(EMPTY_THINK_BLOCK, add_special_tokens=False)
        assert ids[-len(block) :] == block and tok.convert_tokens_to_ids("<think>") in ids
    else:
        assert text.endswith(ASSISTANT_TURN) and "<think>" not in text


@pytest.mark.parametrize("flag", [True, False])
def test_teacher_prompt_holds_the_solution_inside_the_user_turn(tok, flag):
    solution = "We add: 1 + 2 = 3. The answer is \\boxed{3}."
    ids, _ = teacher_prompt_ids(tok, "What is 1 + 2?", solution, enable_thinking=flag)
    text = _text(tok, ids)
    user = _user_turn(text)
    assert "What is 1 + 2?" in user and solution in user
    after_user = text[text.rindex("<|im_start|>user\n") + len(user) :]
    assert solution not in after_user  # not spliced into the assistant turn
    assert text.endswith(ASSISTANT_TURN + (EMPTY_THINK_BLOCK if flag is False else ""))


@pytest.mark.parametrize("student, teacher", [(False, True), (True, True), (True, False)])
def test_prompt_builder_gives_each_side_its_own_thinking(tok, student, teacher):
    cfg = load_config(
        None,
        ["data.path=x.jsonl", f"data.student_thinking={student}", f"data.teacher_thinking={teacher}"],
    )
    build = PromptBuilder(tok, cfg.data, privileged=True)
    s_ids, t_ids = build(0, Example(ROWS[0]["problem"], ROWS[0]["solution"], ROWS[0]["answer"], 0))
    s_text, t_text = _text(tok, s_ids), _text(tok, t_ids)
    assert s_text.endswith(EMPTY_THINK_BLOCK) is (not student)
    assert t_text.endswith(EMPTY_THINK_BLOCK) is (not teacher)
    assert ROWS[0]["solution"] in _user_turn(t_text) and ROWS[0]["solution"] not in s_text


class RecordingEngine:
    """Answers every prompt with a boxed 3 and records what evaluation asked for."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, []
        self.answer = tok.encode("<think>\nadd\n</think>\n\n\\boxed{3}", add_special_tokens=False)

    def generate(self, prompts, n, params):
        self.calls.append((prompts, n, params))
        done = self.answer + [self.tok.eos_token_id]
        return [Completion(i, done, None, "stop") for i in range(len(prompts)) for _ in range(n)]


@pytest.mark.parametrize("flag", [True, False])
def test_evaluation_at_the_thinking_budget_passes_enable_thinking_to_the_template(tok, monkeypatch, flag):
    seen = []
    render = tok.apply_chat_template

    def spy(*args, **kwargs):
        seen.append(kwargs.get("enable_thinking", "absent"))
        return render(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    engine = RecordingEngine(tok)
    examples = [Example(r["problem"], "", r["answer"], i) for i, r in enumerate(ROWS[:2])]
    e = EvalConfig(k=12, temperature=0.6, top_p=0.95, max_new_tokens=THINKING_BUDGET)
    res = evaluate_model(None, tok, examples, e, DataConfig(student_thinking=flag), EvalRun(engine=engine))
    assert seen == [flag, flag]  # one render per problem, each with the flag
    ((prompts, n, params),) = engine.calls
    assert n == 12 and params.max_new_tokens == THINKING_BUDGET and params.temperature == 0.6
    for ids in prompts:
        assert _text(tok, ids).endswith(ASSISTANT_TURN + ("" if flag else EMPTY_THINK_BLOCK))
    assert res.settings["enable_thinking"] is flag and res.settings["max_new_tokens"] == THINKING_BUDGET
    # the response's thinking block is decoded with it and the answer after it still grades
    assert res.k == 12 and res.avg_at_k == 0.5 and res.items[0]["responses"][0].startswith("<think>")


@pytest.mark.parametrize("student", [False, True], ids=["student_off", "student_on"])
def test_a_train_step_with_the_qwen3_template(tmp_path, student):
    assets = save_qwen3_assets(tmp_path)
    cfg = load_config(
        None,
        [
            f"model.path={assets['model']}",
            f"data.path={assets['data']}",
            f"logging.run_dir={tmp_path / 'run'}",
            f"data.student_thinking={student}",
            "data.teacher_thinking=true",
            "model.dtype=float32",
            "model.lora.r=4",
            "model.lora.alpha=8",
            "rollout.engine=hf",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=6",
            "optim.max_steps=1",
            "checkpoint.enabled=false",
            "logging.progress=false",
            "device=cpu",
        ],
    )
    tr = Trainer(cfg)
    hist = tr.train()
    assert len(hist) == 1 and torch.isfinite(torch.tensor(hist[0]["loss"]))
    assert tr.run.prompts._cache, "no prompt was built"
    for s_ids, t_ids in tr.run.prompts._cache.values():
        s_text, t_text = _text(tr.run.tokenizer, s_ids), _text(tr.run.tokenizer, t_ids)
        assert s_text.endswith(ASSISTANT_TURN + ("" if student else EMPTY_THINK_BLOCK))
        assert t_text.endswith(ASSISTANT_TURN) and "BEGIN REFERENCE SOLUTION" in _user_turn(t_text)
