"""opsd.data's packing and micro-batches: packed lengths, buckets, and micro-batches against the trainer's
own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd.data import (
    MicroBatch,
    Sample,
    make_microbatches,
    make_sample,
    pack_microbatches,
)

# ---------------------------------------------------------------------------------------------------
# Micro-batching


def test_pack_examples() -> None:
    assert pack_microbatches([], 10) == []
    assert pack_microbatches([3, 3, 3, 3], 12) == [[0, 1, 2, 3]]
    assert pack_microbatches([3, 30, 3, 4], 12) == [[1], [0, 2, 3]]  # oversized alone, longest first
    assert pack_microbatches([5, 6, 6], 12) == [[1, 2], [0]]  # 3 * 6 = 18 > 12 counts padding
    with pytest.raises(ValueError, match="max_tokens"):
        pack_microbatches([1], 0)
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        pack_microbatches([1, 0], 4)


def test_pack_uses_the_longer_teacher_length() -> None:
    student, teacher = [10, 10, 10, 10], [30, 30, 30, 30]
    lengths = [max(s, t) for s, t in zip(student, teacher, strict=True)]
    groups = pack_microbatches(lengths, 64)
    assert all(len(g) * 30 <= 64 for g in groups) and len(groups) == 2


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), max_size=60), max_tokens=st.integers(1, 1000))
def test_pack_properties(lengths: list[int], max_tokens: int) -> None:
    groups = pack_microbatches(lengths, max_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each sample exactly once
    for g in groups:
        assert g and g == sorted(g)
        cost = len(g) * max(lengths[i] for i in g)
        assert cost <= max_tokens or len(g) == 1  # budget, padded, except a lone oversized sample
        if any(lengths[i] > max_tokens for i in g):
            assert len(g) == 1  # oversized goes alone
    assert pack_microbatches(list(lengths), max_tokens) == groups  # deterministic


def test_pack_keeps_similar_lengths_together() -> None:
    """The issue's rows: teacher prompts with solutions from ~200 to ~1100 tokens. One padded group would
    compute 8 x 1100; with min_real_frac=0.8 each group keeps >= 80% real tokens and far less is padded."""
    lengths = [1100, 900, 700, 500, 300, 250, 200, 200]
    assert pack_microbatches(lengths, 9000) == [list(range(8))]  # fill to the budget: 4150 real of 8800
    groups = pack_microbatches(lengths, 9000, 0.8)
    assert groups == [[0, 1, 2], [3, 4], [5, 6, 7]]
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert padded == 3300 + 1000 + 750 and sum(lengths) / padded > 0.8
    assert pack_microbatches([5, 5, 5], 100, 1.0) == [[0, 1, 2]]  # equal lengths never split
    with pytest.raises(ValueError, match="min_real_frac"):
        pack_microbatches([1], 4, 1.5)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), max_size=60),
    max_tokens=st.integers(1, 1000),
    frac=st.floats(0.0, 1.0),
)
def test_pack_min_real_frac_properties(lengths: list[int], max_tokens: int, frac: float) -> None:
    groups = pack_microbatches(lengths, max_tokens, frac)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real, padded = sum(lengths[i] for i in g), len(g) * max(lengths[i] for i in g)
        assert len(g) == 1 or (padded <= max_tokens and real >= frac * padded - 1e-9)


def _trainer_microbatch(mb: list[Sample], pad: int, reduction: str, global_tokens: float, global_seqs: float):
    """What Trainer.step built per micro-batch before MicroBatch, written out without the helpers."""
    resp = [s.response_len for s in mb]
    weights = torch.cat(
        [torch.full((n,), 1.0 / (global_tokens if reduction == "token" else n * global_seqs)) for n in resp]
    )
    targets = torch.tensor([t for s in mb for t in s.student_ids[-s.response_len :]])
    out = {"weights": weights, "targets": targets}
    for side in ("student", "teacher"):
        seqs = [getattr(s, f"{side}_ids") for s in mb]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        pos = []
        for b, (x, r) in enumerate(zip(seqs, resp, strict=True)):
            ids[b, : len(x)] = torch.tensor(x)
            mask[b, : len(x)] = 1
            pos += [b * width + p for p in range(len(x) - r - 1, len(x) - 1)]
        out |= {f"{side}_ids": ids, f"{side}_mask": mask, f"{side}_pos": torch.tensor(pos, dtype=torch.long)}
    return out


def _random_samples(seed: int, count: int, prompt_lens: tuple[int, int]) -> list:
    """Samples of random tokens: prompts of ``prompt_lens`` tokens, solutions of 0-29, responses of 1-11."""
    import random

    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randrange(*prompt_lens))]
        teacher = prompt + [rng.randrange(5, 50) for _ in range(rng.randrange(0, 30))]
        response = [rng.randrange(5, 50) for _ in range(rng.randrange(1, 12))]
        samples.append(make_sample(prompt, teacher, response, i, "stop"))
    return samples


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_microbatches_match_the_trainer(reduction: str) -> None:
    from opsd.data.batching import TokenWeights

    samples = _random_samples(seed=0, count=11, prompt_lens=(3, 20))
    global_tokens, global_seqs = float(sum(s.response_len for s in samples) * 2), float(len(samples) * 2)
    weights = TokenWeights(reduction, global_tokens, global_seqs)
    mbs = make_microbatches(samples, max_tokens=120, pad_id=0, weights=weights, device="cpu")
    groups = pack_microbatches([max(len(s.student_ids), len(s.teacher_ids)) for s in samples], 120)
    assert len(groups) > 2 and [m.sample_indices for m in mbs] == groups  # same groups, same order
    for mb, group in zip(mbs, groups, strict=True):
        assert isinstance(mb, MicroBatch)
        chosen = [samples[i] for i in group]
        want = _trainer_microbatch(chosen, 0, reduction, global_tokens, global_seqs)
        for name, tensor in want.items():
            got = getattr(mb, name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert mb.weights.dtype == torch.float32
        assert mb.response_lens == [s.response_len for s in chosen]
        assert mb.student_real_tokens == sum(len(s.student_ids) for s in chosen) == int(mb.student_mask.sum())
        assert mb.teacher_real_tokens == sum(len(s.teacher_ids) for s in chosen) == int(mb.teacher_mask.sum())
        assert mb.student_padded_tokens == mb.student_ids.numel()
        assert mb.teacher_padded_tokens == mb.teacher_ids.numel()
        # the positions pick the hidden states that predict the targets, on both sides
        for side in ("student", "teacher"):
            ids, pos = getattr(mb, f"{side}_ids").reshape(-1), getattr(mb, f"{side}_pos")
            assert torch.equal(ids[pos + 1], mb.targets)
    total = torch.cat([m.weights for m in mbs]).double().sum().item()
    assert total == pytest.approx(0.5)  # this rank's half of the global loss weight
    with pytest.raises(ValueError, match="reduction"):
        TokenWeights("mean", 1.0, 1.0)


def test_bucket_widths_are_sixteen_per_doubling_and_at_most_six_percent_wider() -> None:
    from opsd.cpu.buckets import bucket_width

    widths = [bucket_width(n) for n in range(1, 5000)]
    assert all(w >= n and (w - n) <= 0.0625 * n for n, w in zip(range(1, 5000), widths, strict=True))
    assert all(bucket_width(w) == w for w in widths)  # a bucket width is its own bucket
    got = [bucket_width(n) for n in (32, 33, 250, 256, 257, 1000, 4097)]
    assert got == [32, 34, 256, 256, 272, 1024, 4352]
    for k in range(6, 12):  # lengths in (2**(k-1), 2**k] take sixteen widths
        assert len({bucket_width(n) for n in range(2 ** (k - 1) + 1, 2**k + 1)}) == 16


def test_microbatch_widths_in_buckets() -> None:
    """With bucket (a CPU in bf16) every padded width is a bucket width, the budget bounds the bucketed
    widths, and the positions still pick the hidden states that predict the targets."""
    from opsd.cpu import RowWidths
    from opsd.cpu.buckets import bucket_width
    from opsd.data.batching import TokenWeights

    samples = _random_samples(seed=1, count=9, prompt_lens=(30, 60))
    kw = dict(pad_id=0, weights=TokenWeights("token", 100.0, 9.0), device="cpu")
    mbs = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket=True), **kw)
    bucketed = [bucket_width(max(len(s.student_ids), len(s.teacher_ids))) for s in samples]
    assert [m.sample_indices for m in mbs] == pack_microbatches(bucketed, 250)
    wider = 0
    for mb in mbs:
        chosen = [samples[i] for i in mb.sample_indices]
        for side in ("student", "teacher"):
            width = getattr(mb, f"{side}_ids").shape[1]
            longest = max(len(getattr(s, f"{side}_ids")) for s in chosen)
            assert width == bucket_width(longest)
            wider += width > longest
            ids, pos = getattr(mb, f"{side}_ids").reshape(-1), getattr(mb, f"{side}_pos")
            assert torch.equal(ids[pos + 1], mb.targets)
        assert len(chosen) == 1 or mb.teacher_padded_tokens <= 250
        assert mb.student_real_tokens == sum(len(s.student_ids) for s in chosen) == int(mb.student_mask.sum())
        assert mb.teacher_real_tokens == sum(len(s.teacher_ids) for s in chosen) == int(mb.teacher_mask.sum())
    assert wider > 0  # the test exercises the padding
    plain = make_microbatches(samples, max_tokens=250, **kw)
    same = [torch.cat([m.targets for m in x]).sort().values for x in (plain, mbs)]
    assert torch.equal(*same)  # the same response tokens, however grouped


@pytest.mark.parametrize("bucket", [False, True])
def test_packed_microbatches_name_each_rows_width(bucket: bool) -> None:
    """``pack_from`` (a CPU, one process) changes no tensor: where a side's rows differ in width and
    the shortest reaches it, it records each row's own width (its length, or its bucket width, never
    wider than the group's) and counts only those positions as computed; elsewhere rows stay batched."""
    from opsd.cpu import RowWidths
    from opsd.cpu.buckets import bucket_width
    from opsd.data.batching import TokenWeights

    samples = _random_samples(seed=2, count=9, prompt_lens=(10, 60))
    kw = dict(pad_id=0, weights=TokenWeights("token", 100.0, 9.0), device="cpu")
    batched = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket), **kw)
    never = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket, 10_000), **kw)
    assert all(m.student_rows is None and m.teacher_rows is None for m in never)
    rows = make_microbatches(samples, max_tokens=250, widths=RowWidths(bucket, 1), **kw)
    assert [m.sample_indices for m in rows] == [m.sample_indices for m in batched]
    packed = 0
    for k, (a, b) in enumerate(zip(batched, rows)):
        assert a.student_rows is None and a.teacher_rows is None
        for side in ("student", "teacher"):
            ids, widths = getattr(b, f"{side}_ids"), getattr(b, f"{side}_rows")
            assert torch.equal(ids, getattr(a, f"{side}_ids"))
            assert torch.equal(getattr(b, f"{side}_pos"), getattr(a, f"{side}_pos"))
            lengths = [len(getattr(samples[i], f"{side}_ids")) for i in b.sample_indices]
            own = [bucket_width(n) if bucket else n for n in lengths]
            if len(set(own)) == 1:  # one row, or equal ones: packing would save nothing
                assert widths is None and getattr(b, f"{side}_padded_tokens") == ids.numel()
                continue
            packed += 1
            assert widths == own and all(n <= w <= ids.shape[1] for n, w in zip(lengths, widths))
            assert getattr(b, f"{side}_padded_tokens") == sum(widths) < ids.numel()
            shortest = make_microbatches(
                samples, max_tokens=250, widths=RowWidths(bucket, min(own) + 1), **kw
            )
            assert getattr(shortest[k], f"{side}_rows") is None
    assert packed > 0
