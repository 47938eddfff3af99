"""`opsd eval`: its configuration, flags, the side-by-side table and the files it writes.

:func:`evaluate` loads each model from a path (or a fetched short name) and runs
:func:`opsd.eval.loop.evaluate_model` on it; with an output directory it writes per-item JSONL and
summary JSON. The CLI takes the same configuration dialect as `opsd train`: ``--config eval.yaml``
plus ``section.key=value`` overrides (:class:`EvalCommandConfig`); the flags are shorthands for
those keys.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from opsd.config import CpuTuning, DeviceSetting, RolloutConfig
from opsd.cpu import CpuPlan, apply_plan, resolve_plan
from opsd.data import DEFAULT_INSTRUCTION, RowKeys, load_examples
from opsd.devices import empty_cache, machine_info, resolve_device
from opsd.errors import UserError
from opsd.eval.loop import EvalResult, check_settings, evaluate_model
from opsd.grading import Grader, as_grade, grade, resolve_grader
from opsd.models import load_model, load_tokenizer, resolve_model_path
from opsd.precision import dtype_name
from opsd.precision import resolve as resolve_precision
from opsd.rollout.base import EngineRun, RolloutEngine
from opsd.rollout.make import make_engine


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
    _write_json(out_dir / f"{label}.summary.json", summary)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def format_eval_table(results: dict[str, EvalResult]) -> str:
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
    device: str = "auto",
    dtype: str | None = None,
    out_dir: Path | None = None,
    progress: bool = False,
    grader: Grader = grade,
    cpu: CpuTuning | None = None,
) -> dict[str, EvalResult]:
    """Evaluate one or more models (paths or fetched short names) on a data file; returns label -> result.

    Called by :func:`run_eval` (`opsd eval`) and from Python. Models are loaded one at a time. With
    out_dir, writes <label>.items.jsonl, <label>.summary.json and a combined summary.json there.
    ``cpu``: the ``cpu`` section (:class:`opsd.config.CpuTuning`; default its defaults), whose plan
    lays the weights out and tunes the engine on a CPU as training's does.
    """
    models = [model] if isinstance(model, str) else list(model)
    if not models:
        raise UserError("no model given")
    check_settings(k, temperature, top_p, max_new_tokens, batch_size)
    if limit is not None and limit < 1:
        raise UserError(f"limit={limit} must be >= 1")
    if engine not in ("hf", "vllm"):
        raise UserError(f"engine {engine!r} unknown; allowed: ['hf', 'vllm']")
    report = load_examples(
        data, RowKeys(problem=problem_key, solution=None, answer=answer_key), split=split, require_answer=True
    )
    examples = report.examples[:limit] if limit is not None else report.examples
    # Every tokenizer first: a typo in the last model path fails before hours of generating for the first.
    tokenizers = [load_tokenizer(m) for m in models]
    dev = resolve_device(device)
    # The trainer's resolver: auto is bf16 where the device has bf16 matrix units (OPSD_CPU_BF16 on a CPU).
    compute = resolve_precision(dtype or "auto", dev, full_finetune=False).compute
    # Nothing trains here: rows are never packed, every weight is laid out for decoding.
    plan = replace(resolve_plan(cpu or CpuTuning(), dev, compute, engine=engine), pack_rows=False)
    rollout = RolloutConfig(  # eval never sleeps; one engine per model, closed after it
        engine=engine, batch_size=batch_size, max_new_tokens=max_new_tokens, vllm_sleep_level=0
    )
    results: dict[str, EvalResult] = {}
    for name, label, tok in zip(models, _labels(models), tokenizers, strict=True):
        hf_model, eng = _load_for_eval(name, tok, rollout, dev, compute, plan, seed, max_prompt_len)
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
        res.settings.update(device=str(dev), dtype=dtype_name(compute))
        results[label] = res
        if out_dir is not None:
            extra = {"model": name, "data": str(data), "rows_in_file": len(report.examples)}
            write_outputs(res, Path(out_dir), label, extra)
        eng.close()
        del eng, hf_model
        empty_cache(dev)
    if out_dir is not None:
        _write_summary(Path(out_dir), results, models, data, answer_key, problem_key)
    return results


def _load_for_eval(
    name: str,
    tok,
    rollout: RolloutConfig,
    dev: torch.device,
    compute: torch.dtype,
    plan: CpuPlan,
    seed: int,
    max_prompt_len: int | None,
) -> tuple[nn.Module, RolloutEngine]:
    """One model and its engine, under the CPU plan. vLLM loads its own copy from the path; the HF copy
    then stays on the CPU and only feeds the initial weight sync."""
    vllm = rollout.engine == "vllm"
    hf_model = load_model(name, dtype=dtype_name(compute), device="cpu" if vllm else str(dev))
    if not vllm:
        apply_plan(plan, hf_model.requires_grad_(False), params=0)
    path = str(resolve_model_path(name)) if vllm else None
    run = EngineRun(seed=seed, max_prompt_len=max_prompt_len, model_path=path, plan=plan)
    eng = make_engine(rollout, hf_model, tok, run=run)
    return hf_model, eng


def _write_summary(
    out_dir: Path,
    results: dict[str, EvalResult],
    models: list[str],
    data: str,
    answer_key: str,
    problem_key: str,
) -> None:
    """The combined summary.json: every model's summary beside the data and the machine."""
    combined = {
        "data": str(data),
        "answer_key": answer_key,
        "problem_key": problem_key,
        "machine": machine_info(),
        "created": datetime.now().isoformat(timespec="seconds"),
        "models": {
            label: {"model": m, **r.summary()} for (label, r), m in zip(results.items(), models, strict=True)
        },
    }
    _write_json(out_dir / "summary.json", combined)


# ----------------------------------------------------------------------------------------------
# `opsd eval`'s configuration: the same YAML + section.key=value dialect as `opsd train`.


class EvalModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # model dirs or fetched short names; several: a side-by-side table
    path: list[str] = Field(min_length=1)
    # None/auto: as `opsd train` resolves it (bf16 where the device has bf16 matrix units)
    dtype: Literal["auto", "float32", "bfloat16", "float64"] | None = None

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
    # Deliberately sampled (0.6 / top-p 0.95): Avg@k and pass@k over k samples, as the paper reports
    # them. The trainer's in-training eval (opsd.config.EvalConfig) is greedy, for a low-variance curve.
    temperature: float = Field(0.6, ge=0)  # 0: greedy
    top_p: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int = Field(1024, ge=1)
    batch_size: int = Field(32, ge=1)  # sequences per HF generate call


class EvalCommandConfig(BaseModel):
    """Everything `opsd eval` reads, with the section names `opsd train` uses for the same things.

    Not :class:`opsd.config.EvalConfig`, which is `opsd train`'s in-training evaluation section."""

    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    device: DeviceSetting = "auto"  # auto | cpu | cuda | cuda:N (opsd.devices)
    k: int = Field(1, ge=1)  # samples per problem (Avg@k, pass@k)
    # opsd.grading.GRADERS: math-verify on the last \\boxed{}, or on its own extraction from the response
    grader: str = "math"  # a name from opsd.grading.GRADERS or package.module:function, as eval.grader
    out: str | None = None  # output dir; None: runs/eval-<data>-<time>
    model: EvalModelConfig
    data: EvalDataConfig
    rollout: EvalRolloutConfig = EvalRolloutConfig()
    cpu: CpuTuning = CpuTuning()  # the CPU mechanisms, as `opsd train`'s cpu section (docs/cpu.md)

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, tree: Any) -> Any:
        """An absent section reports its missing keys (model.path), not just the section's name."""
        return {**{k: {} for k in ("model", "data")}, **tree} if isinstance(tree, dict) else tree


# ----------------------------------------------------------------------------------------------
# `opsd eval`'s flags: shorthands for EvalCommandConfig keys.

_KEY_LIKE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")


def flag_overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Dotted overrides for the shorthand flags that were given (argparse dest -> config key).

    Shared with `opsd sft`. Values are written as JSON, which YAML reads back unchanged (a path
    stays a string, a list a list).
    """
    return [
        f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}"
        for dest, key in flags.items()
        if (v := getattr(args, dest, None)) is not None
    ]


# argparse dest -> EvalCommandConfig key. Flags are shorthands; anything else is a positional override.
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
        "section.key=value overrides, as for `opsd train`; the flags are shorthands for those keys, "
        "e.g. `opsd eval --model base trained --data math500.jsonl --k 4` = "
        "`opsd eval model.path=[base,trained] data.path=math500.jsonl k=4`."
    )
    p.add_argument("--config", type=Path, help="YAML with the keys of opsd.eval.EvalCommandConfig")
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
    p.add_argument(
        "--grader",
        help="grader: math (default; math-verify on the last \\boxed{}), lenient, last_number (the "
        'response\'s last number), answer_is (the number after the last "The answer is"), contains (the '
        "gold as a whole word or phrase), exact, or package.module:function, as eval.grader in training",
    )
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
    """`opsd eval`: flags and overrides -> :class:`EvalCommandConfig` -> :func:`evaluate`, table printed."""
    from opsd.config import load_config

    args.model, stray = _split_overrides(args.model)
    overrides = [*flag_overrides(args, EVAL_FLAGS), *stray, *args.overrides]
    cfg = load_config(args.config, overrides, schema=EvalCommandConfig)
    grader = resolve_grader(cfg.grader, "grader")  # before any model loads: one line for a bad name
    out = Path(cfg.out or f"runs/eval-{Path(cfg.data.path).stem}-{datetime.now():%Y%m%d-%H%M%S}")
    d, r = cfg.data, cfg.rollout
    results = evaluate(
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
        device=cfg.device,
        dtype=cfg.model.dtype,
        out_dir=out,
        progress=True,
        grader=lambda r, g: as_grade(grader(r, g)),
        cpu=cfg.cpu,
    )
    print(format_eval_table(results))
    print(f"wrote {out}/summary.json and per-item JSONL")
    return 0
