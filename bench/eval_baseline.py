"""Baseline MATH-500 and GSM8K accuracy of SmolLM2-135M-Instruct, k=1 greedy, on a fixed prefix subset.

Run: python bench/eval_baseline.py [--n 100] [--budget-min 11] [--datasets MATH-500,GSM8K] [--reuse]
Writes the "## Eval baseline (bench/eval_baseline.py)" section of docs/results.md; per-item JSONL and
per-dataset results go to runs/bench-eval/. On a CPU machine the full sets are far too slow, so it
times the first batch and evaluates the first N problems that fit the time budget (N is recorded).
--reuse keeps a dataset's saved result when its settings match, so one dataset can be re-run alone.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import _common
from _md import write_section

from opsd.config import EvalConfig
from opsd.data import DEFAULT_INSTRUCTION, RowKeys, load_examples
from opsd.devices import machine_info
from opsd.eval import EvalRun, evaluate_model
from opsd.fetch import cached_model_path
from opsd.grading import grade_lenient
from opsd.models import load_model, load_tokenizer

ROOT = _common.ROOT
HEADING = "## Eval baseline (bench/eval_baseline.py)"
SHARED = ROOT.parent / "shared" / "data"
OUT_DIR = ROOT / "runs" / "bench-eval"
DATASETS = {  # name -> (file, problem key, answer key)
    "MATH-500": ("math500_test.jsonl", "problem", "answer"),
    "GSM8K": ("gsm8k_test.jsonl", "question", "answer"),
}


def _settings(args: argparse.Namespace) -> dict:
    return {"k": 1, "temperature": 0.0, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}


def run_dataset(model, tok, name: str, args: argparse.Namespace) -> dict:
    fname, pkey, akey = DATASETS[name]
    examples = load_examples(
        str(SHARED / fname), RowKeys(problem=pkey, solution=None, answer=akey), require_answer=True
    ).examples
    s = _settings(args)
    e = EvalConfig(k=1, temperature=0.0, max_new_tokens=s["max_new_tokens"])
    run = EvalRun(batch_size=s["batch_size"], progress=True)
    # Greedy decoding: the probe batch is exactly the first chunk of the full run, so it is kept.
    probe = evaluate_model(model, tok, examples[: args.batch_size], e, run=replace(run, name=f"{name} probe"))
    per_problem = probe.seconds / probe.num_problems
    n = min(args.n, len(examples), max(probe.num_problems, int(args.budget_min * 60 / per_problem)))
    print(f"{name}: {per_problem:.2f} s/problem in the probe -> evaluating the first {n}", flush=True)
    items, seconds = list(probe.items), probe.seconds
    if n > probe.num_problems:
        rest = evaluate_model(model, tok, examples[probe.num_problems : n], e, run=replace(run, name=name))
        items += rest.items
        seconds += rest.seconds
    stem = fname.removesuffix(".jsonl")
    with (OUT_DIR / f"{stem}.items.jsonl").open("w") as f:
        for i, it in enumerate(items):
            f.write(json.dumps({**it, "index": i}, ensure_ascii=False) + "\n")
    result = {
        "dataset": name,
        "n": n,
        "of": len(examples),
        "seconds": round(seconds, 1),
        "budget_min": args.budget_min,
        "settings": s,
        "load_avg_end": _common.load_avg(),
        "date": f"{datetime.now():%Y-%m-%d}",
    }
    (OUT_DIR / f"{stem}.result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def wilson(c: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval: unlike p +- s.e., it is not [0, 0] for 0 correct out of a small n."""
    p, d = c / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def summarize(result: dict) -> dict:
    stem = DATASETS[result["dataset"]][0].removesuffix(".jsonl")
    items = [json.loads(x) for x in (OUT_DIR / f"{stem}.items.jsonl").read_text().splitlines()]
    n = len(items)
    correct = sum(it["num_correct"] for it in items)
    # math-verify's own extraction on the whole response: a 135M model rarely boxes its answer, and a
    # strict 0% alone says nothing about whether it can do the arithmetic.
    lenient = sum(grade_lenient(r, it["gold_normalized"]).correct for it in items for r in it["responses"])
    acc = correct / n
    return {
        **result,
        "n": n,
        "correct": correct,
        "acc": acc,
        "ci95": wilson(correct, n),
        "lenient": lenient,
        "no_box": sum(x is None for it in items for x in it["extracted"]) / n,
        "truncated": sum(r == "length" for it in items for r in it["finish_reasons"]) / n,
        "resp_len": sum(t for it in items for t in it["response_tokens"]) / n,
        "errors": sum(e is not None for it in items for e in it["errors"]),
    }


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=100, help="at most this many problems per dataset (a prefix)")
    p.add_argument("--budget-min", type=float, default=11.0, help="time budget per dataset, minutes")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--datasets", default="MATH-500,GSM8K", help="which to (re)run; the section lists all saved"
    )
    p.add_argument("--reuse", action="store_true", help="keep a saved result whose settings match")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    return p.parse_args()


def _table(rows: list[dict]) -> list[str]:
    """The section's table: one row per dataset's summary (:func:`summarize`)."""
    columns = [
        "dataset",
        "problems",
        "accuracy, strict `\\boxed{}` (avg@1 = pass@1)",
        "95% CI (Wilson)",
        "lenient (math-verify on whole response)",
        "no `\\boxed{}`",
        "truncated at max",
        "mean resp tokens",
        "grading errors",
        "time",
        "s/problem",
        "load avg at end",
    ]
    table = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        n = r["n"]
        cells = [
            r["dataset"],
            f"first {n} of {r['of']} ({r.get('budget_min', '?'):g}-min budget)",
            f"**{r['acc']:.1%}** ({r['correct']}/{n})",
            f"{r['ci95'][0]:.1%}-{r['ci95'][1]:.1%}",
            f"{r['lenient'] / n:.1%} ({r['lenient']}/{n})",
            f"{r['no_box']:.0%}",
            f"{r['truncated']:.0%}",
            f"{r['resp_len']:.0f}",
            f"{r['errors']}",
            f"{r['seconds'] / 60:.1f} min",
            f"{r['seconds'] / n:.0f}",
            f"{r['load_avg_end']:.1f}",
        ]
        table.append("| " + " | ".join(cells) + " |")
    return table


def _body(rows: list[dict], path: Path, args: argparse.Namespace) -> str:
    """The results.md section: the table and how it was measured."""
    machine = machine_info()
    cores = machine["cpu_count"]
    return "\n".join(
        [
            f"SmolLM2-135M-Instruct (`{path.name}`, fetched by `opsd fetch-model`), measured "
            f"{rows[0]['date']} with `python bench/eval_baseline.py` (`--budget-min` per dataset as in the "
            "table).",
            "",
            *_table(rows),
            "",
            f"- Settings: k=1, greedy (temperature 0), max_new_tokens={args.max_new_tokens}, HF engine batch "
            f"{args.batch_size}, float32, the training chat template and student instruction "
            f"({DEFAULT_INSTRUCTION!r}), enable_thinking unset.",
            "- Strict accuracy is what `opsd eval` reports: math-verify on the last `\\boxed{}` (GSM8K "
            "gold: the number after `####`). The lenient column lets math-verify extract the answer from "
            "the whole response instead; it shows what the model gets right without following the output "
            "format.",
            "- Subset: the first N problems in file order; N is what fitted the time budget after timing "
            "the first batch (the target was 100). Small N means wide error bars: compare like with like.",
            f"- Machine: {machine['cpu']} ({machine['cpu_isa']}), {cores} CPU cores, "
            f"{machine.get('gpu', 'no GPU')}, torch {machine['torch']}, Python {machine['python']}. Other "
            f"jobs shared the {cores} cores (1-min load average in the last column; above {cores} means "
            "contention), so the times are upper bounds.",
            "- Per-item responses and verdicts: `runs/bench-eval/*.items.jsonl` (not committed).",
            *[f"- {r['dataset']}: {r['note']}." for r in rows if r.get("note")],
        ]
    )


def main() -> int:
    args = _parse_args()
    path = cached_model_path("smollm2-135m-instruct")
    if path is None:
        print("SKIP: SmolLM2-135M-Instruct is not fetched; run `opsd fetch-model smollm2-135m-instruct`")
        return 0
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if unknown := [d for d in names if d not in DATASETS]:
        raise ValueError(f"unknown datasets {unknown}; allowed: {sorted(DATASETS)}")
    missing = [DATASETS[d][0] for d in names if not (SHARED / DATASETS[d][0]).exists()]
    if missing:
        print(f"SKIP: {missing} not found in {SHARED}")
        return 0

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    model = tok = None
    for name in names:
        saved = OUT_DIR / f"{DATASETS[name][0].removesuffix('.jsonl')}.result.json"
        if args.reuse and saved.exists() and json.loads(saved.read_text())["settings"] == _settings(args):
            print(f"{name}: reusing {saved}")
            continue
        if model is None:
            tok = load_tokenizer(str(path))
            model = load_model(str(path), dtype="float32", device="cpu")
        run_dataset(model, tok, name, args)

    rows = []
    for fname, _, _ in DATASETS.values():
        saved = OUT_DIR / f"{fname.removesuffix('.jsonl')}.result.json"
        if saved.exists() and json.loads(saved.read_text())["settings"] == _settings(args):
            rows.append(summarize(json.loads(saved.read_text())))
    body = _body(rows, path, args)
    write_section(args.out, HEADING, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
