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

from opsd.config import DataConfig, EvalConfig
from opsd.data import Example, student_prompt_ids
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


@dataclass
class EvalRun:
    """What one evaluation runs with beside its ``eval`` section: the engine (None: an HFEngine on the
    model, ``batch_size`` sequences at once), the grader, the seed the chunks' seeds count from, the
    chunk size, the prompts to generate from instead of the student prompts (a teacher's, a task's),
    where a response may stop early, and its name and progress bar."""

    engine: Any = None
    grader: Grader = grade
    seed: int = 0
    batch_size: int = 32
    prompts: list[list[int]] | None = None
    answer_end: AnswerEnd | None = None
    name: str = "model"
    progress: bool = False


def check_settings(e: EvalConfig, batch_size: int) -> None:
    """The sampling settings as a UserError, before any model is loaded (`opsd eval` calls it too)."""
    if batch_size < 1:
        raise UserError(f"batch_size={batch_size} must be >= 1")
    try:
        SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens).validate()
    except ValueError as err:
        raise UserError(str(err)) from None


def _check_examples(examples: list[Example], prompts: list[list[int]] | None) -> None:
    """Every example has a gold answer, and explicit prompts one per example."""
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


def evaluate_model(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    e: EvalConfig,
    data: DataConfig | None = None,
    run: EvalRun | None = None,
) -> EvalResult:
    """Generate ``e.k`` samples per example at ``e``'s sampling and grade them.

    Called by `opsd eval` (per loaded model), `opsd demo` (held-out accuracy), :func:`evaluate_sharded`
    (the trainer) and bench/. ``data``: the student prompts' keys (``instruction``,
    ``student_thinking``, ``max_prompt_len``; default the section's defaults); ``run``: the engine (the
    trainer's own to evaluate with vLLM, already holding the current weights), the grader (default
    math-verify) and explicit prompts, for which ``data`` does not apply. Grading runs in the calling
    thread; math-verify timeouts only work on the main thread.
    """
    run = run or EvalRun()
    check_settings(e, run.batch_size)
    _check_examples(examples, run.prompts)
    engine = run.engine or HFEngine(model, tokenizer, batch_size=run.batch_size)
    t0 = time.time()
    prompts, prompts_truncated = run.prompts, 0
    if prompts is None:
        prompts, prompts_truncated = student_prompts(tokenizer, examples, data or DataConfig())
    items: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(examples),
        desc=f"eval {run.name}",
        unit="problem",
        disable=None if run.progress else True,
        file=sys.stderr,
    )
    for start in range(0, len(prompts), run.batch_size):
        chunk = prompts[start : start + run.batch_size]
        # A distinct seed per chunk, fixed by its offset: reproducible for a given seed and batch_size.
        params = SamplingParams(
            temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens, seed=run.seed + start
        )
        completions = _generate(engine, tokenizer, model, chunk, e.k, params, run.answer_end)
        items += _grade_chunk(start, examples, completions, tokenizer, e.k, run.grader)
        bar.update(len(chunk))
    bar.close()
    settings = {"k": e.k, "temperature": e.temperature, "top_p": e.top_p, "max_new_tokens": e.max_new_tokens}
    if run.prompts is None:
        d = data or DataConfig()
        settings |= {
            "enable_thinking": d.student_thinking,
            "instruction": d.instruction,
            "max_prompt_len": d.max_prompt_len,
        }
    grader = f"{getattr(run.grader, '__module__', '?')}.{getattr(run.grader, '__qualname__', '?')}"
    settings |= {
        "seed": run.seed,
        "batch_size": run.batch_size,
        "engine": type(engine).__name__,
        "grader": grader,
    }
    return _result(run.name, e.k, items, prompts_truncated, round(time.time() - t0, 2), settings)


def _grade_chunk(
    start: int, examples: list[Example], completions: list, tokenizer: Any, k: int, grader: Grader
) -> list[dict[str, Any]]:
    """The graded items of one chunk of prompts from ``start``, its completions prompt-major."""
    items = []
    for j in range(len(completions) // k):
        comps = completions[j * k : (j + 1) * k]
        if len(comps) != k or any(c.prompt_index != j for c in comps):
            raise RuntimeError("the engine's generate broke the prompt-major order of completions")
        items.append(_grade_item(start + j, examples[start + j], comps, tokenizer, k, grader))
    return items


def _result(
    name: str, k: int, items: list[dict[str, Any]], prompts_truncated: int, seconds: float, settings: dict
) -> EvalResult:
    """The figures of graded ``items``."""
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
        seconds=seconds,
        settings=settings,
        items=items,
    )


def student_prompts(tokenizer: Any, examples: list[Example], data: DataConfig) -> tuple[list[list[int]], int]:
    """The student prompts of ``examples``, as training builds them, and how many were cut to length."""
    prompts, truncated = [], 0
    for ex in examples:
        ids, cut = student_prompt_ids(
            tokenizer,
            ex.problem,
            instruction=data.instruction,
            enable_thinking=data.student_thinking,
            max_len=data.max_prompt_len,
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
    model,
    tokenizer,
    examples: list[Example],
    e: EvalConfig,
    data: DataConfig,
    run: EvalRun,
    rank: int,
    world: int,
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
    k = e.k
    res = evaluate_model(model, tokenizer, mine + examples[: share - len(mine)], e, data, run)
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
