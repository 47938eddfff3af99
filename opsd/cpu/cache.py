"""The HF engine's preallocated KV cache on a CPU (the plan's ``static_cache``).

Why: a growing cache re-copies every layer's keys and values at each token: 73 of a 426 ms decode
step at batch 8 (docs/cpu.md, "Static KV cache")."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from transformers import StaticCache

from opsd.models import base_model


def static_cache(model: nn.Module, max_len: int) -> dict[str, Any]:
    """``generate``'s cache argument: a fresh StaticCache of ``max_len`` tokens, made for one batch
    alone (one reused at another length would move the log-probs' last bits), under the name this
    transformers reads (``cache`` from 5.2x, ``past_key_values`` before)."""
    net = base_model(model)
    name = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"
    return {name: StaticCache(config=net.config, max_cache_len=max_len)}
