"""The reference solutions as a supervised target: the SFT anchor beside OPSD, and the responses of
``objective: sft``.

The OPSD authors' own long run drifted: answers grew longer and repetitive and stopped ending; adding
the SFT loss on the reference answer, with its end-of-message token, fixed format and stopping. Here,
after the distillation loss's micro-batches, the student reads each of the step's problems followed by
its reference solution and its end token, and ``sft_coef`` times the token-mean cross-entropy of those
tokens is added to the loss (the same fused head kernel as GRPO's, so no ``[tokens, vocab]`` logits).
It is logged separately as ``sft_loss`` (the unscaled cross-entropy).

``objective: sft`` trains on the same pairs alone (:class:`opsd.data.solutions.Solutions`):
:class:`opsd.rollout.queue.SolutionQueue` hands the step each drawn row's solution in place of a
rollout, and :class:`opsd.objectives.SFT` takes the same loss.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from opsd.data import make_sample
from opsd.data.batching import MicroBatch
from opsd.data.solutions import Solutions
from opsd.objectives import solution_cross_entropy
from opsd.parallel import forward_hidden, full_head_weight


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
