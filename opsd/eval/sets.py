"""The held-out sets beside ``eval.path`` (``eval.sets``): each one's accuracy under its own grader,
and what training forgets: the drift from the initial model on a set's prompts and, where a set's
answers are also training answers, interference apart from forgetting.

Drift is the mean per-token KL(initial || model) on the initial model's own greedy answers to a set's
prompts. The initial model's answers and its log-probabilities at them are computed once, at the
start of a run before any step or resume (:func:`drift_reference`), and kept in the run directory, so
no second copy of the weights is held. Per position the initial model's ``eval.drift_topk`` most
likely tokens are kept with the rest as one bucket; the KL between the two bucketed distributions
(:func:`bucketed_kl`) is a lower bound of the full KL (coarse-graining never raises a divergence) and
equals it when the bucket is empty (``drift_topk`` at the vocabulary size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from opsd.data import Example, RowKeys, load_examples, make_sample
from opsd.grading import as_grade, resolve_grader

LOGIT_ROWS = 128  # logit rows at a time: never a [tokens, vocab] block


@dataclass
class HeldoutSet:
    """One ``eval.sets`` entry, loaded: its rows, its grader, which rows' answers are training answers
    (``seen``, with ``seen_answers``) and its drift reference (with ``drift``, once computed)."""

    name: str
    examples: list[Example]
    grader: Callable[[str, str | None], Any]
    seen: list[bool] | None = None
    drift: bool = False
    reference: dict | None = None


@dataclass
class SetResult:
    """One set's evaluation: its accuracy result, and where asked its drift and its accuracy on rows
    whose answer is a training answer (``seen``) and on the rest (``other``)."""

    accuracy: Any  # an EvalResult
    drift: float | None = None
    seen: float | None = None
    other: float | None = None
    artifacts: float | None = None
    extra: dict = field(default_factory=dict)

    def metrics(self, prefix: str) -> dict[str, float]:
        out = self.accuracy.metrics(prefix=prefix)
        for key in ("drift", "seen", "other", "artifacts"):
            value = getattr(self, key)
            if value is not None:
                out[f"{prefix}{key}"] = value
        return out


def load_sets(cfg, train_answers: list[str | None]) -> list[HeldoutSet]:
    """``eval.sets`` as :class:`HeldoutSet` s, every row with its answer (a row without one is refused
    with its file, row and key); ``train_answers``: the training rows' answers, for ``seen_answers``."""
    seen_golds = {_norm(a) for a in train_answers if a}
    sets = []
    for name, s in cfg.eval.sets.items():
        loaded = load_examples(
            s.path,
            RowKeys(problem=cfg.data.problem_key, solution=None, answer=cfg.eval.answer_key),
            split=cfg.eval.split,
            require_answer=True,
        )
        examples = loaded.examples[: s.limit]
        grader = resolve_grader(s.grader or cfg.eval.grader, f"eval.sets.{name}.grader")
        seen = [_norm(ex.answer) in seen_golds for ex in examples] if s.seen_answers else None
        sets.append(
            HeldoutSet(name, examples, lambda r, g, grader=grader: as_grade(grader(r, g)), seen, s.drift)
        )
    return sets


def _norm(answer: str | None) -> str:
    return " ".join((answer or "").split()).lower()


def split_accuracy(items: list[dict], seen: list[bool]) -> tuple[float | None, float | None]:
    """The share of correct responses on rows whose answer is a training answer, and on the rest
    (None where a part is empty); ``items`` carry their row's index in the set."""
    parts: dict[bool, list[float]] = {True: [], False: []}
    for it in items:
        parts[seen[it["index"]]].extend(float(c) for c in it["correct"])
    return tuple(sum(v) / len(v) if v else None for v in (parts[True], parts[False]))


def artifact_share(items: list[dict], phrases: list[str]) -> float | None:
    """The share of responses holding any of ``phrases`` (ignoring case); None without phrases."""
    if not phrases:
        return None
    wanted = [p.lower() for p in phrases]
    hits = [any(p in r.lower() for p in wanted) for it in items for r in it["responses"]]
    return sum(hits) / len(hits) if hits else None


def bucketed_logprobs(logits: Tensor, index: Tensor | None, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits`` [r, V]: the log-probabilities at ``index`` [r, K] (default: the row's ``k``
    most likely tokens) and of the rest as one bucket [r] (-inf where the rest is empty), in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if index is None:
        index = logp.topk(min(k, logp.shape[-1]), dim=-1).indices
    top = logp.gather(-1, index)
    rest = torch.logsumexp(logp.scatter(-1, index, float("-inf")), dim=-1)
    return index, top, rest


def bucketed_kl(ref_top: Tensor, ref_rest: Tensor, top: Tensor, rest: Tensor) -> Tensor:
    """KL(reference || model) per row between the bucketed distributions: the kept tokens, and the rest
    as one outcome (its term 0 where the reference puts no mass there)."""
    p = ref_top.exp()
    kept = (p * (ref_top - top)).sum(-1)
    p_rest = ref_rest.exp()
    tail = torch.where(p_rest > 0, p_rest * (ref_rest - rest), torch.zeros_like(p_rest))
    return kept + tail


def answer_logits(
    model_hidden: Callable, samples: list, microbatches: Callable, reduce: Callable | None = None
) -> list:
    """Each sample's response-position logits [r, V] in float32, a micro-batch and ``LOGIT_ROWS`` rows
    at a time, passed through ``reduce(i, logits)`` as soon as they are made (so a set's logits are
    never held together; default: kept as they are); ``model_hidden(mb)`` gives a micro-batch's
    hidden states [R, H] and the head weight."""
    out: list = [None] * len(samples)
    for mb in microbatches(samples):
        hidden, head = model_hidden(mb)
        start = 0
        for i, n in zip(mb.sample_indices, mb.response_lens):
            rows = hidden[start : start + n]
            logits = torch.cat(
                [rows[j : j + LOGIT_ROWS].float() @ head.float().T for j in range(0, n, LOGIT_ROWS)]
            )
            out[i] = logits if reduce is None else reduce(i, logits)
            start += n
    return out


def drift_reference(samples: list, logits_of: Callable, k: int, path: Path | None, write: bool) -> dict:
    """The initial model's bucketed log-probs at its own greedy answers (``samples``: prompt + answer),
    kept at ``path`` (written where ``write``)."""
    bucketed = logits_of(samples, lambda i, logits: bucketed_logprobs(logits, None, k))
    index, top, rest = (list(x) for x in zip(*bucketed)) if bucketed else ([], [], [])
    ref = {
        "prompts": [list(s.student_ids[: -s.response_len]) for s in samples],
        "responses": [list(s.student_ids[-s.response_len :]) for s in samples],
        "index": index,
        "top": top,
        "rest": rest,
    }
    if write and path is not None:
        tmp = path.with_suffix(".tmp")
        torch.save(ref, tmp)
        tmp.replace(path)
    return ref


def drift(ref: dict, logits_of: Callable) -> float:
    """The mean per-token bucketed KL(initial || model) over the reference answers' tokens."""
    samples = reference_samples(ref)

    def kl(j: int, logits: Tensor) -> Tensor:
        _, top, rest = bucketed_logprobs(logits, ref["index"][j], 0)
        return bucketed_kl(ref["top"][j], ref["rest"][j], top, rest)

    kls = logits_of(samples, kl)
    tokens = sum(x.numel() for x in kls)
    return sum(float(x.double().sum()) for x in kls) / max(tokens, 1)


def reference_samples(ref: dict) -> list:
    """The reference's (prompt, answer) pairs as samples, the student prompt on both sides."""
    return [make_sample(p, p, r, i, "stop") for i, (p, r) in enumerate(zip(ref["prompts"], ref["responses"]))]


def logits_of(model, autocast: Callable, microbatches: Callable) -> Callable[[list], list[Tensor]]:
    """A function from samples to their response-position logits under ``model`` as it is now: eval
    mode (no dropout), no gradient, the run's autocast and micro-batches (end tokens counted)."""
    from opsd.parallel import forward_hidden, full_head_weight

    def hidden(mb) -> tuple[Tensor, Tensor]:
        with autocast():
            h = forward_hidden(model, mb.student_ids, mb.student_mask, mb.student_pos, mb.student_rows)
        return h, full_head_weight(model)

    @torch.no_grad()
    def run(samples: list, reduce: Callable | None = None) -> list:
        training = model.training
        model.eval()
        try:
            return answer_logits(hidden, samples, lambda s: microbatches(s, skip_end=False), reduce)
        finally:
            model.train(training)

    return run


def build_reference(
    s: HeldoutSet, generate: Callable, prompts: list[list[int]], logits: Callable, cfg, rank: int
):
    """``s``'s drift reference: the initial model's greedy answers to ``prompts`` (``generate``) and its
    log-probs at them, read from the run directory where an earlier start of this run computed them."""
    path = Path(cfg.logging.run_dir) / f"drift_reference_{s.name}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    completions = generate(prompts)
    samples = [
        make_sample(
            prompts[c.prompt_index], prompts[c.prompt_index], list(c.token_ids), c.prompt_index, "stop"
        )
        for c in completions
        if c.token_ids
    ]
    return drift_reference(samples, logits, cfg.eval.drift_topk, path, write=rank == 0)


def evaluate_set(s: HeldoutSet, accuracy_of: Callable, logits: Callable, phrases: list[str]) -> SetResult:
    """One set's accuracy (``accuracy_of(examples, grader)``), its drift where it has a reference, its
    accuracy split by answers seen in training, and its artifact share. The split and the artifacts
    count this rank's share of the set (the whole set in one process)."""
    res = accuracy_of(s.examples, s.grader)
    seen, other = split_accuracy(res.items, s.seen) if s.seen is not None else (None, None)
    change = drift(s.reference, logits) if s.reference is not None else None
    return SetResult(res, change, seen, other, artifact_share(res.items, phrases))
