"""Aligned student/teacher sequences and the padded micro-batches the trainer runs them in.

A :class:`Sample` holds the student's and the teacher's prompt with the same response ids appended;
:func:`make_microbatches` groups samples under a padded-token budget and builds, per group, the padded
tensors, the flat response positions, the target ids and the loss weights of each response token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from opsd.cpu import RowWidths  # the CPU plan's width buckets and packed rows


@dataclass
class Sample:
    student_ids: list[int]
    teacher_ids: list[int]
    response_len: int  # response occupies the LAST response_len positions of both
    example_index: int
    finish_reason: str
    rollout_logprobs: list[float] | None = None  # the engine's log-prob of each response token, if reported


def make_sample(
    student_prompt: list[int],
    teacher_prompt: list[int],
    response: list[int],
    example_index: int,
    finish_reason: str,
    logprobs: list[float] | None = None,
) -> Sample:
    """Append the same response ids to both prompts; nothing is decoded and re-encoded."""
    if not response:
        raise ValueError(f"example {example_index}: empty response; there is nothing to distill")
    if not student_prompt or not teacher_prompt:
        raise ValueError(f"example {example_index}: empty student or teacher prompt")
    if finish_reason not in ("stop", "length"):
        raise ValueError(
            f"example {example_index}: finish_reason must be 'stop' or 'length', got {finish_reason!r}"
        )
    response = [int(t) for t in response]
    sample = Sample(
        student_ids=[int(t) for t in student_prompt] + response,
        teacher_ids=[int(t) for t in teacher_prompt] + response,
        response_len=len(response),
        example_index=example_index,
        finish_reason=finish_reason,
        rollout_logprobs=[float(x) for x in logprobs] if logprobs is not None else None,
    )
    if logprobs is not None and len(logprobs) != len(response):
        raise ValueError(
            f"example {example_index}: {len(logprobs)} log-probs for {len(response)} response tokens"
        )
    check_alignment(sample)
    return sample


def loss_tokens(sample: Sample, skip_end: bool) -> int:
    """The response tokens the loss reads: every one, less the closing end token of a response that
    stopped when ``skip_end`` (``loss.end_token=skip``: where the student chose to stop, the teacher's
    view of stopping is not distilled)."""
    return sample.response_len - int(skip_end and sample.finish_reason == "stop")


def check_alignment(sample: Sample) -> None:
    """The loss compares position t of student and teacher: both must hold the same response token."""
    n = sample.response_len
    if n <= 0 or n > min(len(sample.student_ids), len(sample.teacher_ids)):
        raise ValueError(
            f"example {sample.example_index}: response_len {n} does not fit sequences of length "
            f"{len(sample.student_ids)} (student) and {len(sample.teacher_ids)} (teacher)"
        )
    s, t = sample.student_ids[-n:], sample.teacher_ids[-n:]
    if s != t:
        pos = next(i for i, (a, b) in enumerate(zip(s, t, strict=True)) if a != b)
        raise ValueError(
            f"example {sample.example_index}: student and teacher responses differ at response "
            f"position {pos} (student token {s[pos]}, teacher token {t[pos]})"
        )


def pack_microbatches(lengths: list[int], max_tokens: int, min_real_frac: float = 0.0) -> list[list[int]]:
    """Group sample indices so each micro-batch fits max_tokens once padded, with little padding.

    lengths[i] must be max(len(student_i), len(teacher_i)): the teacher is longer by the whole solution.
    Each sample is its own padded row, so attention never crosses samples; a group therefore costs
    len(group) * max(lengths in group) tokens, and that padded size is what the budget bounds.
    Samples are sorted longest first (ties by index) and chunked greedily, which is first-fit-decreasing
    for this cost. A group also closes before the next sample would bring its real tokens below
    ``min_real_frac`` of its padded ones: rows of similar length go together, so the forwards compute
    little padding (teacher prompts with solutions vary several-fold in length), at the price of more,
    smaller micro-batches. A sample longer than max_tokens goes alone. Groups come longest first (an OOM
    shows up on the first micro-batch) with indices ascending inside each group; the result is deterministic.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if not 0.0 <= min_real_frac <= 1.0:
        raise ValueError(f"min_real_frac must be in [0, 1], got {min_real_frac}")
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sample {i} has length {n}; lengths must be > 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        padded = (len(current) + 1) * longest
        if current and (padded > max_tokens or real + lengths[i] < min_real_frac * padded):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        groups.append(current)
    return [sorted(g) for g in groups]


def response_positions(lengths: list[int], response_lens: list[int], width: int) -> Tensor:
    """Flat indices into ``[B * width]`` of the hidden states that predict each response token.

    Sequences are right-padded; the response is the last ``r`` tokens of a length-``L`` row, and
    the hidden state at position ``p`` predicts token ``p + 1``, so rows use ``L-r-1 .. L-2``.
    """
    idx = [
        b * width + p for b, (n, r) in enumerate(zip(lengths, response_lens)) for p in range(n - r - 1, n - 1)
    ]
    return torch.tensor(idx, dtype=torch.long)


def pad_right(
    seqs: list[list[int]], pad_id: int, device: torch.device, bucket: bool = False
) -> tuple[Tensor, Tensor]:
    """Right padding, one sample per row: attention never crosses samples. The width is the longest
    row's length, or with ``bucket`` its bucket width (:meth:`opsd.cpu.RowWidths.width`)."""
    width = RowWidths(bucket=bucket).width(max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


@dataclass
class MicroBatch:
    """One forward/backward's worth of samples, every tensor on the training device.

    ``*_pos`` index the flattened ``[B * width]`` hidden states; row ``i``'s response tokens come
    first-to-last, rows in order, matching ``targets`` and ``weights`` (``R`` = sum of response_lens).
    ``*_padded_tokens`` is every position computed: rows x width, or with ``*_rows`` their sum; real /
    padded is the fraction of the forward's work spent on real tokens. ``*_rows`` (a CPU, one process:
    :func:`make_microbatches`' ``widths.pack_from``) is each row's width in the packed forward
    (:func:`opsd.cpu.packed_hidden`): its length, or its bucket width; ``None``: one forward over the
    padded rows.
    """

    student_ids: Tensor  # [B, Ls] long, right-padded
    student_mask: Tensor  # [B, Ls] long
    student_pos: Tensor  # [R] long
    teacher_ids: Tensor  # [B, Lt] long, right-padded
    teacher_mask: Tensor  # [B, Lt] long
    teacher_pos: Tensor  # [R] long
    targets: Tensor  # [R] long: the response token ids
    weights: Tensor  # [R] float32: each token's weight in the global loss
    rollout_logprobs: Tensor | None  # [R] float32: the rollout engine's log-probs (None: not all reported)
    response_lens: list[int]
    sample_indices: list[int]  # which samples (indices into make_microbatches' input)
    student_real_tokens: int
    student_padded_tokens: int
    teacher_real_tokens: int
    teacher_padded_tokens: int
    student_rows: list[int] | None = None
    teacher_rows: list[int] | None = None


@dataclass(frozen=True)
class TokenWeights:
    """What each response token weighs in the loss summed over every rank's micro-batches: ``token``
    reduction gives each ``1 / global_tokens``, ``sequence`` a length-n response's ``1 / (n *
    global_seqs)`` (each sequence's mean, averaged over sequences). With ``skip_end`` a stopped
    response's end token weighs 0 and is not counted (:func:`loss_tokens`; the global counts do the
    same)."""

    reduction: str
    global_tokens: float
    global_seqs: float
    skip_end: bool = False

    def __post_init__(self) -> None:
        if self.reduction not in ("token", "sequence"):
            raise ValueError(f"reduction must be 'token' or 'sequence', got {self.reduction!r}")

    def of(self, sample: Sample) -> Tensor:
        """``[response_len]`` float32 weights: the ``n`` tokens the loss reads share the reduction's
        weight, a skipped end token 0."""
        n = loss_tokens(sample, self.skip_end)
        w = torch.zeros(sample.response_len, dtype=torch.float32)
        if n:
            w[:n] = 1.0 / (self.global_tokens if self.reduction == "token" else n * self.global_seqs)
        return w


def make_microbatches(
    samples: list[Sample],
    *,
    max_tokens: int,
    pad_id: int,
    weights: TokenWeights,
    device: torch.device | str,
    min_real_frac: float = 0.0,
    widths: RowWidths = RowWidths(),
) -> list[MicroBatch]:
    """Pack samples under ``max_tokens`` padded tokens and build each group's tensors.

    Groups come from :func:`pack_microbatches` on max(student, teacher) length (``min_real_frac``: the
    least real-token fraction of a group with more than one sample), in its order. ``widths`` (the CPU
    plan's :meth:`~opsd.cpu.CpuPlan.row_widths`): with buckets the lengths are rounded up to their
    bucket widths first, as the padded widths are, so the budget bounds what is computed; with
    ``pack_from``, where a side's rows differ in width and the shortest has at least that many tokens,
    the rows' widths are recorded so that they run packed into one forward, unpadded (or each padded
    to its own bucket width): the padding and the attention mask a batch of unequal rows costs are
    gone (docs/cpu.md, "Packed rows"). ``weights`` make the sum over all ranks' micro-batches the
    global loss.
    """
    lengths = [widths.width(max(len(s.student_ids), len(s.teacher_ids))) for s in samples]
    groups = pack_microbatches(lengths, max_tokens, min_real_frac)
    dev = torch.device(device)
    return [_microbatch([samples[i] for i in group], group, pad_id, weights, dev, widths) for group in groups]


def _microbatch(
    mb: list[Sample],
    group: list[int],
    pad_id: int,
    weights: TokenWeights,
    device: torch.device,
    widths: RowWidths,
) -> MicroBatch:
    """One group's tensors; ``group``: the samples' indices into :func:`make_microbatches`' input."""
    resp = [s.response_len for s in mb]
    targets = torch.tensor(
        [t for s in mb for t in s.student_ids[-s.response_len :]], dtype=torch.long, device=device
    )
    s_ids, s_mask = pad_right([s.student_ids for s in mb], pad_id, device, widths.bucket)
    t_ids, t_mask = pad_right([s.teacher_ids for s in mb], pad_id, device, widths.bucket)
    s_pos = response_positions([len(s.student_ids) for s in mb], resp, s_ids.shape[1]).to(device)
    t_pos = response_positions([len(s.teacher_ids) for s in mb], resp, t_ids.shape[1]).to(device)
    s_rows = widths.packed([len(s.student_ids) for s in mb])
    t_rows = widths.packed([len(s.teacher_ids) for s in mb])
    return MicroBatch(
        student_ids=s_ids,
        student_mask=s_mask,
        student_pos=s_pos,
        teacher_ids=t_ids,
        teacher_mask=t_mask,
        teacher_pos=t_pos,
        targets=targets,
        weights=torch.cat([weights.of(s) for s in mb]).to(device),
        rollout_logprobs=None
        if any(s.rollout_logprobs is None for s in mb)
        else torch.tensor([x for s in mb for x in s.rollout_logprobs], dtype=torch.float32, device=device),
        response_lens=resp,
        sample_indices=list(group),
        student_real_tokens=sum(len(s.student_ids) for s in mb),
        student_padded_tokens=sum(s_rows) if s_rows else s_ids.numel(),
        teacher_real_tokens=sum(len(s.teacher_ids) for s in mb),
        teacher_padded_tokens=sum(t_rows) if t_rows else t_ids.numel(),
        student_rows=s_rows,
        teacher_rows=t_rows,
    )


def zero_weight_microbatch(pad_id: int, device: torch.device | str) -> MicroBatch:
    """A two-token micro-batch whose one response token weighs 0: runs the collectives, adds nothing."""
    dev = torch.device(device)
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    return MicroBatch(
        student_ids=ids,
        student_mask=mask,
        student_pos=pos,
        teacher_ids=ids,
        teacher_mask=mask,
        teacher_pos=pos,
        targets=torch.full((1,), pad_id, dtype=torch.long, device=dev),
        weights=torch.zeros(1, dtype=torch.float32, device=dev),
        rollout_logprobs=None,
        response_lens=[1],
        sample_indices=[],
        student_real_tokens=0,
        student_padded_tokens=2,
        teacher_real_tokens=0,
        teacher_padded_tokens=2,
    )


def pad_microbatches(mbs: list[MicroBatch], pad_id: int, device: torch.device | str) -> list[MicroBatch]:
    """This rank's micro-batches plus zero-weight ones, up to the largest count on any rank (FSDP's
    collectives must match)."""
    from opsd.distributed import agree_count

    n = agree_count(len(mbs))
    return mbs + [zero_weight_microbatch(pad_id, device) for _ in range(n - len(mbs))]
