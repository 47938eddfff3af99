"""LoRA and the out-of-place merge: the adapter alone trains, folded and merged weights match peft's merge,
the final hidden states and head make the logits."""

from __future__ import annotations

import pytest
import torch

from opsd import models
from opsd.errors import UserError
from opsd.models import (
    apply_lora,
    check_plain_head,
    final_hidden,
    head_weight,
    merged_state_dict,
    merged_weight_names,
    merged_weights,
)
from opsd.tiny import build_tiny_model

# --- LoRA, the final-hidden forward, the out-of-place merge ------------------------------------


def _lora(model, **kw):
    kw = {
        "r": 4,
        "alpha": 16,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "gradient_checkpointing": False,
        **kw,
    }
    return apply_lora(model, **kw)


def _randomize_lora_b(model) -> None:
    """peft starts B at zero (delta 0); a merge test needs a real delta."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_apply_lora_trains_only_the_adapter(tiny_model):
    lora = _lora(tiny_model)
    assert lora.training
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-2] for n in trainable} == {"default"}
    assert any("q_proj" in n for n in trainable) and any("v_proj" in n for n in trainable)


def test_apply_lora_with_gradient_checkpointing_gives_the_same_gradients(tiny_tokenizer):
    from opsd.models import enable_gradient_checkpointing

    ids = torch.tensor([tiny_tokenizer("What is 12 + 30? 42").input_ids])
    grads = []
    for checkpointing in (False, True):
        model = build_tiny_model(tiny_tokenizer, seed=0)
        if checkpointing:
            enable_gradient_checkpointing(model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # lora_A's initialisation
            lora = _lora(model, gradient_checkpointing=checkpointing)
        _randomize_lora_b(lora)
        lora(ids).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in lora.named_parameters() if p.requires_grad})
    assert all(g is not None for g in grads[1].values())
    for n, g in grads[0].items():
        # exact: checkpointing recomputes the same forward on the same values
        torch.testing.assert_close(grads[1][n], g, rtol=0, atol=0)


def test_frozen_weights_for_cpu_changes_layout_not_values(tiny_tokenizer):
    """Frozen Linear weights become column-major with the same values (tied head counted once);
    trainable ones keep their layout; the forward agrees to float64 rounding (error model: the same
    sums in another order, ~1e-16 relative per product, far below 1e-12)."""
    from opsd.cpu.layout import frozen_weights

    ids = torch.tensor([tiny_tokenizer("What is 12 + 30? 42").input_ids])
    model = build_tiny_model(tiny_tokenizer, seed=0).double()
    lora = _lora(model)
    _randomize_lora_b(lora)
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    with torch.no_grad():
        want = lora(ids).logits
    moved = frozen_weights(lora, None)
    linear = [m for m in lora.modules() if isinstance(m, torch.nn.Linear)]
    frozen = {id(m.weight): m.weight for m in linear if not m.weight.requires_grad}
    assert moved == len(frozen) > 0
    for w in frozen.values():
        assert w.stride() == (1, w.shape[0]) and w.t().is_contiguous()
    for n, p in lora.named_parameters():
        assert torch.equal(p, before[n]), n
        if p.requires_grad:
            assert p.is_contiguous(), n
    with torch.no_grad():
        got = lora(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_lora_folded_matches_the_adapter_and_restores_every_bit(tiny_tokenizer):
    """Inside: the adapter folded into copies equals the unmerged forward to float64 rounding (the
    same products summed in another order); after: the very tensors, bit for bit, and the adapter on.
    Too small a byte limit folds nothing."""
    from opsd.cpu.fold import lora_folded
    from opsd.cpu.layout import frozen_weights

    ids = torch.tensor([tiny_tokenizer("What is 12 + 30? 42").input_ids])
    lora = _lora(build_tiny_model(tiny_tokenizer, seed=0).double())
    _randomize_lora_b(lora)
    frozen_weights(lora)
    lora.eval()
    bases = [m.base_layer.weight for m in lora.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    saved = [(w.data_ptr(), w.stride(), w.detach().clone()) for w in bases]
    with torch.no_grad():
        want = lora(ids).logits
        with lora_folded(lora, max_bytes=1 << 30) as folded:
            assert folded
            assert all(w.data_ptr() != ptr for w, (ptr, _, _) in zip(bases, saved))
            inside = lora(ids).logits
        after = lora(ids).logits
        with lora_folded(lora, max_bytes=16) as folded_small:
            assert not folded_small
            small = lora(ids).logits
    with torch.no_grad(), lora.disable_adapter():
        assert not torch.allclose(inside, lora(ids).logits)  # the adapter is in it
    torch.testing.assert_close(inside, want, rtol=1e-12, atol=1e-12)
    for w, (ptr, stride, value) in zip(bases, saved):
        assert w.data_ptr() == ptr and w.stride() == stride and torch.equal(w, value)
    assert torch.equal(after, want) and torch.equal(small, want)


@pytest.mark.parametrize("wrap", [False, True])
def test_final_hidden_and_head_weight_make_the_logits(tiny_model, tiny_tokenizer, wrap):
    model = _lora(tiny_model) if wrap else tiny_model
    if wrap:
        _randomize_lora_b(model)
    ids = torch.tensor([tiny_tokenizer("12 + 7 = 19").input_ids])
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1])
    with torch.no_grad():
        logits = final_hidden(model, ids, mask, positions) @ head_weight(model).T
        # exact: the same decoder forward (an all-ones mask) and the same hidden @ W.T product as lm_head's
        torch.testing.assert_close(logits, model(ids).logits[0], rtol=0, atol=0)


@pytest.mark.parametrize("bucket", [False, True])
def test_final_hidden_of_packed_rows_is_the_batched_forward(tiny_tokenizer, bucket, monkeypatch):
    """Rows attending only to themselves (a CPU's micro-batches), packed into one sequence
    (:func:`opsd.cpu.packing.pack_rows`), without an attention mask, give the padded batch's hidden
    states and gradients. Float64, so the only difference is the products' summation order (another
    number of rows): within 1e-12 relative. With ``bucket`` a row keeps padding after its tokens,
    which causal attention cannot see; a row read at another offset, or packed rows attending across
    their bounds, fails it."""
    from opsd.cpu import RowWidths
    from opsd.data.batching import TokenWeights, make_microbatches, make_sample

    model = _lora(build_tiny_model(tiny_tokenizer, seed=0), target_modules=["q_proj", "v_proj", "down_proj"])
    models.float64_throughout(model.to(torch.float64))
    _randomize_lora_b(model)
    from transformers import AttentionInterface
    from transformers.integrations import sdpa_attention

    from opsd.cpu import packing

    attention, packs = [], []  # each attention call's (query length, masked?); each packed forward
    real_sdpa, real_packed = sdpa_attention.sdpa_attention_forward, models.packed_hidden

    def spy_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        attention.append((query.shape[2], attention_mask is not None))
        return real_sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    def spy_packed(*args, **kwargs):
        packs.append(1)
        return real_packed(*args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy_sdpa)  # what the packed rows call
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy_sdpa)  # what "sdpa" models call
    monkeypatch.setattr(models, "packed_hidden", spy_packed)
    assert packing.pack_rows(model) == 1
    assert model.get_base_model().config._attn_implementation == packing.PACKED_SDPA
    gen = torch.Generator().manual_seed(3)
    lengths = [(5, 9, 3), (17, 29, 6), (11, 11, 1), (27, 41, 8)]  # (student prompt, teacher prompt, response)
    samples = []
    for i, (s_len, t_len, r_len) in enumerate(lengths):
        s_ids, t_ids, resp = (
            torch.randint(5, 200, (n,), generator=gen).tolist() for n in (s_len, t_len, r_len)
        )
        samples.append(make_sample(s_ids, t_ids, resp, i, "stop"))
    kw = dict(max_tokens=10_000, pad_id=0, weights=TokenWeights("token", 18.0, 4.0), device="cpu")
    (mb,) = make_microbatches(samples, widths=RowWidths(bucket, pack_from=1), **kw)
    assert min(mb.teacher_rows) < mb.teacher_ids.shape[1] and len(set(mb.teacher_rows)) > 1
    real = [len(x.teacher_ids) for x in samples] + [len(x.student_ids) for x in samples]
    assert (mb.teacher_rows + mb.student_rows != real) == bucket  # bucket: padding after some row's tokens
    lora_params = [p for p in model.parameters() if p.requires_grad]
    got = {}
    for how, side in (
        ("batched", "student"),
        ("rows", "student"),
        ("batched", "teacher"),
        ("rows", "teacher"),
    ):
        ids, mask, pos = (getattr(mb, f"{side}_{k}") for k in ("ids", "mask", "pos"))
        rows = getattr(mb, f"{side}_rows") if how == "rows" else None
        hidden = final_hidden(model, ids, mask, pos, rows)
        loss = (hidden * torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)).sum()
        grads = torch.autograd.grad(loss, lora_params)
        got[how, side] = (hidden.detach(), torch.cat([g.flatten() for g in grads]))
    for side in ("student", "teacher"):
        for a, b in zip(got["batched", side], got["rows", side]):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12 * float(a.abs().max()))
    assert got["rows", "student"][0].shape == (18, model.config.hidden_size)
    # Every row's attention ran unmasked over its own width (a packed sequence attending through its
    # block mask would be one masked call over all rows), layer by layer, each row in turn, in one
    # forward per side.
    layers = model.config.num_hidden_layers

    def unmasked(rows: list[int]) -> list[tuple[int, bool]]:
        return [(w, False) for w in rows] * layers

    assert [c for c in attention if not c[1]] == unmasked(mb.student_rows) + unmasked(mb.teacher_rows)
    assert len(attention) == 2 * layers + len(mb.student_rows + mb.teacher_rows) * layers
    assert len(packs) == 2


def test_check_plain_head(tiny_tokenizer):
    check_plain_head(build_tiny_model(tiny_tokenizer))
    capped = build_tiny_model(tiny_tokenizer)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(UserError, match="final_logit_softcapping=30.0"):
        check_plain_head(capped)
    biased = build_tiny_model(tiny_tokenizer)
    biased.lm_head = torch.nn.Linear(biased.config.hidden_size, biased.config.vocab_size, bias=True)
    with pytest.raises(UserError, match="with a bias"):
        check_plain_head(biased)


def test_merged_state_dict_matches_merge_and_unload(tiny_model):
    """What checkpoint export and vLLM sync use: base names, deltas folded in, model untouched."""
    names = set(tiny_model.state_dict())
    lora = _lora(tiny_model)
    _randomize_lora_b(lora)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    merged = merged_state_dict(lora)
    assert set(merged) == names
    assert all(torch.equal(v, before[k]) for k, v in lora.state_dict().items())  # out of place
    reference = lora.merge_and_unload().state_dict()
    for k, v in reference.items():
        # exact: both add the same get_delta_weight() to the same base weight
        torch.testing.assert_close(merged[k], v, rtol=0, atol=0)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )


def test_merged_weights_of_column_major_weights_and_two_adapters_match_merge_and_unload(tiny_model):
    """The weight-sync path of a CPU trainer: frozen weights laid out column-major, two adapters active
    at once. Each merged matrix comes back row-major (what vLLM and safetensors read) and equal, bit for
    bit, to peft's merge_and_unload (exact: the same additions of the same deltas in adapter order)."""
    from peft import LoraConfig

    from opsd.cpu.layout import frozen_weights

    lora = _lora(tiny_model)
    lora.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"]))
    lora.base_model.set_adapter(["default", "second"])
    _randomize_lora_b(lora)
    frozen_weights(lora)
    v_proj = lora.base_model.model.model.layers[0].self_attn.v_proj
    assert v_proj.active_adapters == ["default", "second"] and not v_proj.base_layer.weight.is_contiguous()
    merged = dict(merged_weights(lora))
    reference = lora.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for k, v in reference.items():
        assert merged[k].is_contiguous(), k
        torch.testing.assert_close(merged[k], v, rtol=0, atol=0)


@pytest.mark.parametrize("column_major", [False, True])
def test_merged_weights_of_a_bf16_base_with_float32_adapters_match_peft(tiny_model, column_major):
    """LoRA's default on a bf16 model: float32 adapters. Each delta is rounded to bf16 and then added
    (what peft's safe merge computes: ``W + delta.to(W.dtype)``), bit for bit, in either layout."""
    from opsd.cpu.layout import frozen_weights

    lora = _lora(tiny_model.to(torch.bfloat16), alpha=6, target_modules=["q_proj", "v_proj", "up_proj"])
    _randomize_lora_b(lora)
    v_proj = lora.base_model.model.model.layers[0].self_attn.v_proj
    assert v_proj.lora_B["default"].weight.dtype == torch.float32
    assert v_proj.base_layer.weight.dtype == torch.bfloat16
    frozen_weights(lora, column_major=column_major)
    assert v_proj.base_layer.weight.is_contiguous() != column_major
    merged = dict(merged_weights(lora))
    reference = lora.merge_and_unload(safe_merge=True).state_dict()
    assert merged.keys() == reference.keys()
    for k, v in reference.items():
        assert merged[k].dtype == torch.bfloat16 and merged[k].is_contiguous(), k
        assert torch.equal(merged[k], v), k


def test_merged_state_dict_of_a_plain_model_is_its_state_dict(tiny_model):
    merged = merged_state_dict(tiny_model)
    assert merged.keys() == tiny_model.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in tiny_model.state_dict().items())


def test_merged_weights_merges_one_matrix_at_a_time(tiny_model, monkeypatch):
    """Defect 8 of the vLLM issue: the stream builds each merged LoRA matrix only when it is asked for,
    so a consumer that drops it before the next never holds two; names come without any tensor."""
    import opsd.models as models

    lora = _lora(tiny_model)
    _randomize_lora_b(lora)
    calls = []
    merge = models.plus_deltas
    monkeypatch.setattr(models, "plus_deltas", lambda *a, **kw: calls.append(a[2]) or merge(*a, **kw))
    names = merged_weight_names(lora)
    assert calls == [] and not any("lora_" in n or "base_layer" in n for n in names)
    stream, seen = merged_weights(lora), []
    for name, _ in stream:
        seen.append(name)
        lora_so_far = sum(".q_proj." in n or ".v_proj." in n for n in seen)
        assert len(calls) == lora_so_far  # no delta computed ahead of its own tensor
    assert seen == names and len(calls) > 1
