"""Answers stopped where their graded answer is complete: `opsd probe`'s greedy evaluations.

A response that has written "The answer is 42. " has nothing more for the strict ``answer_is`` grader
to read, yet goes on to its end token or the token limit; on 2 cores those tokens are most of the
probe's time. :func:`generate_to_answer` stops each sequence once its text settles an answer its
grader reads (:class:`opsd.grading.AnswerEnd`), at the shortest token prefix that settles it:

* an engine whose ``generate`` takes ``stop_text`` (the HF engine) checks the text at every token;
* any other (vLLM, a remote server) in rounds: to the answer's markers as stop strings, a few tokens
  more to finish the answer found, then on from the sequence's own tokens to the next marker (vLLM's
  prefix cache keeps the prompt's work).

vLLM drops a stopped sequence from its batch at once. The HF engine decodes a batch until its last
sequence stops, so there a stopped sequence saves time only where its whole batch has stopped.

What is graded is the response up to its first complete answer. It grades as the whole response
would unless the rest would have written another answer (the grader reads the last). Whether a
stopped sequence would have ended before the token limit is unknown: its completion says
``finish_reason="answer"``, neither ``"stop"`` nor ``"length"``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from opsd.grading import AnswerEnd
from opsd.rollout.base import Completion, SamplingParams

TAIL_TOKENS = 8  # tokens a sequence writes after a marker, where the number it announces comes


@dataclass
class _Row:
    """One sequence across rounds: its prompt, what it has written, and how it ended (None: going on)."""

    prompt: list[int]
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    reason: str | None = None
    tail: bool = False  # the next round finishes an answer a marker announced


def generate_to_answer(
    engine: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    end: AnswerEnd,
    end_ids: set[int],
) -> list[Completion]:
    """``engine.generate(prompts, n, params)``, each sequence stopped once its text settles an answer
    (``end.settled``) and cut to the shortest token prefix that does. ``end_ids``: the engine's end
    tokens (:func:`opsd.rollout.base.end_token_ids`)."""
    params.validate()
    if params.min_new_tokens:
        raise ValueError("an answer cut cannot also force min_new_tokens")
    end_ids = end_ids | set(params.stop_token_ids)
    if "stop_text" not in inspect.signature(engine.generate).parameters:
        return _in_rounds(engine, tokenizer, prompts, n, params, end, end_ids)
    outs = engine.generate(prompts, n, params, stop_text=lambda text: end.settled(text) is not None)
    done = []
    for c in outs:
        row = _Row([], c.prompt_index)
        _advance(row, c, params.max_new_tokens, tokenizer, params.stop_strings, end, end_ids)
        done.append(Completion(c.prompt_index, row.tokens, row.logprobs, row.reason or c.finish_reason))
    return done


def _in_rounds(
    engine: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    end: AnswerEnd,
    end_ids: set[int],
) -> list[Completion]:
    """:func:`generate_to_answer` through the engine protocol alone (stop strings and token limits):
    each sequence a request of its own (``n=1``); a sampled call's later rounds draw with
    ``params.seed`` plus the round."""
    rows = [_Row(p, i) for i, p in enumerate(prompts) for _ in range(n)]
    budget = params.max_new_tokens
    round_ = 0
    while any(r.reason is None for r in rows):
        for tail in (False, True):
            group = [r for r in rows if r.reason is None and r.tail == tail]
            if not group:
                continue
            # One limit for the call, the largest any row has room for; each row keeps its own room.
            limit = max(budget - len(r.tokens) for r in group)
            limit = min(limit, TAIL_TOKENS) if tail else limit
            seed = None if params.seed is None else params.seed + round_
            stops = list(params.stop_strings) if tail else [*params.stop_strings, *end.markers]
            asked = replace(params, max_new_tokens=limit, stop_strings=stops, seed=seed)
            outs = engine.generate([r.prompt + r.tokens for r in group], 1, asked)
            for r, c in zip(group, outs, strict=True):
                _advance(r, c, budget, tokenizer, params.stop_strings, end, end_ids)
            round_ += 1
    return [Completion(r.index, r.tokens, r.logprobs, r.reason or "length") for r in rows]


def _advance(
    r: _Row,
    c: Completion,
    budget: int,
    tokenizer: Any,
    stop_strings: list[str],
    end: AnswerEnd,
    end_ids: set[int],
) -> None:
    """Adds one round's tokens to ``r`` (no more than its room) and decides how it goes on."""
    before = len(r.tokens)
    new = c.token_ids[: budget - before]
    if not new:  # an engine that wrote nothing would loop forever
        r.reason = c.finish_reason
        return
    r.tokens = r.tokens + new
    if r.logprobs is not None and c.logprobs is not None:
        r.logprobs = r.logprobs + c.logprobs[: len(new)]
    else:
        r.logprobs = None
    ended = new[-1] in end_ids
    full = len(r.tokens) >= budget
    text = _text(tokenizer, r.tokens)
    if end.settled(text) is not None:
        # The shortest prefix that settles it: none of the tokens before this round did.
        j = next(
            j
            for j in range(before + 1, len(r.tokens) + 1)
            if end.settled(_text(tokenizer, r.tokens[:j])) is not None
        )
        rest = r.tokens[j:]
        if ended and not _text(tokenizer, rest).strip():
            r.reason = "stop"  # the model ended right after its answer: the whole response
            return
        r.tokens = r.tokens[:j]
        r.logprobs = r.logprobs[:j] if r.logprobs is not None else None
        r.reason = "stop" if ended else "length" if full and not rest else "answer"
        return
    if ended or full:
        r.reason = "stop" if ended else "length"
        return
    said = text[len(_text(tokenizer, r.tokens[:before])) :]
    if c.finish_reason == "stop" and any(s in said for s in stop_strings):
        r.reason = "stop"  # the caller's own stop string
        return
    r.tail = end.pending(text)


def _text(tokenizer: Any, tokens: list[int]) -> str:
    """The text a grader reads (as :func:`opsd.eval.loop.evaluate_model` decodes it)."""
    return tokenizer.decode(tokens, skip_special_tokens=True)
