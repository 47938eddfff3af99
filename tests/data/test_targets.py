"""What SFT imitates, kept apart from what the teacher reads: ``data.target_key`` (objective=sft, the
``loss.sft_coef`` anchor, `opsd sft --target-key`) and context distillation's targets
(``data.sft_targets: teacher``), generated with the privileged text in the prompt and trained without it."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
from helpers import build_assets, make_cfg

import opsd.setup
import opsd.trainer
from opsd.cli import main
from opsd.data import PromptBuilder, student_prompt_ids
from opsd.models import load_tokenizer
from opsd.trainer import Trainer

PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8)]
# The privileged text ("WORKED ...") and the target ("Sum ...") share no word: a pair holding any of the
# solution's text has read the wrong field.
ROWS = [
    {
        "problem": f"What is {a} + {b}?",
        "solution": f"WORKED {a} plus {b} makes {a + b} BIOGRAPHY",
        "target": f"Sum: {a + b}.",
        "answer": str(a + b),
    }
    for a, b in PAIRS
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("targets")
    out = build_assets(root)
    (root / "targets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return out | {"data": str(root / "targets.jsonl")}


def _student_prompt(tok, problem: str, cfg) -> list[int]:
    """The student's prompt as training builds it: the problem and the instruction, no solution."""
    return student_prompt_ids(tok, problem, instruction=cfg.data.instruction)[0]


def _target_pair(tok, row: dict, cfg) -> tuple[list[int], list[int]]:
    return _student_prompt(tok, row["problem"], cfg), tok.encode(row["target"]) + [tok.eos_token_id]


def test_objective_sft_trains_on_the_target_and_never_on_the_solution(assets, tmp_path) -> None:
    """Each row's pair is (student prompt, target + end token), and the queue hands exactly those
    tokens to training: none of the privileged text is in a prompt or a response."""
    cfg = make_cfg(assets, tmp_path / "run", objective="sft", **{"data.target_key": "target"})
    trainer = Trainer(cfg)
    try:
        tok, solutions = trainer.run.tokenizer, trainer.run.queue.solutions
        for i, row in enumerate(ROWS):
            prompt, response = solutions.pair(i)
            assert (prompt, response) == _target_pair(tok, row, cfg)
            assert "WORKED" not in tok.decode(prompt + response)
        ex_idx, prompts, completions, _ = trainer.run.queue.next(1, lambda name: nullcontext())
        assert len(ex_idx) == cfg.rollout.prompts_per_step
        for i, (student, teacher), c in zip(ex_idx, prompts, completions):
            assert student == teacher == _student_prompt(tok, ROWS[i]["problem"], cfg)
            assert c.token_ids == _target_pair(tok, ROWS[i], cfg)[1] and c.finish_reason == "stop"
    finally:
        trainer.close()


def test_the_sft_anchor_trains_on_the_target(assets, tmp_path) -> None:
    """``loss.sft_coef`` beside distillation: the teacher still reads the solution, the anchor's
    cross-entropy is on the target."""
    over = {"data.target_key": "target", "loss.sft_coef": "0.5", "optim.max_steps": 1}
    cfg = make_cfg(assets, tmp_path / "run", **over)
    trainer = Trainer(cfg)
    try:
        tok = trainer.run.tokenizer
        for i, row in enumerate(ROWS):
            assert trainer.run.anchor.pair(i) == _target_pair(tok, row, cfg)
        teacher = tok.decode(trainer.run.prompts(0, trainer.run.data.examples[0])[1])
        assert ROWS[0]["solution"] in teacher  # what the target is kept apart from
    finally:
        trainer.close()


def test_opsd_sft_target_key_trains_on_the_target(assets, tmp_path, monkeypatch) -> None:
    """`opsd sft --target-key target`: the pairs its training (``objective: sft``'s queue) takes are the
    targets'."""
    seen: list = []
    real = opsd.trainer.Trainer.close

    def spy(self):
        seen.append([self.run.queue.solutions.pair(i) for i in range(len(self.run.data.examples))])
        return real(self)

    monkeypatch.setattr(opsd.trainer.Trainer, "close", spy)
    argv = ["sft", "--model", assets["model"], "--data", assets["data"], "--out", str(tmp_path / "out")]
    keys = ["optim.max_steps=1", "rollout.prompts_per_step=2", "data.instruction=Add.", "device=cpu"]
    assert main([*argv, "--target-key", "target", *keys]) == 0
    cfg = make_cfg(assets, tmp_path / "unused", **{"data.instruction": "Add."})
    assert seen == [[_target_pair(load_tokenizer(assets["model"]), row, cfg) for row in ROWS]]


class Recording:
    """The rollout engine as :func:`opsd.anchor.teacher_answers` sees it, every generate call kept."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, params):
        out = self.engine.generate(prompts, n, params)
        self.calls.append((prompts, n, params, out))
        return out

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def _record_teacher_answers(monkeypatch) -> list[Recording]:
    engines: list[Recording] = []
    real = opsd.setup.teacher_answers

    def spy(engine, *args, **kw):
        engines.append(Recording(engine))
        return real(engines[-1], *args, **kw)

    monkeypatch.setattr(opsd.setup, "teacher_answers", spy)
    return engines


def test_context_distillation_generates_with_the_solution_and_trains_without_it(
    assets, tmp_path, monkeypatch
) -> None:
    """``data.sft_targets: teacher``: one greedy answer per training row from its teacher prompt (the
    solution in it), kept in sft_targets.jsonl; each training pair is the student prompt with those
    ids. A resumed run reads the file instead of generating again."""
    engines = _record_teacher_answers(monkeypatch)
    over = {"data.sft_targets": "teacher", "optim.max_steps": 2}
    cfg = make_cfg(assets, tmp_path / "run", objective="sft", **over)
    trainer = Trainer(cfg)
    try:
        tok = trainer.run.tokenizer
        ((prompts, n, params, completions),) = engines[0].calls
        builder = PromptBuilder(tok, cfg.data, privileged=True)
        assert prompts == [builder(i, ex)[1] for i, ex in enumerate(trainer.run.data.examples)]
        assert all(row["solution"] in tok.decode(p) for row, p in zip(ROWS, prompts))
        assert n == 1 and params.temperature == 0.0
        generated = {c.prompt_index: list(c.token_ids) for c in completions}
        assert sorted(generated) == list(range(len(ROWS))) and all(generated.values())
        for i, row in enumerate(ROWS):
            prompt, response = trainer.run.queue.solutions.pair(i)
            assert prompt == _student_prompt(tok, row["problem"], cfg)
            assert "WORKED" not in tok.decode(prompt)
            assert response == generated[i]  # max_new_tokens ids at most: nothing to cut
        reasons = {c.prompt_index: c.finish_reason for c in completions}
        ex_idx, _, queued, _ = trainer.run.queue.next(1, lambda name: nullcontext())
        for i, c in zip(ex_idx, queued):  # a stopped answer ends on its end token, a cut one is marked
            assert c.token_ids == generated[i] and c.finish_reason == reasons[i]
        cached = [json.loads(x) for x in (tmp_path / "run" / "sft_targets.jsonl").read_text().splitlines()]
        assert cached == [{"row": i, "token_ids": generated[i]} for i in range(len(ROWS))]
        trainer.train(until_step=1)
    finally:
        trainer.close()
    resumed = Trainer(cfg, resume=True)
    try:
        assert engines[1].calls == []  # read back, not generated again
        assert [resumed.run.queue.solutions.pair(i)[1] for i in range(len(ROWS))] == [
            generated[i] for i in range(len(ROWS))
        ]
    finally:
        resumed.close()


def test_the_teacher_answers_leave_the_heldout_prompts_alone(assets, tmp_path) -> None:
    """The held-out divergence reads held-out rows' teacher prompts by their index in eval.path: the
    training rows' prompts built for context distillation must not stand in for them."""
    heldout = tmp_path / "heldout.jsonl"
    rows = [{**r, "problem": f"Held out {r['problem']}", "solution": f"Other {r['solution']}"} for r in ROWS]
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {"data.sft_targets": "teacher", "eval.path": str(heldout), "eval.divergence": "true"}
    cfg = make_cfg(assets, tmp_path / "run", objective="sft", **over)
    trainer = Trainer(cfg)
    try:
        fresh = PromptBuilder(trainer.run.tokenizer, cfg.data, privileged=True)
        for i, ex in enumerate(trainer.run.data.eval_examples):
            assert trainer.run.eval_prompts(i, ex) == fresh(i, ex)
    finally:
        trainer.close()
