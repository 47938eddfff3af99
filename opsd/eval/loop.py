"""The evaluation loop: generate k samples per problem, grade them, Avg@k and pass@k.

It works on a live (model, tokenizer), so the trainer (every ``eval.every`` steps, sharded over
ranks), `opsd demo` and `opsd eval` (:mod:`opsd.eval.cli`, after loading each model) share it.
Prompts go through `opsd.data.student_prompt_ids`, exactly as in training, so scores match what the
student sees. Grading is math-verify on the last \\boxed{} unless the caller passes its own grader (a
task with its own answer format, such as the demo's).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from tqdm import tqdm

from opsd.data import DEFAULT_INSTRUCTION, Example, student_prompt_ids
from opsd.errors import UserError
from opsd.eval.cut import generate_to_answer
from opsd.grading import AnswerEnd, Grader, grade, normalize_gold, pass_at_k
from opsd.rollout import HFEngine, SamplingParams
from opsd.rollout.base import end_token_ids


@dataclass
class EvalResult:
    name: str
    k: int
    num_problems: int
    avg_at_k: float  # mean accuracy over all num_problems * k samples
    pass_at_k: float  # mean over problems of the unbiased pass@k estimator
    resp_len_mean: float  # response tokens, including the stop token
    truncated_frac: float  # samples that hit max_new_tokens (finish_reason == "length")
    no_answer_frac: float  # samples without a (balanced) \boxed{}
    grading_errors: int  # samples whose grading failed (timeout, parse error): counted incorrect
    prompts_truncated: int  # prompts cut to max_prompt_len
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """Everything but the per-item records (JSON-ready)."""
        d = asdict(self)
        d.pop("items")
        return d

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat numbers for the trainer's metrics sinks (keys like eval/avg@4)."""
        return {
            f"{prefix}avg@{self.k}": self.avg_at_k,
            f"{prefix}pass@{self.k}": self.pass_at_k,
            f"{prefix}resp_len_mean": self.resp_len_mean,
            f"{prefix}truncated_frac": self.truncated_frac,
            f"{prefix}no_answer_frac": self.no_answer_frac,
            f"{prefix}grading_errors": float(self.grading_errors),
        }


def check_settings(k: int, temperature: float, top_p: float, max_new_tokens: int, batch_size: int) -> None:
    """The sampling settings as a UserError, before any model is loaded (`opsd eval` calls it too)."""
    if not isinstance(k, int) or k < 1:
        raise UserError(f"k={k!r} must be an integer >= 1 (samples per problem)")
    if batch_size < 1:
        raise UserError(f"batch_size={batch_size} must be >= 1")
    try:
        SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens).validate()
    except ValueError as e:
        raise UserError(str(e)) from None


def evaluate_model(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    *,
    k: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 1024,
    enable_thinking: bool | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    max_prompt_len: int | None = None,
    seed: int = 0,
    batch_size: int = 32,
    engine: Any = None,
    name: str = "model",
    progress: bool = False,
    grader: Grader = grade,
    prompts: list[list[int]] | None = None,
    answer_end: AnswerEnd | None = None,
) -> EvalResult:
    """Generate k samples per example with `engine` (default: an HFEngine on `model`) and grade them.

    Called by `opsd eval` (per loaded model), `opsd demo` (held-out accuracy), :func:`evaluate_sharded`
    (the trainer) and bench/. Pass the trainer's own engine to evaluate with vLLM; it must already
    hold the current weights. ``grader(response, gold)`` scores each sample (default: math-verify).
    ``prompts``: token ids to generate from, one per example, instead of the student prompt (e.g. a
    teacher's prompt that holds the privileged information); ``instruction``, ``enable_thinking`` and
    ``max_prompt_len`` then do not apply. Grading runs in the calling thread; math-verify timeouts
    only work on the main thread.
    """
    check_settings(k, temperature, top_p, max_new_tokens, batch_size)
    if not examples:
        raise ValueError("no examples to evaluate")
    missing = [ex.row for ex in examples if ex.answer is None]
    if missing:
        raise ValueError(
            f"{len(missing)} examples have no gold answer (rows {missing[:10]}); "
            "load with require_answer=True"
        )
    if prompts is not None and len(prompts) != len(examples):
        raise ValueError(f"{len(prompts)} prompts for {len(examples)} examples; give one per example")
    if engine is None:
        engine = HFEngine(model, tokenizer, batch_size=batch_size)

    t0 = time.time()
    prompts_truncated = 0
    if prompts is None:
        prompts, prompts_truncated = _student_prompts(
            tokenizer, examples, instruction, enable_thinking, max_prompt_len
        )

    # Chunks of batch_size prompts: progress for the bar, and a full batch for every engine.
    items: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(examples),
        desc=f"eval {name}",
        unit="problem",
        disable=None if progress else True,
        file=sys.stderr,
    )
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        # A distinct seed per chunk, fixed by its offset: reproducible for a given seed and batch_size.
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed + start
        )
        completions = _generate(engine, tokenizer, model, chunk, k, params, answer_end)
        for j in range(len(chunk)):
            comps = completions[j * k : (j + 1) * k]
            if len(comps) != k or any(c.prompt_index != j for c in comps):
                raise RuntimeError(
                    f"{type(engine).__name__}.generate broke the prompt-major order of completions"
                )
            items.append(_grade_item(start + j, examples[start + j], comps, tokenizer, k, grader))
        bar.update(len(chunk))
    bar.close()

    samples = [s for it in items for s in it["correct"]]
    lengths = [n for it in items for n in it["response_tokens"]]
    return EvalResult(
        name=name,
        k=k,
        num_problems=len(items),
        avg_at_k=sum(samples) / len(samples),
        pass_at_k=sum(it[f"pass@{k}"] for it in items) / len(items),
        resp_len_mean=sum(lengths) / len(lengths),
        truncated_frac=sum(r == "length" for it in items for r in it["finish_reasons"]) / len(samples),
        no_answer_frac=sum(x is None for it in items for x in it["extracted"]) / len(samples),
        grading_errors=sum(e is not None for it in items for e in it["errors"]),
        prompts_truncated=prompts_truncated,
        seconds=round(time.time() - t0, 2),
        settings={
            "k": k,
            "temperature": temperature,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens,
            "enable_thinking": enable_thinking,
            "instruction": instruction,
            "max_prompt_len": max_prompt_len,
            "seed": seed,
            "batch_size": batch_size,
            "engine": type(engine).__name__,
            "grader": f"{getattr(grader, '__module__', '?')}.{getattr(grader, '__qualname__', '?')}",
        },
        items=items,
    )


def _student_prompts(
    tokenizer: Any,
    examples: list[Example],
    instruction: str,
    enable_thinking: bool | None,
    max_prompt_len: int | None,
) -> tuple[list[list[int]], int]:
    """The student prompts of ``examples``, as training builds them, and how many were cut to length."""
    prompts, truncated = [], 0
    for ex in examples:
        ids, cut = student_prompt_ids(
            tokenizer,
            ex.problem,
            instruction=instruction,
            enable_thinking=enable_thinking,
            max_len=max_prompt_len,
        )
        prompts.append(ids)
        truncated += cut
    return prompts, truncated


def _generate(
    engine: Any,
    tokenizer: Any,
    model: Any,
    chunk: list[list[int]],
    k: int,
    params: SamplingParams,
    answer_end: AnswerEnd | None,
) -> list:
    """``engine.generate``, or with ``answer_end`` each response stopped once its answer is complete."""
    if answer_end is None:
        return engine.generate(chunk, k, params)
    ends = set(end_token_ids(tokenizer, model, []))
    return generate_to_answer(engine, tokenizer, chunk, k, params, answer_end, ends)


def _grade_item(
    index: int, ex: Example, comps: list, tokenizer: Any, k: int, grader: Grader
) -> dict[str, Any]:
    responses = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
    grades = [grader(r, ex.answer) for r in responses]
    correct = [g.correct for g in grades]
    return {
        "index": index,
        "row": ex.row,
        "problem": ex.problem,
        "gold": ex.answer,
        "gold_normalized": normalize_gold(ex.answer),
        "responses": responses,
        "extracted": [g.extracted for g in grades],
        "correct": correct,
        "errors": [g.error for g in grades],
        "response_tokens": [len(c.token_ids) for c in comps],
        "finish_reasons": [c.finish_reason for c in comps],
        "num_correct": sum(correct),
        f"pass@{k}": pass_at_k(k, sum(correct), k),
    }


def evaluate_sharded(
    model, tokenizer, examples: list[Example], *, rank: int, world: int, k: int, **kw
) -> EvalResult:
    """:func:`evaluate_model` with the examples split over data-parallel ranks and the counts summed.

    Called by the trainer's in-training evaluation (`Trainer.evaluate`; one process is world=1).
    Each rank grades an equal share, topped up with uncounted repeats (under FSDP every rank must call
    ``generate`` as often as the others: the weights are gathered around each call); the returned
    result's figures are global, its ``items`` this rank's.
    """
    from opsd.distributed import all_reduce_sum

    share = -(-len(examples) // world)
    mine = examples[rank * share : (rank + 1) * share]
    res = evaluate_model(model, tokenizer, mine + examples[: share - len(mine)], k=k, **kw)
    rows = [
        [
            1,
            sum(it["correct"]),
            it[f"pass@{k}"],
            sum(it["response_tokens"]),
            it["finish_reasons"].count("length"),
            it["extracted"].count(None),
            len(it["errors"]) - it["errors"].count(None),
        ]
        for it in res.items[: len(mine)]
    ]
    sums = torch.tensor(rows, dtype=torch.float64).reshape(-1, 7).sum(0)
    n, right, passed, length, cut, none, errors = all_reduce_sum(sums).tolist()
    return replace(
        res,
        items=res.items[: len(mine)],
        num_problems=int(n),
        avg_at_k=right / (n * k),
        pass_at_k=passed / n,
        resp_len_mean=length / (n * k),
        truncated_frac=cut / (n * k),
        no_answer_frac=none / (n * k),
        grading_errors=int(errors),
    )
