"""vLLM's KV cache on a CPU, sized to the batch: vLLM's CPU build reads ``gpu_memory_utilization`` as a
share of the machine's RAM and takes it all for its cache. The colocated engine takes
:func:`colocated_kv_kwargs` (the plan's ``size_kv_cache``), ``opsd serve`` :func:`serve_flags`.
Light (torch and the model code load inside the functions): ``opsd serve`` imports it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from opsd.errors import UserError

SERVE_CPU_MAX_MODEL_LEN = 4096  # `opsd serve` on a CPU without --max-model-len (capped by the model's)


def cpu_kv_cache_bytes(config, dtype: str, max_num_seqs: int | None, max_model_len: int | None) -> int | None:
    """Bytes of KV cache that hold ``max_num_seqs`` sequences of ``max_model_len`` tokens at once: per token
    K and V of every layer (KV heads x head size in ``dtype``), each sequence rounded up to 256-token
    blocks plus one (vLLM's CPU blocks are 128 tokens; some backends use 256).

    Why: on a CPU vLLM reads ``gpu_memory_utilization`` as a share of the machine's RAM and takes it all
    for its cache, less what the process already holds: 0.4 of 24 GB made a SmolLM2-135M step peak at
    6.67 GiB RSS, for a rollout that needs a few hundred MB. None when the model's config does not say
    (then vLLM's own sizing stands)."""
    import torch

    from opsd.models import head_size

    if config is None or not max_num_seqs or not max_model_len:
        return None
    try:
        heads = int(config.num_attention_heads)
        layers = int(config.num_hidden_layers)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = head_size(config)
        width = torch.finfo(getattr(torch, dtype)).bits // 8
    except (AttributeError, TypeError, ValueError):
        return None
    block = 256
    tokens = max_num_seqs * (-(-max_model_len // block) + 1) * block
    return 2 * layers * kv_heads * head_dim * width * tokens


def colocated_kv_kwargs(
    config,
    dtype: str,
    max_num_seqs: int | None,
    max_model_len: int | None,
    *,
    llm_kwargs: Mapping[str, Any],
    gpu_memory_utilization: float | None,
) -> dict[str, int]:
    """``vllm.LLM``'s ``kv_cache_memory_bytes`` for the colocated engine, unless the user sized the
    cache (``rollout.gpu_memory_utilization``, ``rollout.vllm_kwargs`` or ``VLLM_CPU_KVCACHE_SPACE``)
    or the model's config does not say; rank 0 says what was sized."""
    sized = "kv_cache_memory_bytes" in llm_kwargs or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if gpu_memory_utilization is not None or sized:
        return {}
    kv = cpu_kv_cache_bytes(config, dtype, max_num_seqs, max_model_len)
    if not kv:
        return {}
    from opsd.distributed import rank_world

    if rank_world()[0] == 0:
        print(
            f"vLLM on the CPU: a {kv / 2**30:.2f} GiB KV cache for {max_num_seqs} sequences of "
            f"{max_model_len} tokens (set rollout.gpu_memory_utilization for a share of the RAM)",
            file=sys.stderr,
        )
    return {"kv_cache_memory_bytes": kv}


def serve_flags(
    args: argparse.Namespace, dtype: str, *, given: Callable[[str], str | None], config: Callable[[], Any]
) -> tuple[list[str], str | None]:
    """``opsd serve``'s flags for vLLM's CPU build, none where CUDA runs it; with the line that says
    what was sized. ``given(flag)``: what ``--vllm-args`` sets it to; ``config()``: the model's config.
    Eager (a compiled graph may keep stale prepacked weights) and whole prefills: vLLM 0.32's CPU
    runner rewinds a seeded request's generator when a chunked prefill discards a sample
    (gpu_model_runner._bookkeeping_sync: gen.set_offset), which CPU generators do not support, and
    the engine dies."""
    import torch

    if torch.cuda.is_available():
        return [], None
    kv, line = serve_kv_args(args, dtype, given=given, config=config)
    return ["--enforce-eager", "--no-enable-chunked-prefill", *kv], line


def serve_kv_args(
    args: argparse.Namespace, dtype: str, *, given: Callable[[str], str | None], config: Callable[[], Any]
) -> tuple[list[str], str | None]:
    """On a CPU vLLM reserves ``gpu_memory_utilization`` (0.92 by default) of the machine's RAM for its
    KV cache, which fails beside a trainer: size it instead, as the colocated engine does, to hold
    ``--max-num-seqs`` sequences of ``--max-model-len`` tokens, and cap vLLM's scheduler at that many.
    What ``--vllm-args`` sets stands. Returns the flags to add and the line that says what was sized."""
    if given("--kv-cache-memory-bytes") or given("--gpu-memory-utilization"):
        return [], None
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return [], None
    added: list[str] = []
    loaded = config()
    text = loaded.get_text_config() if hasattr(loaded, "get_text_config") else loaded
    length = given("--max-model-len") or args.max_model_len
    if length is None:
        longest = getattr(text, "max_position_embeddings", None) or SERVE_CPU_MAX_MODEL_LEN
        length = min(SERVE_CPU_MAX_MODEL_LEN, int(longest))
        added += ["--max-model-len", str(length)]
    seqs = given("--max-num-seqs")
    if seqs is None:
        seqs = args.max_num_seqs
        added += ["--max-num-seqs", str(seqs)]
    try:
        length, seqs = int(length), int(seqs)
    except ValueError:
        raise UserError(f"--max-model-len {length} / --max-num-seqs {seqs}: expected integers") from None
    kv = cpu_kv_cache_bytes(text, dtype, seqs, length)
    if not kv:
        return added, None
    line = (
        f"vLLM on the CPU: a {kv / 2**30:.2f} GiB KV cache for {seqs} sequences of {length} tokens "
        "(--max-num-seqs, --max-model-len; --vllm-args='--kv-cache-memory-bytes N' sets it)"
    )
    return [*added, "--kv-cache-memory-bytes", str(kv)], line
