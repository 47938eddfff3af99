"""The reference solutions as supervised token pairs: what the SFT anchor, ``objective: sft``'s queue and
`opsd sft` train on.

Each pair is (student prompt, solution + end token), tokenized once; a response that does not fit
``max_len`` is cut. Token ids only: no torch, no model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from opsd.data.prompts import student_prompt_ids


def sft_pairs_from_examples(
    tok: Any, examples: list, *, instruction: str, enable_thinking: bool | None, max_len: int
) -> list[tuple[list[int], list[int]]]:
    """(student prompt, solution + eos) per example; a response that does not fit ``max_len`` is cut."""
    pairs = []
    for ex in examples:
        prompt, _ = student_prompt_ids(
            tok, ex.problem, instruction=instruction, enable_thinking=enable_thinking
        )
        resp = tok.encode(ex.solution, add_special_tokens=False) + [tok.eos_token_id]
        pairs.append(
            (prompt, resp if len(prompt) + len(resp) <= max_len else resp[: max(1, max_len - len(prompt))])
        )
    return pairs


class Solutions:
    """(student prompt, target + end token) per training row, tokenized once; a response that does
    not fit ``max_len`` is cut (:func:`sft_pairs_from_examples`). The target is the row's
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
