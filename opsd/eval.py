"""`opsd eval`: sample k responses per problem, grade them with math-verify, report Avg@k and pass@k.

`evaluate_model` works on a live (model, tokenizer) so the trainer can evaluate every N steps without
reloading; `evaluate` loads models from paths for the CLI and writes per-item JSONL + summary JSON.
Prompts go through `opsd.data.student_prompt_ids`, exactly as in training, so scores match what
the student sees.
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
from typing import Any

import torch
from tqdm import tqdm

from opsd.data import DEFAULT_INSTRUCTION, Example, load_examples, student_prompt_ids
from opsd.grading import grade, normalize_gold, pass_at_k
from opsd.models import load_model, load_tokenizer, resolve_model_path
from opsd.rollout import HFEngine, SamplingParams, make_engine


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
        raise ValueError(f"k={k!r} must be an integer >= 1 (samples per problem)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens).validate()


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
) -> EvalResult:
    """Generate k samples per example with `engine` (default: an HFEngine on `model`) and grade them.

    Pass the trainer's own engine to evaluate with vLLM; it must already hold the current weights.
    Grading runs in the calling thread; math-verify timeouts only work on the main thread.
    """
    _check_settings(k, temperature, top_p, max_new_tokens, batch_size)
    if not examples:
        raise ValueError("no examples to evaluate")
    missing = [ex.row for ex in examples if ex.answer is None]
    if missing:
        raise ValueError(
            f"{len(missing)} examples have no gold answer (rows {missing[:10]}); load with require_answer=True"
        )
    if engine is None:
        engine = HFEngine(model, tokenizer, batch_size=batch_size)

    t0 = time.time()
    prompts: list[list[int]] = []
    prompts_truncated = 0
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

    # HF generates batch by batch anyway, so chunking costs nothing and gives progress; vLLM wants everything at once.
    chunk = batch_size if isinstance(engine, HFEngine) else len(prompts)
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
            items.append(_grade_item(start + j, ex, comps, tokenizer, k))
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
        },
        items=items,
    )


def _grade_item(index: int, ex: Example, comps: list, tokenizer: Any, k: int) -> dict[str, Any]:
    responses = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
    grades = [grade(r, ex.answer) for r in responses]
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
) -> dict[str, EvalResult]:
    """Evaluate one or more models (paths or fetched short names) on a data file; returns label -> result.

    Models are loaded one at a time. With out_dir, writes <label>.items.jsonl, <label>.summary.json and
    a combined summary.json there.
    """
    models = [model] if isinstance(model, str) else list(model)
    if not models:
        raise ValueError("no model given")
    _check_settings(k, temperature, top_p, max_new_tokens, batch_size)
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1")
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine {engine!r} unknown; allowed: ['hf', 'vllm']")
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
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")

    results: dict[str, EvalResult] = {}
    for name, label, tok in zip(models, _labels(models), tokenizers, strict=True):
        if engine == "vllm":
            # vLLM loads its own copy from the path; the HF copy on CPU only feeds the initial weight sync.
            hf_model = load_model(name, dtype="bfloat16", device="cpu")
            eng = make_engine("vllm", hf_model, tok, model_path=resolve_model_path(name), seed=seed)
        else:
            hf_model = load_model(name, dtype=dtype, device=device)
            eng = make_engine("hf", hf_model, tok, batch_size=batch_size)
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
        )
        res.settings.update(device=device, dtype=dtype if engine == "hf" else "bfloat16")
        results[label] = res
        if out_dir is not None:
            extra = {"model": name, "data": str(data), "rows_in_file": len(report.examples)}
            write_outputs(res, Path(out_dir), label, extra)
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


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        action="extend",
        nargs="+",
        required=True,
        help="model dir or fetched short name; repeat or list several for a side-by-side table",
    )
    p.add_argument("--data", required=True, help="JSONL/JSON/Parquet/CSV file or save_to_disk dir")
    p.add_argument("--k", type=int, default=1, help="samples per problem (Avg@k, pass@k)")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument(
        "--max-prompt-len", type=int, default=None, help="cut longer prompts (counted in the summary)"
    )
    p.add_argument(
        "--thinking",
        dest="enable_thinking",
        action="store_true",
        default=None,
        help="enable_thinking=True in the chat template",
    )
    p.add_argument("--no-thinking", dest="enable_thinking", action="store_false")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--answer-key", default="answer", help="gold answer field (GSM8K '#### N' understood)")
    p.add_argument("--problem-key", default="problem", help="problem field (GSM8K: question)")
    p.add_argument("--split", default="test", help="split for dataset directories / hub names")
    p.add_argument(
        "--instruction", default=DEFAULT_INSTRUCTION, help="appended to each problem, as in training"
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per HF generate call")
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--out", type=Path, default=None, help="output dir (default: runs/eval-<data>-<time>)")


def run_eval(args: argparse.Namespace) -> int:
    out = args.out or Path("runs") / f"eval-{Path(args.data).stem}-{datetime.now():%Y%m%d-%H%M%S}"
    results = evaluate(
        args.model,
        args.data,
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        enable_thinking=args.enable_thinking,
        engine=args.engine,
        answer_key=args.answer_key,
        problem_key=args.problem_key,
        split=args.split,
        instruction=args.instruction,
        max_prompt_len=args.max_prompt_len,
        limit=args.limit,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        out_dir=out,
        progress=True,
    )
    print(format_table(results))
    print(f"wrote {out}/summary.json and per-item JSONL")
    return 0
