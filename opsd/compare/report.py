"""The comparison's report: the table (compare.md) with its Wilson and paired intervals, and the plot
(compare.png)."""

from __future__ import annotations

import math
from pathlib import Path

from opsd.compare.plan import Variant, label
from opsd.metrics import mean


def _runs(result: dict, method: str) -> list[dict]:
    return [r for r in result["runs"] if r["method"] == method]


def _spread(xs: list[float]) -> str:
    mean = sum(xs) / len(xs)
    half = (max(xs) - min(xs)) / 2
    return f"{100 * mean:.1f}%" + (f" ± {100 * half:.1f}" if len(xs) > 1 else "")


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``p`` observed over ``n`` trials (here problems)."""
    if n <= 0:
        return (0.0, 1.0)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_interval(a: list[float], b: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean of ``a - b`` over the same problems with its normal 95% interval: the paired difference of
    two accuracies, whose variance is that of the per-problem differences (two methods that fail and
    succeed on the same problems differ with a far narrower interval than two Wilson intervals show)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired interval needs two equal, non-empty lists, got {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(n - 1, 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def _per_problem(points: list[dict]) -> list[float] | None:
    """Per problem, the mean over seeds of its share correct; None where a point did not record it."""
    lists = [p.get("correct") for p in points]
    if not lists or any(x is None for x in lists) or len({len(x) for x in lists}) != 1:
        return None
    return [sum(xs) / len(xs) for xs in zip(*lists)]


def _difference(a: list[dict], b: list[dict]) -> str:
    """``a - b`` in points with its paired 95% interval, or "-" without per-problem records."""
    pa, pb = _per_problem(a), _per_problem(b)
    if pa is None or pb is None or len(pa) != len(pb):
        return "-"
    mean, lo, hi = paired_interval(pa, pb)
    return f"{100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _acc(ps: list[dict]) -> str:
    """Mean strict accuracy over seeds (± half the range), with the 95% Wilson interval over the
    held-out problems at that mean."""
    text = _spread([p["accuracy"] for p in ps])
    n = ps[0].get("problems", 0)
    if n:
        lo, hi = wilson(sum(p["accuracy"] for p in ps) / len(ps), n)
        text += f" [{100 * lo:.1f}, {100 * hi:.1f}]"
    return text


def _avg(ps: list[dict], key: str, fmt: str, scale: float = 1.0) -> str:
    """The mean of ``key`` over the points that recorded it, formatted; "-" where none did."""
    m = mean([p[key] for p in ps if p.get(key) is not None])
    return "-" if m is None else format(scale * m, fmt)


def _best(points: list[dict]) -> dict:
    """The first evaluation at the run's highest strict accuracy: what reaching its best cost."""
    return max(points, key=lambda p: (p["accuracy"], -p["step"]))


def _cells(ps: list[dict]) -> list[str | None]:
    """A row's accuracy, lenient accuracy, gain (filled in by the caller), length, truncation,
    repetition and divergence."""
    return [
        _acc(ps),
        _avg(ps, "lenient", ".1f", 100),
        None,
        _avg(ps, "resp_len", ".0f"),
        _avg(ps, "truncated", ".1%"),
        _avg(ps, "repetition", ".1%"),
        _avg(ps, "divergence", ".4f"),
    ]


def format_comparison_table(result: dict) -> str:
    """Per method (the base model first): strict accuracy with its 95% Wilson interval over problems,
    lenient accuracy, gain over the base model, mean response length, truncation and repetition,
    held-out divergence, and the cost of reaching its best evaluation (step, generated tokens, tokens
    the teacher scored, training wall time); means over seeds. The teacher's ceiling and the budget
    underneath."""
    lines = [
        "| method | accuracy [95% CI] | lenient | gain [paired 95% CI] | gap closed | length | truncated "
        "| repetition | divergence | best at step | generated tokens | teacher tokens | train time | lr |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lr = result["lr"]
    firsts = [r["points"][0] for r in result["runs"]]
    seen_seeds, base = set(), []
    for r, p in zip(result["runs"], firsts, strict=True):
        if r["seed"] not in seen_seeds:
            seen_seeds.add(r["seed"])
            base.append(p)
    top = (result.get("ceiling") or {}).get("accuracy")  # the teacher's ceiling
    row = _cells(base)
    lines.append(
        f"| base model | {row[0]} | {row[1]} | - | - | {' | '.join(row[3:])} | 0 | 0 | 0 | 0 s | - |"
    )
    for m in result["methods"]:
        runs = _runs(result, m)
        final = [r["points"][-1] for r in runs]
        best = [_best(r["points"]) for r in runs]
        gains = [r["points"][-1]["accuracy"] - r["points"][0]["accuracy"] for r in runs]
        row = _cells(final)
        gain = sum(gains) / len(gains)
        paired = _difference(final, [r["points"][0] for r in runs])
        row[2] = paired if paired != "-" else f"{100 * gain:+.1f}"
        start = sum(r["points"][0]["accuracy"] for r in runs) / len(runs)
        closed = f"{gain / (top - start):.1%}" if top is not None and top > start else "-"
        row.insert(3, closed)
        rate = runs[0].get("lr") or lr.get(m, lr["grpo"] if m == "mixed" else lr["opsd"])
        cost = [
            _avg(best, "step", ".0f"),
            _avg(best, "generated_tokens", ",.0f"),
            _avg(best, "teacher_tokens", ",.0f"),
            _avg(best, "train_seconds", ".0f") + " s",
        ]
        lines.append(f"| {label(result, m)} | {' | '.join(row)} | {' | '.join(cost)} | {rate:.3g} |")
    lines += _paired_block(result)
    lines += chosen_block(result)
    b = result["budget"]
    lines += [
        "",
        f"Base model: {_spread([p['accuracy'] for p in base])} held-out accuracy. Seeds {result['seeds']}; "
        f"{b['steps']} steps, {b['responses_per_step']} responses per step; GRPO {result['grpo']} "
        f"({result['grpo_source']}); GRPO + distillation {result.get('mixed', result['grpo'])} "
        f"({result.get('mixed_source', 'GRPO')}) with grpo.distill_coef={result['distill_coef']}.",
    ]
    for r in result["runs"]:
        if r.get("stopped_by"):
            lines.append(f"{label(result, r['method'])}, seed {r['seed']}: stopped by {r['stopped_by']}.")
    ceiling = result.get("ceiling")
    if ceiling and ceiling.get("accuracy") is not None:
        lenient = "" if ceiling.get("lenient") is None else f", lenient {100 * ceiling['lenient']:.1f}%"
        lo, hi = wilson(ceiling["accuracy"], ceiling["problems"])
        lines.append(
            f"Teacher's ceiling (the base model with each held-out solution in its prompt): "
            f"{100 * ceiling['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]{lenient}."
        )
    elif ceiling:
        lines.append(f"Teacher's ceiling: not measured ({ceiling.get('why')}).")
    lines.append(
        "accuracy: eval.grader over problems x eval.k, [95% Wilson interval over the problems]; lenient: "
        "eval.lenient_grader; gain: final minus step 0 in points, [paired 95% interval over the same "
        "problems]; gap closed: gain / (teacher's ceiling - step 0); length: mean response tokens; "
        "truncated: share cut at eval.max_new_tokens; repetition: mean share of repeated word 4-grams per "
        "response; best at step: the first evaluation at the run's highest accuracy, and what reaching it "
        "cost (teacher tokens: response tokens the teacher scored; 0 for GRPO and SFT)."
    )
    return "\n".join(lines)


def _kind(result: dict, method: str) -> str:
    variant = result.get("variants", {}).get(method)
    return variant["method"] if variant else method


def _paired_block(result: dict) -> list[str]:
    """Each OPSD method's final accuracy against every other kind of method's, on the same problems
    (mean over seeds per problem): the difference in points with its paired 95% interval."""
    finals = {m: [r["points"][-1] for r in _runs(result, m)] for m in result["methods"]}
    opsd = [m for m in result["methods"] if _kind(result, m) == "opsd"]
    others = [m for m in result["methods"] if _kind(result, m) != "opsd"]
    rows = [
        f"| {label(result, a)} | {label(result, b)} | {_difference(finals[a], finals[b])} |"
        for a in opsd
        for b in others
        if _difference(finals[a], finals[b]) != "-"
    ]
    if not rows:
        return []
    return ["", "| method | against | difference in points [paired 95% CI] |", "|---|---|---|", *rows, ""]


def _set_names(result: dict) -> list[str]:
    """The ``eval.sets`` names the base evaluation recorded, in their order."""
    first = result["runs"][0]["points"][0] if result["runs"] else {}
    return list(first.get("sets") or {})


def _rate(result: dict, run: dict) -> str:
    return f"{run.get('lr') or result['lr']['opsd']:.3g}"


def chosen_block(result: dict) -> list[str]:
    """Per run, at the evaluation it picked on eval.path (the first at its highest accuracy, where the
    sets were evaluated): eval.path's accuracy and every set's, with a drift set's drift and a split
    set's seen / other accuracy; then each run on the first set against its seed's base, with paired 95%
    intervals over the set's problems. Empty without ``eval.sets``."""
    names = _set_names(result)
    if not names:
        return []
    head = ["run", "lr", "step", "eval.path"]
    for name in names:
        head.append(name)
        base_set = result["runs"][0]["points"][0]["sets"][name]
        if base_set.get("seen") is not None:
            head.append(f"{name} seen / other")
        if base_set.get("drift") is not None:
            head.append(f"{name} drift")
    head += ["artifacts", "length"]
    lines = ["", "At the step each run picked on eval.path:", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    bases = {r["seed"]: r["points"][0] for r in result["runs"]}
    rows = [("base model", "-", p, seed) for seed, p in bases.items()]
    rows += [
        (f"{label(result, r['method'])} seed {r['seed']}", _rate(result, r), _best(r["points"]), r["seed"])
        for r in result["runs"]
    ]
    for name, rate, p, _ in rows:
        cells = [name, rate, str(p["step"]), f"{100 * p['accuracy']:.1f}%"]
        for s in names:
            got = (p.get("sets") or {}).get(s)
            cells.append("-" if got is None else f"{100 * got['accuracy']:.1f}%")
            if got is not None and got.get("seen") is not None:
                cells.append(f"{100 * got['seen']:.1f}% / {100 * (got['other'] or 0):.1f}%")
            if got is not None and got.get("drift") is not None:
                cells.append(f"{got['drift']:.4f}")
        cells.append("-" if p.get("artifacts") is None else f"{100 * p['artifacts']:.1f}%")
        cells.append("-" if p.get("resp_len") is None else f"{p['resp_len']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines + _chosen_pairs(result, names[0], bases, rows[len(bases) :])


def _chosen_pairs(result: dict, name: str, bases: dict, rows: list) -> list[str]:
    """Each run's accuracy on set ``name`` at its chosen step against its seed's base, in points with the
    paired 95% interval over the set's problems."""

    def correct(p: dict) -> list[float] | None:
        return ((p.get("sets") or {}).get(name) or {}).get("correct")

    lines = [
        "",
        f"On {name}, at the chosen steps:",
        "",
        "| run | against | difference in points [paired 95% CI] |",
    ]
    lines.append("|---|---|---|")
    for who, _, p, seed in rows:
        a, b = correct(p), correct(bases[seed])
        if a and b and len(a) == len(b):
            mean, lo, hi = paired_interval(a, b)
            lines.append(f"| {who} | base | {100 * mean:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] |")
    return lines


def plot_compare(path: Path, result: dict) -> Path:
    """Mean held-out accuracy against optimizer steps and against generated tokens, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for m in result["methods"]:
        runs = _runs(result, m)
        n = min(len(r["points"]) for r in runs)
        mean = [sum(r["points"][i]["accuracy"] for r in runs) / len(runs) for i in range(n)]
        steps = [runs[0]["points"][i]["step"] for i in range(n)]
        tokens = [sum(r["points"][i]["generated_tokens"] for r in runs) / len(runs) for i in range(n)]
        by_step.plot(steps, mean, marker="o", label=label(result, m))
        if m != "sft":
            by_tokens.plot(tokens, mean, marker="o", label=label(result, m))
    by_step.set(xlabel="optimizer step", ylabel="held-out accuracy", title="accuracy vs steps")
    by_tokens.set(xlabel="generated tokens", ylabel="held-out accuracy", title="accuracy vs generated tokens")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _family(result: dict, method: str) -> str:
    """A run's method without its learning rate: the runs of one method at several rates are one
    frontier."""
    variant = result.get("variants", {}).get(method)
    if not variant:
        return label(result, method)
    keys = tuple(k for k in variant["overrides"] if not k.startswith("optim.lr="))
    return Variant(method, variant["method"], keys).label() if keys else label(result, variant["method"])


def plot_frontier(path: Path, result: dict) -> Path | None:
    """Each run at the step it picked on eval.path: the first set's accuracy against the drift set's
    accuracy and against its drift, one colour per method (its runs at several learning rates are its
    frontier), the base model as a star. None without a set that has a drift."""
    names = _set_names(result)
    first = result["runs"][0]["points"][0]["sets"] if names else {}
    kept = [n for n in names if first[n].get("drift") is not None]
    if not names or not kept:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y_set, x_set = names[0], kept[0]
    fig, (by_acc, by_drift) = plt.subplots(1, 2, figsize=(11, 4.5))
    families: dict[str, list[dict]] = {}
    for r in result["runs"]:
        families.setdefault(_family(result, r["method"]), []).append(_best(r["points"]))
    for name, points in families.items():
        got = [p["sets"] for p in points if p.get("sets")]
        ys = [100 * g[y_set]["accuracy"] for g in got]
        by_acc.scatter([100 * g[x_set]["accuracy"] for g in got], ys, label=name)
        by_drift.scatter([g[x_set]["drift"] for g in got], ys, label=name)
    base = first
    by_acc.scatter([100 * base[x_set]["accuracy"]], [100 * base[y_set]["accuracy"]], marker="*", s=150, c="k")
    by_drift.scatter([0.0], [100 * base[y_set]["accuracy"]], marker="*", s=150, c="k", label="base model")
    by_acc.set(xlabel=f"{x_set} accuracy (%)", ylabel=f"{y_set} accuracy (%)", title="learned vs kept")
    by_drift.set(xlabel=f"{x_set} drift, KL(initial || model) per token", title="learned vs drift")
    by_drift.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
