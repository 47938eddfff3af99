"""`opsd eval`: its flags, the side-by-side table and the files it writes.

:func:`evaluate` loads each model from a path (or a fetched short name) and runs
:func:`opsd.eval.loop.evaluate_model` on it; with an output directory it writes per-item JSONL and
summary JSON. The settings are :class:`opsd.config.EvalCommand`, built from the sections `opsd train`
reads (``model``, ``data``'s prompt keys, ``eval``, ``rollout``'s engine, ``cpu``): ``--config
eval.yaml`` plus ``section.key=value`` overrides, the flags shorthands for those keys.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opsd.config import EvalCommand, flag_overrides, load_config, resolve_engine
from opsd.cpu import CpuPlan, apply_plan, resolve_plan
from opsd.data import Example, RowKeys, load_examples
from opsd.data.sources import take_rows
from opsd.devices import empty_cache, machine_info, resolve_device
from opsd.eval.loop import EvalResult, EvalRun, check_settings, evaluate_model
from opsd.grading import as_grade, resolve_grader
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


def evaluate(cfg: EvalCommand, out_dir: Path | None = None, progress: bool = False) -> dict[str, EvalResult]:
    """Evaluate ``cfg.model_paths()`` (paths or fetched short names) on ``eval.path``; returns label ->
    result.

    Called by :func:`run_eval` (`opsd eval`) and from Python. Models are loaded one at a time. With
    out_dir, writes <label>.items.jsonl, <label>.summary.json and a combined summary.json there. The
    ``cpu`` section's plan lays the weights out and tunes the engine on a CPU as training's does.
    """
    models = cfg.model_paths()
    grader = resolve_grader(cfg.eval.grader, "eval.grader")  # before any model loads: one line for a bad name
    check_settings(cfg.eval, cfg.rollout.batch_size)
    examples, rows_in_file = heldout_examples(cfg)
    # Every tokenizer first: a typo in the last model path fails before hours of generating for the first.
    tokenizers = [load_tokenizer(m) for m in models]
    built = _Built.make(cfg)
    run = EvalRun(
        grader=lambda r, g: as_grade(grader(r, g)), seed=cfg.seed, batch_size=cfg.rollout.batch_size
    )
    results: dict[str, EvalResult] = {}
    for name, label, tok in zip(models, _labels(models), tokenizers, strict=True):
        hf_model, eng = _load_for_eval(name, tok, cfg, built)
        res = evaluate_model(
            hf_model,
            tok,
            examples,
            cfg.eval,
            cfg.data,
            replace(run, engine=eng, name=label, progress=progress),
        )
        res.settings.update(device=str(built.device), dtype=dtype_name(built.compute))
        results[label] = res
        if out_dir is not None:
            extra = {"model": name, "data": str(cfg.eval.path), "rows_in_file": rows_in_file}
            write_outputs(res, Path(out_dir), label, extra)
        eng.close()
        del eng, hf_model
        empty_cache(built.device)
    if out_dir is not None:
        _write_summary(Path(out_dir), results, models, cfg)
    return results


def heldout_examples(cfg: EvalCommand) -> tuple[list[Example], int]:
    """``eval.path``'s rows (``eval.rows``, the first ``eval.limit``), each with its answer, and the
    file's row count."""
    e = cfg.eval
    report = load_examples(
        e.path,
        RowKeys(problem=cfg.data.problem_key, solution=None, answer=e.answer_key),
        split=e.split,
        require_answer=True,
    )
    return take_rows(report.examples, e.rows, "eval.rows", e.path)[: e.limit], len(report.examples)


@dataclass
class _Built:
    """What every model's evaluation shares, resolved once: the device, the compute dtype (the trainer's
    resolver: auto is bf16 where the device has bf16 matrix units), the engine that runs and the CPU
    plan."""

    device: torch.device
    compute: torch.dtype
    kind: str
    plan: CpuPlan

    @classmethod
    def make(cls, cfg: EvalCommand) -> _Built:
        dev = resolve_device(cfg.device)
        compute = resolve_precision(cfg.model.dtype, dev, full_finetune=False).compute
        kind, _ = resolve_engine(cfg.rollout.engine)
        # Nothing trains here: rows are never packed, every weight is laid out for decoding.
        plan = replace(resolve_plan(cfg.cpu, dev, compute, engine=kind), pack_rows=False)
        return cls(dev, compute, kind, plan)


def _load_for_eval(name: str, tok, cfg: EvalCommand, built: _Built) -> tuple[nn.Module, RolloutEngine]:
    """One model and its engine, under the CPU plan. vLLM loads its own copy from the path; the HF copy
    then stays on the CPU and only feeds the initial weight sync."""
    vllm = built.kind == "vllm"
    hf_model = load_model(name, dtype=dtype_name(built.compute), device="cpu" if vllm else str(built.device))
    if not vllm:
        apply_plan(built.plan, hf_model.requires_grad_(False), params=0)
    path = str(resolve_model_path(name)) if vllm else None
    run = EngineRun(seed=cfg.seed, max_prompt_len=cfg.data.max_prompt_len, model_path=path, plan=built.plan)
    eng = make_engine(cfg.engine_rollout(), hf_model, tok, run=run, kind=built.kind)
    return hf_model, eng


def _write_summary(
    out_dir: Path, results: dict[str, EvalResult], models: list[str], cfg: EvalCommand
) -> None:
    """The combined summary.json: every model's summary beside the data and the machine."""
    combined = {
        "data": str(cfg.eval.path),
        "answer_key": cfg.eval.answer_key,
        "problem_key": cfg.data.problem_key,
        "machine": machine_info(),
        "created": datetime.now().isoformat(timespec="seconds"),
        "models": {
            label: {"model": m, **r.summary()} for (label, r), m in zip(results.items(), models, strict=True)
        },
    }
    _write_json(out_dir / "summary.json", combined)


# ----------------------------------------------------------------------------------------------
# `opsd eval`'s flags: shorthands for the keys of opsd.config.EvalCommand, the sections `opsd train` reads.

_KEY_LIKE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")

# argparse dest -> EvalCommand key (--model: model.path, then models). Anything else is an override.
EVAL_FLAGS = {
    "dtype": "model.dtype",
    "data": "eval.path",
    "problem_key": "data.problem_key",
    "answer_key": "eval.answer_key",
    "split": "eval.split",
    "instruction": "data.instruction",
    "enable_thinking": "data.student_thinking",
    "max_prompt_len": "data.max_prompt_len",
    "limit": "eval.limit",
    "engine": "rollout.engine",
    "temperature": "eval.temperature",
    "top_p": "eval.top_p",
    "max_new_tokens": "eval.max_new_tokens",
    "batch_size": "rollout.batch_size",
    "k": "eval.k",
    "grader": "eval.grader",
    "seed": "seed",
    "device": "device",
    "out": "out",
}


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Accuracy of one or more models on a dataset with answers. Config from YAML (--config) and/or "
        "section.key=value overrides, as for `opsd train`; the flags are shorthands for those keys, "
        "e.g. `opsd eval --model base trained --data math500.jsonl --k 4` = "
        "`opsd eval model.path=base models=[trained] eval.path=math500.jsonl eval.k=4`."
    )
    p.add_argument("--config", type=Path, help="YAML with the keys of opsd.config.EvalCommand")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. eval.temperature=0"
    )
    p.add_argument(
        "--model",
        "-m",
        action="extend",
        nargs="+",
        help="model.path (then models): model dir or fetched short name; several for a side-by-side table",
    )
    p.add_argument("--data", help="eval.path: JSONL/JSON/Parquet/CSV file or save_to_disk dir")
    p.add_argument("--k", type=int, help="eval.k: samples per problem (Avg@k, pass@k); default 1")
    p.add_argument(
        "--grader",
        help="eval.grader: math (default; math-verify on the last \\boxed{}), lenient, last_number (the "
        'response\'s last number), answer_is (the number after the last "The answer is"), contains (the '
        "gold as a whole word or phrase), exact, or package.module:function, as in training",
    )
    p.add_argument("--temperature", type=float, help="eval.temperature (default 0.6; 0 = greedy)")
    p.add_argument("--top-p", type=float, help="eval.top_p (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, help="eval.max_new_tokens (default 1024)")
    p.add_argument(
        "--max-prompt-len", type=int, help="data.max_prompt_len: cut longer prompts (counted; default 1024)"
    )
    p.add_argument(
        "--thinking",
        dest="enable_thinking",
        action="store_true",
        default=None,
        help="data.student_thinking=true: enable_thinking in the chat template",
    )
    p.add_argument("--no-thinking", dest="enable_thinking", action="store_false")
    p.add_argument("--engine", help="rollout.engine: hf (default), vllm or auto")
    p.add_argument("--answer-key", help="eval.answer_key: gold answer field (GSM8K '#### N' understood)")
    p.add_argument("--problem-key", help="data.problem_key: problem field (GSM8K: question)")
    p.add_argument("--split", help="eval.split for dataset directories / hub names (default test)")
    p.add_argument("--instruction", help="data.instruction: appended to each problem, as in training")
    p.add_argument("--limit", type=int, help="eval.limit: evaluate the first N problems only")
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
    """`opsd eval`: flags and overrides -> :class:`opsd.config.EvalCommand` -> :func:`evaluate`, table
    printed."""
    models, stray = _split_overrides(args.model)
    given = [f"model.path={json.dumps(models[0])}", f"models={json.dumps(models[1:])}"] if models else []
    overrides = [*given, *flag_overrides(args, EVAL_FLAGS), *stray, *args.overrides]
    cfg = load_config(args.config, overrides, schema=EvalCommand)
    stem = Path(cfg.eval.path).stem
    out = Path(cfg.out or f"runs/eval-{stem}-{datetime.now():%Y%m%d-%H%M%S}")
    results = evaluate(cfg, out_dir=out, progress=True)
    print(format_eval_table(results))
    print(f"wrote {out}/summary.json and per-item JSONL")
    return 0
