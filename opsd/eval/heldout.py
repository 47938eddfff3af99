"""Evaluation during training: held-out accuracy, and the held-out divergence (the distillation loss
the current student would have on problems it never trains on; where accuracy is near zero, this is
the number that moves)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from opsd.data import Example, make_sample, student_prompt_ids
from opsd.distributed import all_reduce_sum, rank_seed
from opsd.eval.loop import EvalResult, EvalRun, evaluate_model, evaluate_sharded
from opsd.eval.sets import HeldoutSet, SetResult, artifact_share, build_reference, evaluate_set, logits_of
from opsd.loss import LossStats
from opsd.microbatch import forward_backward
from opsd.rollout.base import SamplingParams
from opsd.teacher import Teacher


def heldout_accuracy(
    model: nn.Module, tokenizer, examples: list[Example], cfg, engine, grader: Callable, rank: int, world: int
) -> EvalResult:
    """The live model's accuracy on the held-out problems, without privileged information, sharded over
    ranks (the result's figures global, its items this rank's); ``engine``: the trainer's rollout
    engine, asleep again after."""
    run = EvalRun(engine=engine, grader=grader, seed=rank_seed(cfg.seed, rank))
    res = evaluate_sharded(model, tokenizer, examples, cfg.eval, cfg.data, run, rank, world)
    # generate() woke it: the checkpoint save and the next step run without vLLM resident
    engine.sleep()
    return res


def solution_accuracy(
    model: nn.Module, tokenizer, examples: list[Example], prompts: Callable, cfg, engine, grader: Callable
) -> EvalResult:
    """The live model's greedy accuracy, one response each, with each problem's solution in its prompt
    (``prompts(i, example)``' teacher prompt): what a teacher reading the solution gets right, the
    ceiling of what it can pass on. Every rank evaluates every problem; ``engine`` asleep again after."""
    greedy = cfg.eval.model_copy(update={"k": 1, "temperature": 0.0})
    shown = [prompts(i, ex)[1] for i, ex in enumerate(examples)]
    run = EvalRun(engine=engine, grader=grader, seed=cfg.seed, prompts=shown, name="teacher")
    res = evaluate_model(model, tokenizer, examples, greedy, run=run)
    engine.sleep()
    return res


@dataclass
class DivergenceStep:
    """How a training step scores samples, which the held-out divergence repeats without a gradient:
    its micro-batches, its distillation loss and the forwards' autocast."""

    microbatches: Callable
    loss_fn: Callable
    autocast: Callable


@torch.no_grad()
def heldout_divergence(
    model: nn.Module,
    teacher: Teacher,
    examples: list[Example],
    prompts: Callable,
    generate: Callable,
    step: DivergenceStep,
    rank: int,
    world: int,
) -> dict:
    """One sampled response per held-out problem (``generate(prompts, n=1)``: the rollout's settings,
    one seed for every evaluation), scored by the teacher with the held-out solutions as a training
    step scores it (``step``), with no gradient and the model in eval mode (no
    dropout in a metric, no draws from the training RNG). Collective: every rank scores its share."""
    training = model.training
    model.eval()
    try:
        mine = list(range(rank, len(examples), world))
        pairs = [prompts(i, examples[i]) for i in mine]
        completions = generate([student for student, _ in pairs])
        samples = [
            make_sample(*pairs[c.prompt_index], c.token_ids, mine[c.prompt_index], c.finish_reason)
            for c in completions
            if c.token_ids
        ]
        loss_sum, stats = forward_backward(
            model, teacher, step.microbatches(samples), step.loss_fn, autocast=step.autocast, backward=False
        )
    finally:
        model.train(training)
    total = LossStats.from_tensor(all_reduce_sum(stats.as_tensor()))
    return {"loss": float(all_reduce_sum(loss_sum)), **total.means()}


__all__ = [
    "DivergenceStep",
    "EvalResult",
    "SetResult",
    "artifact_share",
    "drift_references",
    "evaluate_set",
    "heldout_accuracy",
    "heldout_divergence",
    "logits_of",
    "solution_accuracy",
]


def drift_references(sets: list[HeldoutSet], engine, tokenizer, logits: Callable, cfg, rank: int) -> None:
    """Each drift set's reference (:func:`opsd.eval.sets.build_reference`): the initial model's greedy
    answers at eval.max_new_tokens to its student prompts, as the held-out evaluation builds them, and
    its log-probs there; call before any step or resume moves the weights."""
    d = cfg.data

    def greedy(prompts: list[list[int]]) -> list:
        params = SamplingParams(temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens, seed=cfg.seed)
        engine.wake()
        completions = engine.generate(prompts, 1, params)
        engine.sleep()
        return completions

    for s in sets:
        if s.drift:
            prompts = [
                student_prompt_ids(
                    tokenizer, ex.problem, instruction=d.instruction, enable_thinking=d.student_thinking
                )[0]
                for ex in s.examples
            ]
            s.reference = build_reference(s, greedy, prompts, logits, cfg, rank)
