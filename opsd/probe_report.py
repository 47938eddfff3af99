"""`opsd probe`'s verdict and its printed table: go or no-go from the probe's figures, and the figures
as a short table (:mod:`opsd.probe` measures them; this module only reads them)."""

from __future__ import annotations

MIN_TEACHER_STOPS = 0.5  # below this share of ceiling answers ending on their own, the teacher rambles
MAX_SAMPLE_TRUNCATION = 0.5  # above this share of rollouts cut at the limit, the teacher scores noise
# Below this, control B's forward-KL step departs from OPSD's by less than half of OPSD's own size.
MIN_SOLUTION_RATIO = 0.5


def verdict(probe: dict) -> tuple[str, list[str]]:
    """``("go" | "no-go", reasons)`` from the probe's figures; the first reason is the headline."""
    student, ceiling = probe["student"], probe["ceiling"]
    gain, lo, hi = probe["headroom"]
    no: list[str] = []
    if ceiling["accuracy"] <= student["accuracy"] or lo <= 0:
        no.append(
            f"with the solution in its prompt the model scores {ceiling['accuracy']:.1%} in this answer "
            f"format against {student['accuracy']:.1%} without it (headroom {gain:+.1%}, 95% interval "
            f"[{lo:+.1%}, {hi:+.1%}]): the teacher knows nothing the student does not"
        )
    stops = 1 - ceiling["truncated"]  # answers stopped by the cut count as ending: an upper bound
    cut = ceiling.get("cut", 0.0)
    if stops < MIN_TEACHER_STOPS:
        no.append(
            f"the teacher rarely stops: {stops:.0%} of its answers end before eval.max_new_tokens; the "
            "student would learn not to stop (try another data.teacher_template)"
        )
    undecided = stops - cut < MIN_TEACHER_STOPS <= stops
    sampled = probe["sampled"]
    if sampled["truncated"] > MAX_SAMPLE_TRUNCATION:
        no.append(
            f"{sampled['truncated']:.0%} of the student's rollouts run to rollout.max_new_tokens at "
            f"rollout.temperature={probe['settings']['rollout_temperature']}: the teacher would score mostly "
            "unfinished text (lower the temperature or raise the limit)"
        )
    notes: list[str] = []
    if undecided:
        notes.append(
            f"whether the teacher stops is open: {stops - cut:.0%} of its answers ended before "
            f"eval.max_new_tokens and {cut:.0%} were stopped by the answer cut after their answer "
            "(--no-cut measures how many of those end)"
        )
    other = probe["ceiling_other"]
    own = probe.get("ceiling_on_controls", ceiling["accuracy"])  # on the controls' problems
    if other is not None and other["accuracy"] >= own:
        notes.append(
            f"another problem's solution gives the teacher {other['accuracy']:.1%}, as much as its own: the "
            "gain would come from reading a worked solution, not this problem's"
        )
    tokens = probe["tokens"]
    if tokens and tokens["steps_away"] > 0:
        notes.append(
            f"{tokens['steps_away']:.1%} of the sampled tokens step away from their teacher under "
            "loss.clip_mode=entry (loss.clip_mode=scale or none keep every step a descent)"
        )
    ratio = tokens.get("solution_ratio") if tokens else None
    if ratio is not None and ratio < MIN_SOLUTION_RATIO:
        notes.append(
            f"on the student's own tokens, control B's step (the teacher reading another problem's "
            f"solution) departs from OPSD's by {ratio:.2f} of OPSD's own size: most of OPSD's step does not "
            "depend on this problem's solution, so OPSD may teach little more than control B"
        )
    pull = tokens and tokens["end_teacher"] is not None and tokens["end_student"] is not None
    if pull and tokens["end_teacher"] < 0.5 * tokens["end_student"]:
        notes.append(
            f"where the student ends, the teacher gives the end token {tokens['end_teacher']:.2f} against "
            f"the student's {tokens['end_student']:.2f}: OPSD will push the student to go on"
        )
    if no:
        return "no-go", no + notes
    return "go", [f"headroom {gain:+.1%} [{lo:+.1%}, {hi:+.1%}] over {probe['problems']} problems", *notes]


def format_probe(p: dict) -> str:
    """The probe as a short table and its verdict."""
    from opsd.loss.overlap import OVERLAP_K

    named = [
        ("student, greedy", "student"),
        (f"student, sampled at T={p['settings']['rollout_temperature']}", "sampled"),
        ("teacher ceiling (its solution)", "ceiling"),
        ("ceiling, another problem's solution", "ceiling_other"),
        ("ceiling, wrong final answer", "ceiling_wrong_answer"),
    ]
    lines = [
        f"| answers ({p['settings']['grader']}) | problems | accuracy [95%] | truncated | stopped after "
        "their answer | length |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in named:
        a = p[key]
        if a is not None:
            n = a.get("problems") or p["problems"]
            lo, hi = a.get("interval") or (a["accuracy"], a["accuracy"])
            lines.append(
                f"| {name} | {n} | {a['accuracy']:.1%} [{lo:.1%}, {hi:.1%}] | {a['truncated']:.1%} | "
                f"{a.get('cut', 0.0):.1%} | {a['resp_len']:.0f} |"
            )
    t = p["tokens"]
    ref = p["reference_end"]
    lines += [
        "",
        *_cut_lines(p.get("cut")),
        f"on {t['tokens']} sampled tokens ({p['settings']['loss']}): divergence {t['divergence']:.3f}, "
        f"teacher top-1 differs {t['top1_differs']:.1%}, "
        f"top-{OVERLAP_K} overlap mass {t['overlap_mass']:.3f}, "
        f"clip removes {t['clip_removed']:.1%}, steps away from the teacher {t['steps_away']:.1%}",
        f"control B's teacher (another problem's solution) from the teacher, over the student's distance: "
        f"{_p(t.get('solution_ratio'))} (L1); the two teachers' top-1 differ on "
        f"{_p(t.get('solution_top1_differs'), '.1%')} of the tokens",
        f"end token where the student ended ({t['end_tokens']} responses): teacher {_p(t['end_teacher'])}, "
        f"student {_p(t['end_student'])} (teacher after correct {_p(t['end_teacher_correct'])}, after wrong "
        f"{_p(t['end_teacher_wrong'])}); after the reference solution: teacher {_p(ref['teacher'])}, "
        f"student {_p(ref['student'])}",
        "",
        f"verdict: {p['verdict']}: " + "; ".join(p["reasons"]),
        f"({p['seconds']:.0f} s: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in p.get("phase_seconds", {}).items())
        + ")",
    ]
    return "\n".join(lines)


def _cut_lines(cut: dict | None) -> list[str]:
    """What the answer cut did, in words, and its cost in grades on the (never cut) sampled responses."""
    if cut is None:
        return ["greedy answers: whole (no answer cut)"]
    lines = [
        "greedy answers stopped once their first answer was complete (the answer cut; --no-cut turns it "
        "off): a later answer, which the grader would read, is never written; lengths count them to the cut"
    ]
    s = cut.get("sampled")
    if s:
        lines.append(
            f"on the {s['responses']} sampled responses (not cut): {s['stopped']} would have been stopped, "
            f"{s['changed']} of them graded otherwise (a later answer differs from the first)"
        )
    return lines


def _p(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else f"{x:{fmt}}"
