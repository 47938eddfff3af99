"""The SFT anchor (``loss.sft_coef``): the step's worked solutions as a supervised term beside OPSD.

The OPSD authors' own long run drifted: answers grew longer and repetitive and stopped ending; adding
the SFT loss on the reference answer, with its end-of-message token, fixed format and stopping. Here,
after the distillation loss's micro-batches, the student reads each of the step's problems followed by
its reference solution and its end token, and ``sft_coef`` times the token-mean cross-entropy of those
tokens is added to the loss (the same fused head kernel as GRPO's, so no ``[tokens, vocab]`` logits).
It is logged separately as ``sft_loss`` (the unscaled cross-entropy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from opsd.data import make_sample
from opsd.data.batching import MicroBatch
from opsd.loss import fused_linear_policy_gradient
from opsd.parallel import forward_hidden, full_head_weight
from opsd.sft import sft_pairs_from_examples


class SFTAnchor:
    """Adds ``coef`` x the token-mean cross-entropy of the step's reference solutions (end token
    included) to the gradient; :meth:`backward` returns the added loss."""

    def __init__(self, coef: float, tokenizer, examples: list, data_cfg, max_len: int) -> None:
        self.coef = coef
        self.tokenizer = tokenizer
        self.examples = examples
        self.data_cfg = data_cfg
        self.max_len = max_len
        self._pairs: dict[int, tuple[list[int], list[int]]] = {}

    def pair(self, index: int) -> tuple[list[int], list[int]]:
        """(student prompt, solution + end token) of example ``index``, tokenized once."""
        if index not in self._pairs:
            d = self.data_cfg
            (self._pairs[index],) = sft_pairs_from_examples(
                self.tokenizer,
                [self.examples[index]],
                instruction=d.instruction,
                enable_thinking=d.student_thinking,
                max_len=self.max_len,
            )
        return self._pairs[index]

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
            loss, _ = fused_linear_policy_gradient(hidden, full_head_weight(model), mb.targets, mb.weights)
            (self.coef * loss).backward()
            ce += loss.detach().double().cpu()
        total += self.coef * ce
        sums["sft_loss"] = sums.get("sft_loss", 0.0) + float(ce)
        return total
