"""`opsd probe`: whether OPSD can help this model on this data, in minutes, before any training.

OPSD can pass on only what its teacher (the model reading the solution) knows and the student does
not, and only through tokens the student samples. So the probe measures, on the first ``--limit``
held-out problems (``eval.path``, whose rows need their solutions, ``data.solution_key``) and with the
run's own prompts, engine, grader and loss:

* the student's greedy accuracy (``eval.*`` settings), and its accuracy and truncation when sampled
  as rollouts are (``rollout.temperature``, ``rollout.max_new_tokens``): are its samples worth scoring?
* the teacher's ceiling: the model answering with the solution in the teacher prompt; the same
  with another problem's solution (the nearest following row whose solution differs: rows may share
  one) and with the final answer made wrong (the controls' teachers), on the first ``--control-limit``
  problems (each accuracy with its 95% Wilson interval);
* whether the teacher stops: the share of its ceiling answers that end before the limit, and its
  probability of the end token where the reference solution ends (the student's beside it);
* on the student's sampled responses, per token: the divergence to the teacher, the share of tokens
  whose top-1 differs, the teacher's mass on the two top-16 sets' overlap, the share of the
  divergence the configured clip removes, the share of tokens whose clipped gradient raises their
  own divergence (``entry``), and at the student's end token, the teacher's probability of ending
  beside the student's (:class:`TokenStats`' ``end_teacher`` and ``end_student``): where the teacher
  would rather go on, OPSD teaches the student not to stop;
* on the same tokens, whether the solution still matters there: the L1 distance between the teacher
  reading it and the teacher reading another problem's (control B's), over the teacher's distance from
  the student, and the share of tokens whose top-1 the two teachers disagree on. A ceiling far above
  control B's says the solution decides the teacher's own answers; these say whether it decides the
  pull on the tokens the student writes, where OPSD teaches. Forward KL's gradient on the student's
  logits is ``(S - P) / T``, so the ratio is how far control B's step departs from OPSD's, in OPSD's
  own size: below 1/2, most of OPSD's step is control B's, and OPSD may teach little more than it.

The verdict (:func:`opsd.probe_report.verdict`): headroom = ceiling - student with a paired 95%
interval, and go or no-go with its reasons; printed and saved as ``probe.json``.

The greedy answers (the student's and the three ceilings') stop where their graded answer is complete,
when ``eval.grader`` declares where that is (:data:`opsd.grading.ANSWER_ENDS`: ``answer_is``; the
answer cut, :mod:`opsd.eval.cut`; ``--no-cut`` turns it off). A stopped answer grades as the whole one
would unless the whole one would have written a second answer: the grader reads the last "The answer
is", the cut keeps the first. The probe counts how often that changes a grade on the sampled responses,
which are never cut. A stopped answer's length is counted to its cut, and whether it would have ended
before the limit is unknown: the teacher-stops rule takes those as ending (no no-go it cannot prove) and
notes where they decide it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from opsd.compare import ceiling_context, paired_interval, wilson
from opsd.errors import UserError
from opsd.grading import ANSWER_ENDS, AnswerEnd
from opsd.metrics import mean, say
from opsd.probe_report import format_probe, verdict

BATCH = 8  # sequences a probe forward takes at once
# Problems the controls' ceilings answer: they test that the solution decides the teacher's answers,
# which is plain at a few dozen problems (3% against 92% on arith); each says its own interval.
CONTROL_LIMIT = 30


@dataclass
class Answers:
    """One set of greedy or sampled answers to the probe's problems."""

    accuracy: float
    truncated: float  # share cut at the token limit
    resp_len: float
    correct: list[bool] = field(default_factory=list, repr=False)
    cut: float = 0.0  # share stopped by the answer cut once their answer was complete
    problems: int = 0
    interval: tuple[float, float] | None = None  # the accuracy's 95% Wilson interval


@dataclass
class TokenStats:
    """Per-token figures on the student's sampled responses, against the teacher."""

    tokens: int
    divergence: float  # mean unclipped divergence (the configured loss, clip off)
    top1_differs: float  # share of tokens whose teacher top-1 differs from the student's
    overlap_mass: float  # mean teacher mass on the intersection of the two top-16 sets
    clip_removed: float  # share of the summed divergence (its gradient, for scale) the clip takes away
    steps_away: float  # share of tokens whose clipped gradient raises their own divergence
    end_tokens: int  # responses that ended with an end token
    end_teacher: float | None  # mean teacher probability of the end token where the student ended
    end_student: float | None  # the student's own, at the same positions
    end_teacher_correct: float | None  # the teacher's, at the ends of correct responses only
    end_teacher_wrong: float | None  # ... of wrong ones
    solution_ratio: float | None = None  # |P - P_controlB|_1 / |P - S|_1, summed over tokens
    solution_top1_differs: float | None = None  # share of tokens whose top-1 the two teachers disagree on


def _answers(res) -> Answers:
    correct = [bool(c) for it in res.items for c in it["correct"]]
    reasons = [r for it in res.items for r in it["finish_reasons"]]
    cut = sum(r == "answer" for r in reasons) / len(reasons)
    return _with_interval(Answers(res.avg_at_k, res.truncated_frac, res.resp_len_mean, correct, cut))


def _with_interval(a: Answers) -> Answers:
    """``a`` with its problem count and its accuracy's 95% Wilson interval."""
    n = len(a.correct)
    return replace(a, problems=n, interval=wilson(a.accuracy, n))


def _greedy(trainer, examples, prompts, name: str, answer_end: AnswerEnd | None) -> Answers:
    """Greedy answers at ``eval.max_new_tokens`` from ``prompts`` (None: the student prompts), graded;
    with ``answer_end`` each stopped once its answer is complete."""
    from opsd.eval import EvalRun, evaluate_model

    cfg = trainer.cfg
    greedy = cfg.eval.model_copy(update={"k": 1, "temperature": 0.0, "top_p": 1.0})
    run = EvalRun(
        trainer.run.engine,
        trainer.run.eval_grader,
        cfg.seed,
        prompts=prompts,
        answer_end=answer_end,
        name=name,
    )
    res = evaluate_model(trainer.run.model, trainer.run.tokenizer, examples, greedy, cfg.data, run)
    return _answers(res)


def _ceiling(trainer, examples, source: str, answer_end: AnswerEnd | None = None) -> Answers | None:
    """Greedy answers with the teacher prompt holding the solution ``source`` gives (own, other,
    wrong_answer); None where the control refuses every row (no final answer to make wrong, or every
    row with the same solution)."""
    from opsd.data import PromptBuilder
    from opsd.data.controls import apply_solution_source

    shown, _ = apply_solution_source(examples, source)
    if not shown:
        return None
    builder = PromptBuilder(trainer.run.tokenizer, trainer.cfg.data, privileged=True)
    prompts = [builder(i, ex)[1] for i, ex in enumerate(shown)]
    return _greedy(trainer, shown, prompts, source, answer_end)


def _logits(trainer, seqs: list[list[int]], response_lens: list[int], *, teacher: bool) -> list:
    """Per sequence, the ``[r, V]`` float32 logits predicting its last ``r`` tokens: batched forwards of
    :data:`BATCH` right-padded rows (the teacher's through ``Teacher.score``, as training scores)."""
    import torch

    from opsd.data.batching import pad_right, response_positions
    from opsd.parallel import forward_hidden, full_head_weight

    out = []
    for start in range(0, len(seqs), BATCH):
        rows, lens = seqs[start : start + BATCH], response_lens[start : start + BATCH]
        ids, mask = pad_right(rows, trainer.run.pad_id, trainer.run.dist.device, False)
        positions = response_positions([len(r) for r in rows], lens, ids.shape[1]).to(trainer.run.dist.device)
        with torch.no_grad(), trainer.run.autocast():
            if teacher:
                hidden, weight = trainer.run.teacher.score(ids, mask, positions)
            else:
                hidden = forward_hidden(trainer.run.model, ids, mask, positions)
                weight = full_head_weight(trainer.run.model)
        out += list((hidden.float() @ weight.float().t()).split(lens))
    return out


def _token_stats(trainer, examples, completions, correct: list[bool], spec) -> TokenStats:
    """:class:`TokenStats` over every sampled response: a student forward and two teacher forwards
    each (with the problem's solution, and with another problem's where two solutions differ), the
    loss's dense oracle on one response's ``[R, V]`` block at a time."""
    import torch

    from opsd.data import PromptBuilder
    from opsd.data.controls import apply_solution_source
    from opsd.loss import per_token_loss_dense, topk_overlap_mass
    from opsd.rollout.base import end_token_ids

    raw_spec = replace(spec, clip_mode="none", clip=0.0)
    builder = PromptBuilder(trainer.run.tokenizer, trainer.cfg.data, privileged=True)
    ends = set(end_token_ids(trainer.run.tokenizer, trainer.run.model, []))
    others = apply_solution_source(examples, "other")[0] or None
    sums = dict(tokens=0, divergence=0.0, differs=0.0, overlap=0.0, removed=0.0, away=0)
    signal = dict(apart=0.0, pull=0.0, split=0)
    end_t: list[float] = []
    end_s: list[float] = []
    end_by: dict[bool, list[float]] = {True: [], False: []}
    scored = _scored(trainer, builder, examples, completions, correct, others)
    for c, ok, zs, zt, zo in scored:
        r = len(c.token_ids)
        with torch.no_grad():
            targets = torch.tensor(c.token_ids, device=zs.device)  # loss.mode=sampled reads them
            raw = per_token_loss_dense(zs, zt, targets, spec=raw_spec)
        if zo is not None:
            for key, v in zip(signal, solution_signal(zs, zt, zo, spec.temperature)):
                signal[key] += v
        sums["tokens"] += r
        sums["divergence"] += raw.sum().item()
        sums["differs"] += (zs.argmax(-1) != zt.argmax(-1)).sum().item()
        a, b = zs / spec.temperature, zt / spec.temperature
        sums["overlap"] += topk_overlap_mass(a, b.log_softmax(-1)).sum().item()
        removed, away = _clip_effect(zs, zt, raw, spec, raw_spec, targets)
        sums["removed"] += removed
        sums["away"] += away
        if c.finish_reason == "stop" and c.token_ids[-1] in ends:
            end = c.token_ids[-1]
            pt = b[-1].softmax(-1)[end].item()
            end_t.append(pt)
            end_s.append(a[-1].softmax(-1)[end].item())
            end_by[ok].append(pt)
        del zs, zt, zo, raw, a, b, targets  # views of the batch's logits: freed before the next batch's
    n = max(sums["tokens"], 1)
    return TokenStats(
        tokens=sums["tokens"],
        divergence=sums["divergence"] / n,
        top1_differs=sums["differs"] / n,
        overlap_mass=sums["overlap"] / n,
        clip_removed=sums["removed"] / max(sums["divergence"], 1e-30),
        steps_away=sums["away"] / n,
        end_tokens=len(end_t),
        end_teacher=mean(end_t),
        end_student=mean(end_s),
        end_teacher_correct=mean(end_by[True]),
        end_teacher_wrong=mean(end_by[False]),
        solution_ratio=signal["apart"] / max(signal["pull"], 1e-30) if others else None,
        solution_top1_differs=signal["split"] / n if others else None,
    )


def solution_signal(zs, zt, zo, temperature: float) -> tuple[float, float, int]:
    """On one response's tokens, the student's logits ``zs``, the teacher's with the problem's solution
    ``zt`` and with another problem's ``zo``: the summed L1 distance between the two teachers'
    distributions at ``temperature``, the teacher's from the student's, and the number of tokens whose
    top-1 the two teachers disagree on (in the logits' dtype, float32 in the probe)."""
    import torch

    with torch.no_grad():
        s, p, q = (z.div(temperature).softmax(-1) for z in (zs, zt, zo))
        apart = (p - q).abs().sum().item()
        pull = (p - s).abs().sum().item()
    return apart, pull, int((zt.argmax(-1) != zo.argmax(-1)).sum().item())


def _clip_effect(zs, zt, raw, spec, raw_spec, targets=None) -> tuple[float, int]:
    """What the configured clip takes away from one response's tokens (of the summed divergence for
    ``entry`` and ``token``; of each token's gradient weight, ``D (1 - min(1, clip / D))``, for ``scale``)
    and how many of its tokens the clipped gradient steps away from their teacher (the first-order
    change of their own divergence, ``-<g_clip, g_raw>``, above 0; by the descent property only
    ``entry`` can, so the gradients are taken for it alone)."""
    import torch

    from opsd.loss import per_token_loss_dense
    from opsd.loss.reference import token_scale

    if spec.clip_mode == "none":
        return 0.0, 0
    if spec.clip_mode == "scale":
        return (raw * (1 - token_scale(raw, spec.clip))).sum().item(), 0
    if spec.clip_mode == "token":
        return (raw - raw.clamp(max=spec.clip)).sum().item(), 0
    z = zs.clone().requires_grad_()
    (g_raw,) = torch.autograd.grad(per_token_loss_dense(z, zt, targets, spec=raw_spec).sum(), z)
    clipped = per_token_loss_dense(z, zt, targets, spec=spec)
    (g_clip,) = torch.autograd.grad(clipped.sum(), z)
    removed = (raw - clipped.detach()).clamp_min(0).sum().item()
    return removed, int(((g_clip * g_raw).sum(-1) < 0).sum().item())


def _scored(trainer, builder, examples, completions, correct, others=None):
    """``(completion, correct, student logits, teacher logits, logits of the teacher reading the
    solution in ``others`` or None)`` a batch at a time: only one batch's ``[r, V]`` blocks are held
    (all of them would be gigabytes). ``others`` gets a builder of its own: a builder caches by index."""
    from opsd.data import PromptBuilder

    other_builder = PromptBuilder(trainer.run.tokenizer, trainer.cfg.data, privileged=True)
    for start in range(0, len(completions), BATCH):
        batch = completions[start : start + BATCH]
        pairs = [builder(c.prompt_index, examples[c.prompt_index]) for c in batch]
        lens = [len(c.token_ids) for c in batch]
        student = _logits(trainer, [s + c.token_ids for (s, _), c in zip(pairs, batch)], lens, teacher=False)
        teacher = _logits(trainer, [t + c.token_ids for (_, t), c in zip(pairs, batch)], lens, teacher=True)
        other = [None] * len(batch)
        if others is not None:
            rows = [other_builder(c.prompt_index, others[c.prompt_index])[1] + c.token_ids for c in batch]
            other = _logits(trainer, rows, lens, teacher=True)
        yield from zip(batch, correct[start : start + BATCH], student, teacher, other)
        del student, teacher, other  # before the next batch's forwards


def _reference_end(trainer, examples) -> dict:
    """The teacher's and the student's probability of the end token right after the reference solution,
    spliced as the response (the teacher's reads its own solution: does it know to stop there?)."""
    from opsd.data import PromptBuilder
    from opsd.rollout.base import end_token_ids

    end = end_token_ids(trainer.run.tokenizer, trainer.run.model, [])[0]
    builder = PromptBuilder(trainer.run.tokenizer, trainer.cfg.data, privileged=True)
    pairs = [builder(i, ex) for i, ex in enumerate(examples)]
    tok = trainer.run.tokenizer
    responses = [tok(ex.solution, add_special_tokens=False)["input_ids"] + [end] for ex in examples]
    ones = [1] * len(examples)
    teacher = _logits(trainer, [t + r for (_, t), r in zip(pairs, responses)], ones, teacher=True)
    student = _logits(trainer, [s + r for (s, _), r in zip(pairs, responses)], ones, teacher=False)
    return {
        "teacher": mean([z[0].softmax(-1)[end].item() for z in teacher]),
        "student": mean([z[0].softmax(-1)[end].item() for z in student]),
    }


def _probe_config(config: Path | None, overrides: list[str], out: Path, limit: int, progress: bool):
    """The run's config with the probe's own settings: the ceiling's context, a scratch run directory,
    the first ``limit`` held-out rows (with their solutions), no evaluation or checkpoint of its own."""
    from opsd.config import load_config

    cfg = load_config(config, overrides)
    if not cfg.eval.path:
        raise UserError("opsd probe needs eval.path: held-out problems with answers and solutions")
    if not cfg.data.solution_key:
        raise UserError("opsd probe needs data.solution_key: the teacher's privileged information")
    probe_overrides = [
        *overrides,
        *ceiling_context(cfg),
        f"logging.run_dir={out / 'run'}",
        f"eval.limit={limit}",
        "eval.divergence=true",  # the held-out rows are loaded with their solutions
        "eval.every=0",
        "eval.sets={}",  # the probe reads eval.path only: no drift reference to compute
        "checkpoint.enabled=false",
        f"logging.progress={str(progress).lower()}",
        "teacher.solution_source=own",
    ]
    return load_config(config, probe_overrides)


def _sampled(trainer, examples) -> tuple[list, Answers]:
    """One response a problem sampled as rollouts are (``rollout.*``), graded; the engine then sleeps."""
    from opsd.rollout import SamplingParams

    cfg = trainer.cfg
    prompts = [trainer.run.eval_prompts(i, ex)[0] for i, ex in enumerate(examples)]
    params = SamplingParams.from_rollout(cfg.rollout, seed=cfg.seed)
    completions = trainer.run.engine.generate(prompts, 1, params)
    texts = [trainer.run.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    grades = [trainer.run.eval_grader(t, examples[c.prompt_index].answer) for t, c in zip(texts, completions)]
    correct = [g.correct for g in grades]
    sampled = Answers(
        sum(correct) / len(correct),
        sum(c.finish_reason == "length" for c in completions) / len(completions),
        sum(len(c.token_ids) for c in completions) / len(completions),
        correct,
    )
    trainer.run.engine.sleep()
    return completions, _with_interval(sampled)


def _cut_report(trainer, examples, completions, answer_end: AnswerEnd | None) -> dict | None:
    """The answer cut's rule and, on the sampled responses (never cut), how many it would have stopped
    and how many of those it would have graded otherwise; None without a cut."""
    if answer_end is None:
        return None
    texts = [trainer.run.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    golds = [examples[c.prompt_index].answer for c in completions]
    stopped, changed = cut_changes(texts, golds, trainer.run.eval_grader, answer_end)
    return {
        "rule": answer_end.rule,
        "sampled": {"responses": len(texts), "stopped": stopped, "changed": changed},
    }


def cut_changes(texts: list[str], golds: list[str], grader, end: AnswerEnd) -> tuple[int, int]:
    """Of whole responses, how many the answer cut would stop (their first complete answer comes
    before their end) and how many of those it would grade otherwise (a later answer, which the grader
    reads, differs from the first): the cut's cost in grades, measured where nothing was cut."""
    stopped = changed = 0
    for text, gold in zip(texts, golds, strict=True):
        at = end.settled(text)
        if at is None or not text[at:].strip():
            continue
        stopped += 1
        changed += grader(text[:at], gold).correct != grader(text, gold).correct
    return stopped, changed


def run_probe(
    config: Path | None,
    overrides: list[str],
    out: Path,
    limit: int,
    progress: bool = True,
    control_limit: int = CONTROL_LIMIT,
    cut: bool = True,
) -> dict:
    """Every measurement of the module docstring on the first ``limit`` held-out problems (the controls'
    ceilings on the first ``control_limit`` of them; ``cut``: the answer cut where the grader has one);
    writes ``out/probe.json`` (the trainer's scratch run directory is ``out/run``)."""
    from opsd.data.controls import shared_text_note
    from opsd.trainer import Trainer

    t0 = time.time()
    cfg = _probe_config(config, overrides, out, limit, progress)
    _check_slice(cfg)  # before anything loads
    phases: dict[str, float] = {}
    clock = _Clock(phases)
    trainer = Trainer(cfg, overwrite=True)
    clock.mark("setup")
    try:
        examples = trainer.run.data.eval_examples
        controls = examples[:control_limit]
        e, r = cfg.eval, cfg.rollout
        answer_end = ANSWER_ENDS.get(e.grader) if cut else None
        say(
            progress,
            f"probe: {len(examples)} problems of {e.path}, the controls' ceilings on {len(controls)}",
        )
        say(True, shared_text_note(examples, e.path))
        say(True, _cut_note(e.grader, answer_end, cut))
        student = _greedy(trainer, examples, None, "student", answer_end)
        clock.mark("student")
        ceilings = {"own": _ceiling(trainer, examples, "own", answer_end)}
        ceilings |= {s: _ceiling(trainer, controls, s, answer_end) for s in ("other", "wrong_answer")}
        clock.mark("ceilings")
        completions, sampled = _sampled(trainer, examples)
        clock.mark("sampled")
        cut_report = _cut_report(trainer, examples, completions, answer_end)
        say(progress, "probe: scoring the sampled responses with the teacher")
        tokens = _token_stats(trainer, examples, completions, sampled.correct, trainer.run.spec)
        clock.mark("token_stats")
        reference_end = _reference_end(trainer, examples)
        clock.mark("reference_end")
    finally:
        trainer.close()
    own = ceilings["own"]
    result = {
        "config": str(config) if config else None,
        "overrides": overrides,
        "problems": len(examples),
        "settings": {
            "eval_path": e.path,
            "grader": e.grader,
            "eval_max_new_tokens": e.max_new_tokens,
            "rollout_temperature": r.temperature,
            "rollout_max_new_tokens": r.max_new_tokens,
            "loss": trainer.run.spec.describe(),
            "control_problems": len(controls),
        },
        "cut": cut_report,
        "student": asdict(student),
        "sampled": asdict(sampled),
        "ceiling": asdict(own),
        "ceiling_on_controls": mean([float(c) for c in own.correct[: len(controls)]]),
        "ceiling_other": asdict(ceilings["other"]) if ceilings["other"] else None,
        "ceiling_wrong_answer": asdict(ceilings["wrong_answer"]) if ceilings["wrong_answer"] else None,
        "headroom": paired_interval(own.correct, student.correct),
        "reference_end": reference_end,
        "tokens": asdict(tokens),
    }
    result["verdict"], result["reasons"] = verdict(result)
    result["seconds"] = round(time.time() - t0, 1)
    result["phase_seconds"] = {k: round(v, 1) for k, v in phases.items()}
    for key in ("student", "sampled", "ceiling", "ceiling_other", "ceiling_wrong_answer"):
        if result[key] is not None:
            result[key].pop("correct")
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(result, indent=2))
    print(format_probe(result))
    return result


def _cut_note(grader: str, answer_end: AnswerEnd | None, asked: bool) -> str:
    """The stderr line saying whether the greedy answers are cut, and what that keeps."""
    if answer_end is not None:
        return f"probe: answer cut on the greedy answers: {answer_end.rule}"
    if not asked:
        return "probe: no answer cut (--no-cut): the greedy answers run to their end"
    return (
        f"probe: no answer cut: eval.grader={grader} declares no answer end; the greedy answers run to "
        "their end"
    )


class _Clock:
    """Seconds per phase of the probe, written to ``phase_seconds`` (where its wall time goes)."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = phases
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.last
        self.last = now


def _check_slice(cfg) -> None:
    """The probe's held-out rows, read once before the model loads: each needs an answer and a
    solution; the slice must hold at least one."""
    from opsd.setup import load_heldout

    e, d = cfg.eval, cfg.data
    examples = load_heldout(cfg, solutions=True)
    if not examples:
        raise UserError(f"eval.path={e.path}: the probe's slice holds no problems")
    empty = [ex.row for ex in examples if not ex.solution.strip()]
    if empty:
        raise UserError(
            f"{e.path}: rows {empty[:5]} have no {d.solution_key!r}: the teacher would read nothing (the "
            "probe needs every held-out row's solution)"
        )


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Before training: the student's accuracy, the teacher's ceiling (with the solution, another "
        "problem's, a wrong answer), whether the teacher stops, and the divergence on the student's own "
        "samples, on a slice of eval.path; a go / no-go verdict, saved as OUT/probe.json."
    )
    p.add_argument("--config", type=Path, required=True, help="the run's YAML config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as for opsd train")
    p.add_argument(
        "--limit", type=int, default=100, help="held-out problems probed (the first N of eval.path)"
    )
    p.add_argument(
        "--control-limit",
        type=int,
        default=CONTROL_LIMIT,
        help="problems the controls' ceilings (another problem's solution, a wrong answer) answer: the "
        "first N of the probed ones, each with its 95%% interval",
    )
    p.add_argument(
        "--no-cut",
        action="store_true",
        help="generate every greedy answer to its end, not only to where its graded answer is complete",
    )
    p.add_argument("--out", type=Path, default=Path("runs/probe"), help="where probe.json goes")


def run_probe_command(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise UserError(f"--limit {args.limit}: the probe needs at least 1 problem")
    if args.control_limit < 1:
        raise UserError(f"--control-limit {args.control_limit}: the controls need at least 1 problem")
    control_limit = min(args.control_limit, args.limit)
    run_probe(
        args.config,
        list(args.overrides),
        args.out,
        args.limit,
        control_limit=control_limit,
        cut=not args.no_cut,
    )
    return 0
