"""The FLOPs of an OPSD step's teacher and student passes, and the peaks they are quoted against.

Why a counter of its own: the evidence run's MFU used 6 N T for the student and 2 N T for the teacher
with N the whole model (the 311M-parameter tied head of Qwen3-1.7B included) over every token. The
fused loss multiplies the head by the response rows only, and LoRA's backward makes no weight gradient
of the frozen base: full fine-tuning came out ~8% high, LoRA ~30%.

The arithmetic (a matrix of n parameters costs 2 n FLOPs per token forward; backward, 2 n for the
input's gradient and 2 n more for the weight's where it trains):

    student      full: 6 N_body T_s        LoRA: 4 N_body T_s + 6 N_lora T_s
    teacher      2 N_body T_t              (LoRA's teacher is the base with the adapters off)
    head         8 V H R  (full: student 2 + teacher 2 forward, dL/dh 2, dL/dW 2)
                 6 V H R  (LoRA: the head is frozen, no dL/dW)
    attention    per layer and sequence of L tokens, causal: 2 d L (L + 1) forward (Q K^T and A V,
                 d = query heads x head_dim); the student 3x that (forward + backward), the teacher 1x

N_body: the decoder's matrices (no embedding, no head, no norms, no adapters); N_lora: the adapters;
T_s, T_t: the real (unpadded) tokens of the student's and the teacher's sequences; R: the response
tokens, the rows the loss reads; V, H: the head's shape. Counted is the model's work: padding, the
loss's second bf16 product per logit block (``loss.fused.logits_bf16``), the rollout and the optimizer
are not. ``tests/train/test_gpu_flops.py`` checks the counter against a hand count at Qwen3-1.7B's shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

H200_BF16_DENSE = 989e12  # FLOP/s: the H200's dense bf16 peak by NVIDIA's datasheet (the H100 SXM's)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count reads from a model."""

    body: int  # N_body: parameters of the decoder's matrices
    adapters: int  # N_lora: LoRA's parameters (trained)
    vocab: int  # V
    hidden: int  # H
    layers: int
    attn_width: int  # query heads x head_dim
    head_trains: bool  # the head gets a weight gradient (full fine-tuning)
    body_trains: bool  # the decoder's matrices get weight gradients (full fine-tuning)


def model_shape(model: nn.Module) -> ModelShape:
    """Count ``model``'s (a transformers causal LM, under a peft wrapper or not) matrices by kind. Works
    on the meta device: nothing is read but shapes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    head = base.get_output_embeddings().weight
    skip = {id(head), id(base.get_input_embeddings().weight)}
    body = adapters = 0
    body_trains = False
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        if "lora_" in name:
            adapters += p.numel()
        elif p.dim() >= 2:
            body += p.numel()
            body_trains |= p.requires_grad
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelShape(
        body=body,
        adapters=adapters,
        vocab=head.shape[0],
        hidden=head.shape[1],
        layers=cfg.num_hidden_layers,
        attn_width=heads * head_dim,
        head_trains=head.requires_grad,
        body_trains=body_trains,
    )


def attention_flops(shape: ModelShape, lengths: Iterable[int]) -> float:
    """Causal attention's forward over sequences of these lengths, every layer: 2 d L (L + 1) each."""
    return float(sum(2 * shape.attn_width * n * (n + 1) for n in lengths) * shape.layers)


def step_flops(
    shape: ModelShape, student_lens: Sequence[int], teacher_lens: Sequence[int], response_tokens: int
) -> dict[str, float]:
    """One step's teacher and student passes by part (the module docstring's arithmetic), and ``total``."""
    t_s, t_t, r = sum(student_lens), sum(teacher_lens), response_tokens
    student = (6 if shape.body_trains else 4) * shape.body * t_s + 6 * shape.adapters * t_s
    teacher = 2 * shape.body * t_t
    head = (8 if shape.head_trains else 6) * shape.vocab * shape.hidden * r
    attention = 3 * attention_flops(shape, student_lens) + attention_flops(shape, teacher_lens)
    parts = {
        "student": float(student),
        "teacher": float(teacher),
        "head": float(head),
        "attention": attention,
    }
    return {**parts, "total": sum(parts.values())}


def batch_lengths(batches: Iterable) -> tuple[list[int], list[int], int]:
    """The real sequence lengths of a step's micro-batches (student, teacher) and its response tokens;
    a zero-weight padding micro-batch (no samples) counts nothing."""
    student: list[int] = []
    teacher: list[int] = []
    response = 0
    for mb in batches:
        if not mb.sample_indices:
            continue
        student += [int(x) for x in mb.student_mask.sum(1).tolist()]
        teacher += [int(x) for x in mb.teacher_mask.sum(1).tolist()]
        response += sum(mb.response_lens)
    return student, teacher, response


def matmul_peak(device: str, dtype: torch.dtype, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n x n x n`` matrix product on ``device`` measured here: the mean of ``reps`` timed
    products after three warm-ups, on random data (an MFU's denominator that this very machine
    reaches, beside the datasheet's)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)
