"""`opsd eval`: sample k responses per problem, grade them, report Avg@k and pass@k.

`evaluate_model` works on a live (model, tokenizer) so the trainer (and `opsd demo`) can evaluate
every N steps without reloading; `evaluate` loads models from paths for the CLI and writes per-item
JSONL + summary JSON. Prompts go through `opsd.data.student_prompt_ids`, exactly as in training, so
scores match what the student sees. Grading is math-verify on the last \\boxed{} unless the caller
passes its own grader (a task with its own answer format, such as the demo's).

The CLI takes the same configuration dialect as `opsd train`: ``--config eval.yaml`` plus
``section.key=value`` overrides (:class:`EvalRunConfig`); the flags are shorthands for those keys.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm import tqdm

from opsd.data import DEFAULT_INSTRUCTION, Example, load_examples, student_prompt_ids
from opsd.errors import UserError
from opsd.grading import GRADERS, Grader, grade, normalize_gold, pass_at_k
from opsd.models import load_model, load_tokenizer, resolve_model_path
from opsd.precision import dtype_name
from opsd.precision import resolve as resolve_precision
from opsd.rollout import HFEngine, SamplingParams


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


def _check_settings(k: int, temperature: float, top_p: float, max_new_tokens: int, batch_size: int) -> None:
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
) -> EvalResult:
    """Generate k samples per example with `engine` (default: an HFEngine on `model`) and grade them.

    Pass the trainer's own engine to evaluate with vLLM; it must already hold the current weights.
    ``grader(response, gold)`` scores each sample (default: math-verify). ``prompts``: token ids to
    generate from, one per example, instead of the student prompt (e.g. a teacher's prompt that holds
    the privileged information); ``instruction``, ``enable_thinking`` and ``max_prompt_len`` then do
    not apply. Grading runs in the calling thread; math-verify timeouts only work on the main thread.
    """
    _check_settings(k, temperature, top_p, max_new_tokens, batch_size)
    if not examples:
        raise ValueError("no examples to evaluate")
    missing = [ex.row for ex in examples if ex.answer is None]
    if missing:
        raise ValueError(
            f"{len(missing)} examples have no gold answer (rows {missing[:10]}); load with require_answer=True"
        )
    if prompts is not None and len(prompts) != len(examples):
        raise ValueError(f"{len(prompts)} prompts for {len(examples)} examples; give one per example")
    if engine is None:
        engine = HFEngine(model, tokenizer, batch_size=batch_size)

    t0 = time.time()
    prompts_truncated = 0
    if prompts is None:
        prompts = []
        for ex in examples:
            ids, truncated = student_prompt_ids(
                tokenizer,
                ex.problem,
                instruction=instruction,
                enable_thinking=enable_thinking,
                max_len=max_prompt_len,
            )
            prompts.append(ids)
            prompts_truncated += truncated

    # Chunks of batch_size prompts: progress for the bar, and a full batch for either engine.
    chunk = batch_size
    items: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(examples), desc=f"eval {name}", unit="problem", disable=not progress, file=sys.stderr
    )
    for start in range(0, len(prompts), chunk):
        # A distinct seed per chunk, fixed by its offset: reproducible for a given seed and batch_size.
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed + start
        )
        completions = engine.generate(prompts[start : start + chunk], k, params)
        for j in range(len(prompts[start : start + chunk])):
            ex = examples[start + j]
            comps = completions[j * k : (j + 1) * k]
            if len(comps) != k or any(c.prompt_index != j for c in comps):
                raise RuntimeError(
                    f"{type(engine).__name__}.generate broke the prompt-major order of completions"
                )
            items.append(_grade_item(start + j, ex, comps, tokenizer, k, grader))
        bar.update(len(prompts[start : start + chunk]))
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


def _labels(models: list[str]) -> list[str]:
    """Short, unique, filename-safe labels: the last path component, de-duplicated with -2, -3, ..."""
    labels: list[str] = []
    for m in models:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(m.rstrip("/")).name or m) or "model"
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}-{n}"
        labels.append(label)
    return labels


def write_outputs(result: EvalResult, out_dir: Path, label: str, extra: dict[str, Any] | None = None) -> None:
    """<label>.items.jsonl (one line per problem) and <label>.summary.json in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / f"{label}.items.jsonl").open("w", encoding="utf-8") as f:
        for it in result.items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    summary = {**(extra or {}), **result.summary()}
    (out_dir / f"{label}.summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")


def format_table(results: dict[str, EvalResult]) -> str:
    """One row per model, so base and trained checkpoints read side by side."""
    k = next(iter(results.values())).k
    head = [
        "model",
        "problems",
        f"avg@{k}",
        f"pass@{k}",
        "resp len",
        "truncated",
        "no \\boxed",
        "grade err",
        "time s",
    ]
    rows = [
        [
            label,
            str(r.num_problems),
            f"{r.avg_at_k:.4f}",
            f"{r.pass_at_k:.4f}",
            f"{r.resp_len_mean:.1f}",
            f"{r.truncated_frac:.3f}",
            f"{r.no_answer_frac:.3f}",
            str(r.grading_errors),
            f"{r.seconds:.1f}",
        ]
        for label, r in results.items()
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = " | ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count()}
    info["platform"] = platform.platform()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def evaluate(
    model: str | list[str],
    data: str,
    *,
    k: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 1024,
    enable_thinking: bool | None = None,
    engine: str = "hf",
    answer_key: str = "answer",
    problem_key: str = "problem",
    split: str = "test",
    instruction: str = DEFAULT_INSTRUCTION,
    max_prompt_len: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    batch_size: int = 32,
    device: str | None = None,
    dtype: str | None = None,
    out_dir: Path | None = None,
    progress: bool = False,
    grader: Grader = grade,
) -> dict[str, EvalResult]:
    """Evaluate one or more models (paths or fetched short names) on a data file; returns label -> result.

    Models are loaded one at a time. With out_dir, writes <label>.items.jsonl, <label>.summary.json and
    a combined summary.json there.
    """
    models = [model] if isinstance(model, str) else list(model)
    if not models:
        raise UserError("no model given")
    _check_settings(k, temperature, top_p, max_new_tokens, batch_size)
    if limit is not None and limit < 1:
        raise UserError(f"limit={limit} must be >= 1")
    if engine not in ("hf", "vllm"):
        raise UserError(f"engine {engine!r} unknown; allowed: ['hf', 'vllm']")
    report = load_examples(
        data,
        problem_key=problem_key,
        solution_key=None,
        answer_key=answer_key,
        split=split,
        require_answer=True,
    )
    examples = report.examples[:limit] if limit is not None else report.examples
    # Every tokenizer first: a typo in the last model path fails before hours of generating for the first.
    tokenizers = [load_tokenizer(m) for m in models]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # The trainer's resolver: auto is bf16 where the device has bf16 matrix units (OPSD_CPU_BF16 on a CPU).
    prec = resolve_precision(dtype or "auto", torch.device(device), full_finetune=False)
    dtype = dtype_name(prec.compute)

    from opsd.config import RolloutConfig
    from opsd.rollout import make_engine

    results: dict[str, EvalResult] = {}
    for name, label, tok in zip(models, _labels(models), tokenizers, strict=True):
        # vLLM loads its own copy from the path; the HF copy on CPU only feeds the initial weight sync.
        hf_model = load_model(
            name,
            dtype=dtype,
            device="cpu" if engine == "vllm" else device,
        )
        rollout = RolloutConfig(
            engine=engine, batch_size=batch_size, max_new_tokens=max_new_tokens, vllm_sleep_level=0
        )  # eval never sleeps; one engine per model, closed after it
        eng = make_engine(
            rollout,
            hf_model,
            tok,
            seed=seed,
            max_prompt_len=max_prompt_len,
            model_path=str(resolve_model_path(name)) if engine == "vllm" else None,
        )
        res = evaluate_model(
            hf_model,
            tok,
            examples,
            k=k,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            enable_thinking=enable_thinking,
            instruction=instruction,
            max_prompt_len=max_prompt_len,
            seed=seed,
            batch_size=batch_size,
            engine=eng,
            name=label,
            progress=progress,
            grader=grader,
        )
        res.settings.update(device=device, dtype=dtype)
        results[label] = res
        if out_dir is not None:
            extra = {"model": name, "data": str(data), "rows_in_file": len(report.examples)}
            write_outputs(res, Path(out_dir), label, extra)
        eng.close()
        del eng, hf_model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    if out_dir is not None:
        combined = {
            "data": str(data),
            "answer_key": answer_key,
            "problem_key": problem_key,
            "machine": machine_info(),
            "created": datetime.now().isoformat(timespec="seconds"),
            "models": {
                label: {"model": m, **r.summary()}
                for (label, r), m in zip(results.items(), models, strict=True)
            },
        }
        (Path(out_dir) / "summary.json").write_text(json.dumps(combined, indent=2, ensure_ascii=False) + "\n")
    return results


# ----------------------------------------------------------------------------------------------
# `opsd eval`: the same YAML + section.key=value dialect as `opsd train`.


class EvalModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: list[str] = Field(min_length=1)  # model dirs or fetched short names; several: a side-by-side table
    dtype: Literal["auto", "float32", "bfloat16", "float64"] | None = (
        None  # None/auto: as `opsd train` resolves it
    )

    @field_validator("path", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class EvalDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str  # JSONL/JSON/Parquet/CSV file, save_to_disk dir or hub name; every row needs an answer
    problem_key: str = "problem"  # GSM8K: question
    answer_key: str = "answer"  # GSM8K's "... #### N" is understood
    split: str = "test"  # for dataset directories and hub names
    instruction: str = DEFAULT_INSTRUCTION  # appended to each problem, as in training
    student_thinking: bool | None = None  # enable_thinking in the chat template; None = template default
    max_prompt_len: int | None = Field(None, ge=8)  # longer prompts are cut (counted in the summary)
    limit: int | None = Field(None, ge=1)  # the first N problems only


class EvalRolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: Literal["hf", "vllm"] = "hf"
    temperature: float = Field(0.6, ge=0)  # 0: greedy
    top_p: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int = Field(1024, ge=1)
    batch_size: int = Field(32, ge=1)  # sequences per HF generate call


class EvalRunConfig(BaseModel):
    """Everything `opsd eval` reads, with the section names `opsd train` uses for the same things."""

    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    k: int = Field(1, ge=1)  # samples per problem (Avg@k, pass@k)
    # opsd.grading.GRADERS: math-verify on the last \\boxed{}, or on its own extraction from the response
    grader: Literal["math", "lenient"] = "math"
    out: str | None = None  # output dir; None: runs/eval-<data>-<time>
    model: EvalModelConfig
    data: EvalDataConfig
    rollout: EvalRolloutConfig = EvalRolloutConfig()

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, tree: Any) -> Any:
        """An absent section reports its missing keys (model.path), not just the section's name."""
        return {**{k: {} for k in ("model", "data")}, **tree} if isinstance(tree, dict) else tree


def evaluate_config(
    cfg: EvalRunConfig, out_dir: Path | None, progress: bool = False
) -> dict[str, EvalResult]:
    """:func:`evaluate` with the settings of an :class:`EvalRunConfig`."""
    d, r = cfg.data, cfg.rollout
    return evaluate(
        cfg.model.path,
        d.path,
        k=cfg.k,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        enable_thinking=d.student_thinking,
        engine=r.engine,
        answer_key=d.answer_key,
        problem_key=d.problem_key,
        split=d.split,
        instruction=d.instruction,
        max_prompt_len=d.max_prompt_len,
        limit=d.limit,
        seed=cfg.seed,
        batch_size=r.batch_size,
        device=None if cfg.device == "auto" else cfg.device,
        dtype=cfg.model.dtype,
        out_dir=out_dir,
        progress=progress,
        grader=GRADERS[cfg.grader],
    )


_KEY_LIKE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")


def flag_overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Dotted overrides for the shorthand flags that were given (argparse dest -> config key).

    Values are written as JSON, which YAML reads back unchanged (a path stays a string, a list a list).
    """
    return [
        f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}"
        for dest, key in flags.items()
        if (v := getattr(args, dest, None)) is not None
    ]


# argparse dest -> EvalRunConfig key. Flags are shorthands; anything else is a positional override.
EVAL_FLAGS = {
    "model": "model.path",
    "dtype": "model.dtype",
    "data": "data.path",
    "problem_key": "data.problem_key",
    "answer_key": "data.answer_key",
    "split": "data.split",
    "instruction": "data.instruction",
    "enable_thinking": "data.student_thinking",
    "max_prompt_len": "data.max_prompt_len",
    "limit": "data.limit",
    "engine": "rollout.engine",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "max_new_tokens": "rollout.max_new_tokens",
    "batch_size": "rollout.batch_size",
    "k": "k",
    "grader": "grader",
    "seed": "seed",
    "device": "device",
    "out": "out",
}


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Accuracy of one or more models on a dataset with answers. Config from YAML (--config) and/or "
        "section.key=value overrides, as for `opsd train`; the flags are shorthands for those keys, e.g. "
        "`opsd eval --model base trained --data math500.jsonl --k 4` = "
        "`opsd eval model.path=[base,trained] data.path=math500.jsonl k=4`."
    )
    p.add_argument("--config", type=Path, help="YAML with the keys of opsd.eval.EvalRunConfig")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rollout.temperature=0"
    )
    p.add_argument(
        "--model",
        "-m",
        action="extend",
        nargs="+",
        help="model.path: model dir or fetched short name; repeat or list several for a side-by-side table",
    )
    p.add_argument("--data", help="data.path: JSONL/JSON/Parquet/CSV file or save_to_disk dir")
    p.add_argument("--k", type=int, help="k: samples per problem (Avg@k, pass@k); default 1")
    p.add_argument("--grader", help="grader: math (default; math-verify on the last \\boxed{}) or lenient")
    p.add_argument("--temperature", type=float, help="rollout.temperature (default 0.6; 0 = greedy)")
    p.add_argument("--top-p", type=float, help="rollout.top_p (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, help="rollout.max_new_tokens (default 1024)")
    p.add_argument("--max-prompt-len", type=int, help="data.max_prompt_len: cut longer prompts (counted)")
    p.add_argument(
        "--thinking",
        dest="enable_thinking",
        action="store_true",
        default=None,
        help="data.student_thinking=true: enable_thinking in the chat template",
    )
    p.add_argument("--no-thinking", dest="enable_thinking", action="store_false")
    p.add_argument("--engine", help="rollout.engine: hf (default) or vllm")
    p.add_argument("--answer-key", help="data.answer_key: gold answer field (GSM8K '#### N' understood)")
    p.add_argument("--problem-key", help="data.problem_key: problem field (GSM8K: question)")
    p.add_argument("--split", help="data.split for dataset directories / hub names (default test)")
    p.add_argument("--instruction", help="data.instruction: appended to each problem, as in training")
    p.add_argument("--limit", type=int, help="data.limit: evaluate the first N problems only")
    p.add_argument("--seed", type=int, help="seed (default 0)")
    p.add_argument("--batch-size", type=int, help="rollout.batch_size: sequences per HF generate call")
    p.add_argument("--device", help="device: auto (default: cuda if available), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", help="model.dtype (default auto: bfloat16 where the device has bf16 matrix units)"
    )
    p.add_argument("--out", type=Path, help="out: output dir (default: runs/eval-<data>-<time>)")


def _split_overrides(values: list[str] | None) -> tuple[list[str] | None, list[str]]:
    """``--model a b k=4``: argparse gives every word to --model; hand the key=value ones back."""
    if values is None:
        return None, []
    kept = [v for v in values if not _KEY_LIKE.match(v)]
    return kept or None, [v for v in values if _KEY_LIKE.match(v)]


def run_eval(args: argparse.Namespace) -> int:
    from opsd.config import load_config

    args.model, stray = _split_overrides(args.model)
    overrides = [*flag_overrides(args, EVAL_FLAGS), *stray, *args.overrides]
    cfg = load_config(args.config, overrides, schema=EvalRunConfig)
    out = (
        Path(cfg.out)
        if cfg.out
        else Path("runs") / f"eval-{Path(cfg.data.path).stem}-{datetime.now():%Y%m%d-%H%M%S}"
    )
    results = evaluate_config(cfg, out, progress=True)
    print(format_table(results))
    print(f"wrote {out}/summary.json and per-item JSONL")
    return 0


def evaluate_sharded(
    model, tokenizer, examples: list[Example], *, rank: int, world: int, k: int, **kw
) -> EvalResult:
    """:func:`evaluate_model` with the examples split over data-parallel ranks and the counts summed.

    Each rank grades an equal share, topped up with uncounted repeats (under FSDP every rank must call
    ``generate`` as often as the others: the weights are gathered around each call); the returned
    result's figures are global, its ``items`` this rank's.
    """
    from dataclasses import replace

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
