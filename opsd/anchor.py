"""The reference solutions as a supervised target: the SFT anchor beside OPSD, and the responses of
``objective: sft``.

The OPSD authors' own long run drifted: answers grew longer and repetitive and stopped ending; adding
the SFT loss on the reference answer, with its end-of-message token, fixed format and stopping. Here,
after the distillation loss's micro-batches, the student reads each of the step's problems followed by
its reference solution and its end token, and ``sft_coef`` times the token-mean cross-entropy of those
tokens is added to the loss (the same fused head kernel as GRPO's, so no ``[tokens, vocab]`` logits).
It is logged separately as ``sft_loss`` (the unscaled cross-entropy).

``objective: sft`` trains on the same pairs alone: :class:`SolutionQueue` hands the step each drawn
row's solution in place of a rollout, and :class:`opsd.objectives.SFT` takes the same loss.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from opsd.data import make_sample
from opsd.data.batching import MicroBatch
from opsd.objectives import solution_cross_entropy
from opsd.parallel import forward_hidden, full_head_weight
from opsd.rollout.base import Completion
from opsd.rollout.queue import RolloutQueue
from opsd.sft import sft_pairs_from_examples


class Solutions:
    """(student prompt, target + end token) per training row, tokenized once; a response that does
    not fit ``max_len`` is cut (:func:`opsd.sft.sft_pairs_from_examples`). The target is the row's
    ``data.target_key`` field where it has one, else its solution as ``target`` writes it (default:
    itself); ``token_targets``: each row's target as token ids instead (context distillation's
    generated answers, end token included where the answer stopped)."""

    def __init__(
        self,
        tokenizer,
        examples: list,
        data_cfg,
        max_len: int,
        target: Callable[[str], str] | None = None,
        token_targets: dict[int, list[int]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.examples = examples
        self.data_cfg = data_cfg
        self.max_len = max_len
        self.target = target
        self._pairs: dict[int, tuple[list[int], list[int]]] = {}
        self.token_targets = token_targets

    def pair(self, index: int) -> tuple[list[int], list[int]]:
        """(student prompt, target + end token) of example ``index``, tokenized once."""
        if index not in self._pairs:
            d, ex = self.data_cfg, self.examples[index]
            if ex.target is not None:
                ex = replace(ex, solution=ex.target)
            elif self.target is not None:
                ex = replace(ex, solution=self.target(ex.solution))
            (self._pairs[index],) = sft_pairs_from_examples(
                self.tokenizer,
                [ex],
                instruction=d.instruction,
                enable_thinking=d.student_thinking,
                max_len=self.max_len,
            )
            if self.token_targets is not None:
                prompt, _ = self._pairs[index]
                answer = self.token_targets[index][: max(1, self.max_len - len(prompt))]
                self._pairs[index] = (prompt, answer)
        return self._pairs[index]


class SFTAnchor(Solutions):
    """Adds ``coef`` x the token-mean cross-entropy of the step's reference solutions (end token
    included) to the gradient; :meth:`backward` returns the added loss."""

    def __init__(self, coef: float, tokenizer, examples: list, data_cfg, max_len: int) -> None:
        super().__init__(tokenizer, examples, data_cfg, max_len)
        self.coef = coef

    def backward(
        self,
        model,
        example_indices: list[int],
        microbatches: Callable[[list], list[MicroBatch]],
        autocast: Callable,
        sums: dict[str, float],
    ) -> Tensor:
        """One forward and backward over the reference solutions of ``example_indices`` (each problem
        once), in ``microbatches``' token budget with weights over the global solution-token count;
        adds this rank's ``sft_loss`` sum to ``sums`` and returns the scaled loss (float64)."""
        samples = []
        for i in dict.fromkeys(example_indices):
            prompt, target = self.pair(i)
            samples.append(make_sample(prompt, prompt, target, i, "stop"))
        total = torch.zeros((), dtype=torch.float64)
        ce = torch.zeros((), dtype=torch.float64)
        for mb in microbatches(samples):
            with autocast():
                hidden = forward_hidden(
                    model, mb.student_ids, mb.student_mask, mb.student_pos, mb.student_rows
                )
            loss, _ = solution_cross_entropy(hidden, full_head_weight(model), mb)
            (self.coef * loss).backward()
            ce += loss.detach().double().cpu()
        total += self.coef * ce
        sums["sft_loss"] = sums.get("sft_loss", 0.0) + float(ce)
        return total


class SolutionQueue(RolloutQueue):
    """``objective: sft``'s queue: each step's problems drawn from the cursor as for rollouts
    (``rollout.prompts_per_step`` a step, the run's data order, resumable), with each one's reference
    solution and end token as its one response. Nothing is generated for training; the engine
    serves the held-out evaluation only."""

    def __init__(self, solutions: Solutions, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.solutions = solutions

    def next(self, step: int, timer) -> tuple[list[int], list, list[Completion], float]:
        """``step``'s problems, their prompt pairs (the student prompt twice: no teacher reads them)
        and their solutions as completions, a cut one marked ``length``; no policy lag. Reading the
        solutions is this objective's rollout, timed as one."""
        with timer("rollout"):
            ex_idx = self.cursor.next_indices(self.per_rank)
            pairs = [self.solutions.pair(i) for i in ex_idx]
            end = self.solutions.tokenizer.eos_token_id
            completions = [
                Completion(j, list(target), None, "stop" if target[-1] == end else "length")
                for j, (_, target) in enumerate(pairs)
            ]
        return ex_idx, [(prompt, prompt) for prompt, _ in pairs], completions, 0.0


def teacher_answers(
    engine, prompts: Callable, examples: list, params, path: Path, write: bool
) -> dict[int, list[int]]:
    """Context distillation's targets (``data.sft_targets: teacher``): each training row's answer by the
    initial model reading its teacher prompt (``prompts(i, example)[1]``, the privileged text in it),
    under ``params`` (greedy), as token ids with the end token where the answer stopped. Generated once
    and kept at ``path`` (written where ``write``: rank 0), so a resumed run trains on the same answers."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) == len(examples):
            return {int(r["row"]): list(r["token_ids"]) for r in rows}
    teacher_prompts = [prompts(i, ex)[1] for i, ex in enumerate(examples)]
    engine.wake()
    completions = engine.generate(teacher_prompts, 1, params)
    engine.sleep()
    answers = {c.prompt_index: list(c.token_ids) for c in completions}
    if write:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            "".join(json.dumps({"row": i, "token_ids": answers[i]}) + "\n" for i in sorted(answers))
        )
        tmp.replace(path)
    return answers
