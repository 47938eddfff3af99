"""`opsd report RUN_DIR`: PNG plots + report.md from a run's metrics.jsonl (and eval.jsonl), with the
best checkpoint and any guard stop (:mod:`opsd.guard`) marked on every plot.

Works on a run that is still being written (a partial last line is skipped and counted) and on a
resumed run (a step logged twice keeps its last record, which is what the resumed run computed).
`plot_panels` draws every opsd plot, the demo's included.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no global backend/state, renders with Agg

from opsd.errors import UserError
from opsd.metrics import REPETITION_N, RLSD_KEYS, TIME_KEYS
from opsd.records import read_best, read_stops

EVAL_PREFIX = "eval/"

# (file stem, title, panels); a panel is a list of keys sharing one y axis. A plot is drawn when any
# of its keys has data; "stack:" panels are drawn as a stacked area (the step-time breakdown). Keys
# are names from opsd.metrics.STEP_KEYS or OPTIONAL_KEYS (tests/commands/test_report.py checks it), and the
# step-time stack is opsd.metrics.TIME_KEYS, so a phase the trainer times is a phase this plot shows.
PLOTS: list[tuple[str, str, list[list[str]]]] = [
    ("loss", "Loss and mean divergence", [["loss"], ["divergence"]]),
    ("clip_frac", "Clip fraction", [["clip_frac"]]),
    ("entropy", "Student and teacher entropy", [["entropy_student", "entropy_teacher"]]),
    ("agreement", "Teacher-student top-1 agreement and top-16 overlap mass", [["agreement", "overlap_mass"]]),
    (
        "response_length",
        "Response length and truncation",
        [["resp_len_mean", "resp_len_max"], ["truncated_frac"]],
    ),
    (
        "throughput",
        "Throughput and step-time breakdown",
        [["tokens_per_s"], ["stack:" + k for k in TIME_KEYS]],
    ),
    ("repetition", f"Share of repeated {REPETITION_N}-grams per response", [["repetition"]]),
    ("optim", "Learning rate, grad norm and memory", [["lr"], ["grad_norm"], ["peak_mem_gb"]]),
    ("logprob_gap", "Rollout engine vs trainer: mean |log-prob difference| per token", [["logprob_gap"]]),
    ("reward", "GRPO: mean reward and groups without signal", [["reward_mean"], ["flat_group_frac"]]),
    (
        "rlsd",
        "RLSD: the teacher's share and its token weights",
        [[k] for k in RLSD_KEYS],
    ),
]


@dataclass
class RunMetrics:
    train: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> numeric train metrics
    eval: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> "eval/..." metrics
    bad_lines: list[str] = field(default_factory=list)  # "file:line (why)" for each skipped line
    replaced_steps: int = 0  # records superseded by a later record for the same step (resume)
    sources: list[str] = field(default_factory=list)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_jsonl(path: Path, metrics: RunMetrics, *, force_eval: bool) -> None:
    metrics.sources.append(str(path))
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            why = "partial last line, run still writing?" if lineno == len(lines) else "invalid JSON"
            metrics.bad_lines.append(f"{path.name}:{lineno} ({why})")
            continue
        if not isinstance(rec, dict) or not _is_number(rec.get("step")):
            metrics.bad_lines.append(f"{path.name}:{lineno} (no numeric 'step')")
            continue
        step = int(rec["step"])
        train_part: dict[str, float] = {}
        eval_part: dict[str, float] = {}
        for k, v in rec.items():
            if k == "step" or not _is_number(v):
                continue
            if k.startswith(EVAL_PREFIX):
                eval_part[k] = float(v)
            elif force_eval:
                eval_part[EVAL_PREFIX + k] = float(v)
            else:
                train_part[k] = float(v)
        # Train and eval records may share a step; dedupe each stream on its own.
        for part, table in ((train_part, metrics.train), (eval_part, metrics.eval)):
            if part:
                metrics.replaced_steps += step in table
                table[step] = part


def load_run_metrics(run_dir: Path) -> RunMetrics:
    """Read RUN_DIR/metrics.jsonl and RUN_DIR/eval.jsonl (either may be absent, not both)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a directory"
        raise UserError(f"run directory {run_dir} {what}")
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    if not metrics_path.exists() and not eval_path.exists():
        raise UserError(f"no metrics.jsonl or eval.jsonl in {run_dir}; is it a run directory?")
    metrics = RunMetrics()
    if metrics_path.exists():
        _read_jsonl(metrics_path, metrics, force_eval=False)
    if eval_path.exists():
        _read_jsonl(eval_path, metrics, force_eval=True)
    metrics.train = dict(sorted(metrics.train.items()))
    metrics.eval = dict(sorted(metrics.eval.items()))
    return metrics


@dataclass
class Panel:
    """One axis of a figure: named curves, optional constant levels (drawn dashed), labels."""

    series: dict[str, tuple[list[float], list[float]]]  # label -> (x, y)
    ylabel: str = ""
    xlabel: str = "step"
    hlines: dict[str, float] = field(default_factory=dict)  # label -> y
    stacked: bool = False  # the series as a stacked area (they must share x)
    ylim: tuple[float, float] | None = None
    vlines: dict[str, float] = field(default_factory=dict)  # label -> x (drawn dotted: marked steps)


def plot_panels(path: Path, title: str, panels: list[Panel], *, sharex: bool = True) -> Path:
    """Draw ``panels`` one above the other into the PNG ``path``; what every opsd plot is made with."""
    fig = Figure(figsize=(8, 2.6 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=sharex, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        if panel.stacked:
            xs = next(iter(panel.series.values()))[0]
            ax.stackplot(xs, [y for _, y in panel.series.values()], labels=list(panel.series), alpha=0.8)
        else:
            for label, (xs, ys) in panel.series.items():
                ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
        for label, y in panel.hlines.items():
            ax.axhline(y, ls="--", color="tab:green", label=label)
        for (label, x), color in zip(panel.vlines.items(), ("tab:green", "tab:red", "tab:purple") * 9):
            ax.axvline(x, ls=":", color=color, label=label)
        ax.set_ylabel(panel.ylabel)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        if not sharex:
            ax.set_xlabel(panel.xlabel)
    if sharex:
        axes[-1].set_xlabel(panels[-1].xlabel)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return Path(path)


def series(table: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of one metric in a table from :func:`load_run_metrics`."""
    steps = [s for s, rec in table.items() if key in rec]
    return steps, [table[s][key] for s in steps]


def _plot(
    path: Path,
    title: str,
    table: dict[int, dict[str, float]],
    panels: list[list[str]],
    marks: dict[str, float] | None = None,
) -> bool:
    drawn: list[Panel] = []
    for keys in panels:
        stacked = all(k.startswith("stack:") for k in keys)
        names = [k.removeprefix("stack:") for k in keys]
        if stacked:  # one shared x: every step that has any of the keys, a missing key counting 0
            steps = [s for s, rec in table.items() if any(k in rec for k in names)]
            found = {k: (steps, [table[s].get(k, 0.0) for s in steps]) for k in names if series(table, k)[0]}
        else:
            found = {k: series(table, k) for k in names if series(table, k)[0]}
        if found:
            ylabel = "seconds / step" if stacked else (names[0] if len(names) == 1 else "")
            drawn.append(Panel(found, ylabel=ylabel, stacked=stacked, vlines=dict(marks or {})))
    if not drawn:
        return False
    plot_panels(path, title, drawn)
    return True


def _eval_panels(table: dict[int, dict[str, float]]) -> list[list[str]]:
    """Accuracies (eval.path's and every eval.sets entry's, with their seen / other split) on one panel,
    drift from the initial model on another, the rest (lengths, truncation) on a third."""
    keys = sorted({k for rec in table.values() for k in rec})
    acc = [k for k in keys if any(t in k.lower() for t in ("avg@", "pass@", "acc", "/seen", "/other"))]
    drift = [k for k in keys if k.endswith("/drift")]
    other = [k for k in keys if k not in acc and k not in drift]
    return [p for p in (acc, drift, other) if p]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _final_table(table: dict[int, dict[str, float]], last_n: int = 10) -> list[str]:
    keys = list(dict.fromkeys(k for rec in table.values() for k in rec))
    rows = [f"| metric | final | step | mean of last {last_n} |", "|---|---|---|---|"]
    for k in keys:
        steps, ys = series(table, k)
        tail = ys[-last_n:]
        rows.append(f"| {k} | {_fmt(ys[-1])} | {steps[-1]} | {_fmt(sum(tail) / len(tail))} |")
    return rows


def run_marks(run_dir: Path) -> tuple[dict[str, float], list[str]]:
    """The steps a run's records mark (the best checkpoint of checkpoints/best.json, each guard stop of
    guard.jsonl; :mod:`opsd.records`) as plot label -> step, and their report.md lines."""
    marks: dict[str, float] = {}
    lines: list[str] = []
    best = read_best(run_dir)
    if best is not None:
        marks[f"best checkpoint (step {best['step']})"] = float(best["step"])
        lines.append(
            f"- best checkpoint: `checkpoints/{best['checkpoint']}`, {best['metric']}="
            f"{_fmt(float(best['value']))} at step {best['step']}"
        )
    for stop in read_stops(run_dir):
        marks[f"{stop['guard']} stop (step {stop['step']})"] = float(stop["step"])
        text = stop.get("line") or f"{stop['guard']} stopped the run after step {stop['step']}"
        lines.append(f"- guard stop: {text}")
    return marks, lines


def write_report(run_dir: Path) -> Path:
    """Write RUN_DIR/report/*.png and RUN_DIR/report/report.md; returns the report.md path."""
    run_dir = Path(run_dir)
    metrics = load_run_metrics(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)

    marks, mark_lines = run_marks(run_dir)
    images: list[tuple[str, str]] = []
    for stem, title, panels in PLOTS:
        if _plot(out / f"{stem}.png", title, metrics.train, panels, marks):
            images.append((stem, title))
    evals = _eval_panels(metrics.eval)
    if metrics.eval and _plot(out / "eval.png", "Eval accuracy", metrics.eval, evals, marks):
        images.append(("eval", "Eval accuracy"))

    md = [f"# Run report: {run_dir.resolve().name}", ""]
    train_steps = list(metrics.train)
    md.append(f"- sources: {', '.join(f'`{Path(s).name}`' for s in metrics.sources)}")
    if train_steps:
        md.append(f"- training steps logged: {len(train_steps)} (steps {train_steps[0]}..{train_steps[-1]})")
    else:
        md.append("- training steps logged: none yet")
    md.append(f"- eval points: {len(metrics.eval)}")
    if metrics.replaced_steps:
        md.append(
            f"- {metrics.replaced_steps} record(s) superseded by a later record for the same step "
            "(resumed run)"
        )
    if metrics.bad_lines:
        md.append(f"- {len(metrics.bad_lines)} line(s) skipped: {'; '.join(metrics.bad_lines[:10])}")
    md += [*mark_lines, ""]

    if metrics.train:
        md += ["## Final numbers", "", *_final_table(metrics.train), ""]
    if metrics.eval:
        md += ["## Eval", "", *_final_table(metrics.eval, last_n=3), ""]
    if images:
        md += ["## Plots", ""]
        md += [f"### {title}\n\n![{title}]({stem}.png)\n" for stem, title in images]

    config = next(
        (run_dir / n for n in ("config.yaml", "config.yml", "config.json") if (run_dir / n).exists()), None
    )
    if config is not None:
        lang = "json" if config.suffix == ".json" else "yaml"
        md += [
            "## Configuration",
            "",
            f"From `{config.name}`:",
            "",
            f"```{lang}",
            config.read_text().rstrip(),
            "```",
            "",
        ]

    report = out / "report.md"
    report.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return report


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir", type=Path, help="run directory holding metrics.jsonl (and eval.jsonl, config.yaml)"
    )


def run_report(args: argparse.Namespace) -> int:
    path = write_report(args.run_dir)
    print(f"wrote {path} ({len(list(path.parent.glob('*.png')))} plots)")
    return 0
