"""A micro-batch's rows packed into one sequence for one forward: no padding, no attention mask.

transformers passes ``cu_seq_lens_q`` (the flash kernels' packed convention) to the attention
function; :data:`PACKED_SDPA`, registered under its own name, calls transformers' ``sdpa`` once per
row with it, and is plain ``sdpa`` without it (generation, batched micro-batches)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

PACKED_SDPA = "opsd_sdpa"  # transformers' sdpa attention that also runs packed rows

PACK_TOKENS = 128  # the shortest row that runs packed ...
PACK_FLOPS = 1 << 29  # ... and the least work its forward does (2 x non-embedding params x tokens)


def pack_from(params: int) -> int:
    """The shortest row, in tokens, that runs packed in a micro-batch of unequal rows: the larger of 128
    tokens and ``PACK_FLOPS / (2 * params)`` (``params``: the model's non-embedding parameters).

    Why: a packed row computes no padding and attention skips the causal triangle, but each row still
    costs an attention call and its indexing; rows this long keep that small, and the tiny models'
    short rows stay batched (docs/cpu.md, "Packed rows")."""
    return max(PACK_TOKENS, -(-PACK_FLOPS // max(1, 2 * params)))


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pack_rows(*models: nn.Module | None) -> int:
    """Models attending with transformers' ``sdpa`` switch to :data:`PACKED_SDPA`. Returns how many
    switched (0 where this transformers has no attention registry, or a model attends otherwise)."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        return 0
    AttentionInterface.register(PACKED_SDPA, _packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    switched = 0
    for model in models:
        if model is None:
            continue
        base = _base(model)
        if base.config._attn_implementation == "sdpa" and hasattr(base, "set_attn_implementation"):
            base.set_attn_implementation(PACKED_SDPA)
            switched += 1
    return switched


def is_packed(decoder: nn.Module) -> bool:
    """Whether ``decoder`` attends with :data:`PACKED_SDPA`."""
    return decoder.config._attn_implementation == PACKED_SDPA


def packed_hidden(decoder: nn.Module, input_ids: Tensor, positions: Tensor, rows: list[int]) -> Tensor:
    """The final hidden states at ``positions`` (flat indices into the padded ``[B, width]`` batch) of
    the rows' first ``rows[b]`` tokens, run as one sequence. Position ids restart at each row: rotary
    attention depends only on position differences, but float32 angles round with their size, so
    each row keeps the batched forward's angles."""
    device = input_ids.device
    width = input_ids.shape[1]
    counts = torch.bincount(positions // width, minlength=len(rows)).tolist()
    read = [b for b, n in enumerate(counts) if n]
    ids = torch.cat([input_ids[b, : rows[b]] for b in read])
    position_ids = torch.cat([torch.arange(rows[b], device=device) for b in read])
    lengths = torch.tensor([0] + [rows[b] for b in read], device=device)
    bounds = lengths.cumsum(0)
    start = torch.zeros(len(rows), dtype=torch.long, device=device)
    start[read] = bounds[:-1]
    out = decoder(input_ids=ids[None], position_ids=position_ids[None], cu_seq_lens_q=bounds, use_cache=False)
    row = positions // width
    return out.last_hidden_state[0].index_select(0, start[row] + positions - row * width)


def _packed_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *args,
    cu_seq_lens_q: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' sdpa attention; with ``cu_seq_lens_q`` each row attends causally to itself alone,
    one ``is_causal`` call per row (the packed sequence's block mask is not used)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    bounds = cu_seq_lens_q.tolist()
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        parts.append(sdpa_attention_forward(module, q, k, v, None, *args, **kwargs)[0])
    return torch.cat(parts, dim=1), None
