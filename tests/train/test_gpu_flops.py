"""bench/gpu/flops.py: the evidence run's FLOP counter against a hand count at Qwen3-1.7B's shape, built on
the meta device (shapes only, no memory), full fine-tuning and LoRA r=64 on every linear layer."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT


def _flops():
    spec = importlib.util.spec_from_file_location("gpu_flops", ROOT / "bench" / "gpu" / "flops.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_flops"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


# A step of check 4: 8 prompts x 2 responses; student 128 prompt + 256 response tokens, teacher 128 + 384
# (the reference solution) + 256.
SEQS, PROMPT, SOLUTION, RESPONSE = 16, 128, 384, 256
STUDENT = [PROMPT + RESPONSE] * SEQS
TEACHER = [PROMPT + SOLUTION + RESPONSE] * SEQS
R = SEQS * RESPONSE

# Qwen3-1.7B by hand: 28 layers; q and o 2048 x 2048, k and v 2048 x 1024 (8 KV heads x 128), gate, up
# and down 2048 x 6144; a tied 151936 x 2048 head; 16 query heads x 128 = 2048 wide attention.
LAYERS, V, H = 28, 151936, 2048
BODY = LAYERS * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144)  # 1,409,286,144
# LoRA r=64: r x (in + out) per matrix: q 2048+2048, k and v 2048+1024, o 2048+2048, gate, up, down 2048+6144
LORA = LAYERS * 64 * (2 * 4096 + 2 * 3072 + 3 * 8192)  # 69,730,304
# Causal attention per layer and sequence: Q K^T and A V, 2 x 2048 x L(L+1)/2 multiply-adds each.
ATTN_FWD_S = LAYERS * SEQS * 2 * 2048 * STUDENT[0] * (STUDENT[0] + 1)
ATTN_FWD_T = LAYERS * SEQS * 2 * 2048 * TEACHER[0] * (TEACHER[0] + 1)
T_S, T_T = sum(STUDENT), sum(TEACHER)
HAND = {
    # forward 2, input gradient 2, weight gradient 2 per parameter and token; the head on R rows: student
    # and teacher forwards, dL/dh and dL/dW; attention's backward twice its forward
    "full": 6 * BODY * T_S + 2 * BODY * T_T + 8 * V * H * R + 3 * ATTN_FWD_S + ATTN_FWD_T,
    # the frozen base: no weight gradient (4 per parameter and token), the adapters train (6); the head
    # is frozen: no dL/dW
    "lora": 4 * BODY * T_S + 6 * LORA * T_S + 2 * BODY * T_T + 6 * V * H * R + 3 * ATTN_FWD_S + ATTN_FWD_T,
}


@pytest.fixture(scope="module")
def qwen3_meta():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=6144,
        num_hidden_layers=LAYERS,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("setup", ["full", "lora"])
def test_flop_counter_matches_a_hand_count_at_qwen3_shape(qwen3_meta, setup):
    from peft import LoraConfig, get_peft_model

    flops = _flops()
    model = qwen3_meta
    if setup == "lora":
        with torch.device("meta"):
            model = get_peft_model(qwen3_meta, LoraConfig(r=64, lora_alpha=128, target_modules="all-linear"))
    shape = flops.model_shape(model)
    assert (shape.body, shape.vocab, shape.hidden) == (BODY, V, H)
    got = flops.step_flops(shape, STUDENT, TEACHER, R)
    assert got["total"] == pytest.approx(HAND[setup], rel=0.01)
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    # The count it replaces, 6 N T_s + 2 N T_t with N the saved model's parameters (1.72e9: the tied head
    # once, no adapters) over every token, overstated full fine-tuning by ~7% and LoRA by ~30%.
    n = BODY + V * H
    old = 6 * n * T_S + 2 * n * T_T
    assert old / got["total"] == pytest.approx({"full": 1.07, "lora": 1.30}[setup], abs=0.02)


def test_batch_lengths_count_real_tokens_and_skip_a_zero_weight_microbatch():
    flops = _flops()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    mb = SimpleNamespace(
        sample_indices=[0, 1], student_mask=mask, teacher_mask=mask.repeat(1, 2), response_lens=[2, 3]
    )
    pad = SimpleNamespace(sample_indices=[], student_mask=mask, teacher_mask=mask, response_lens=[1])
    assert flops.batch_lengths([mb, pad]) == ([3, 4], [6, 8], 5)
