"""One OPSD optimizer step on one GPU at Qwen3-1.7B's shape, by phase, and the fused loss alone.

No download and no hub access: the model is a Qwen3-1.7B-shaped config written below with random
weights, fed synthetic token ids of realistic lengths (student prompt 200, teacher prompt 700,
response 1024; 8 samples per step in 2 micro-batches of 4, i.e. 4096 response tokens each).
bf16 compute, sdpa attention. Setups:

* LoRA r=64 on every projection, one process as today; the teacher is the adapter-disabled base.
* the same LoRA, FSDP2-sharded with world size 1 (the path a multi-GPU run takes);
* full fine-tuning, FSDP2 with world size 1: fp32 master weights and AdamW state, bf16 compute,
  fp32 gradient reduction; the fixed teacher is a frozen bf16 copy, FSDP-sharded too.

Per setup: one warm-up step, then the mean over measured steps of each phase of the trainer's own
micro-batch loop (``opsd.trainer.forward_backward``: teacher forward, student forward and backward,
fused loss; then the optimizer incl. clipping) and the peak GPU memory. Then
``fused_linear_distill`` alone, forward+backward (student head trainable), at 4k and 16k response
tokens. Writes the "GPU step" section of docs/benchmarks.md. Must finish within 8 minutes: no setup
starts after 7 (the table then says which were skipped).

    python bench/gpu_step.py            # CUDA only; on a machine without CUDA it says so and exits
    python bench/gpu_step.py --tiny     # a tiny config on any device: checks the script itself
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import _common
import torch
from _md import write_section

ROOT = _common.ROOT
HEADING = "GPU step (bench/gpu_step.py)"
BUDGET_S = 7 * 60  # stop starting new setups after this (the limit is 8 minutes)

# Qwen3-1.7B (Qwen/Qwen3-1.7B config.json), random weights.
QWEN3_1P7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = {  # the same architecture, small enough for a CPU
    **QWEN3_1P7B,
    **dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    **dict(num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
}
LENGTHS = {"prompt": 200, "teacher_prompt": 700, "response": 1024}
TINY_LENGTHS = {"prompt": 20, "teacher_prompt": 70, "response": 64}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHASES = ("teacher", "student", "loss", "optimizer")  # the trainer's timer phases


def _setup_process_group(device: str) -> object:
    """World size 1 through opsd's own initialization (torchrun's variables, set here if absent)."""
    from opsd.distributed import init_distributed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
        )
    return init_distributed(device)


def _model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(**shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def _microbatches(n_samples: int, per_mb: int, lengths: dict, vocab: int, device: torch.device) -> list:
    from opsd.data.batching import make_microbatches, make_sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n_samples):
        ids = torch.randint(
            10, vocab, (lengths["teacher_prompt"] + lengths["response"],), generator=g
        ).tolist()
        resp = ids[lengths["teacher_prompt"] :]
        samples.append(
            make_sample(ids[: lengths["prompt"]], ids[: lengths["teacher_prompt"]], resp, i, "length")
        )
    longest = lengths["teacher_prompt"] + lengths["response"]
    return make_microbatches(
        samples,
        max_tokens=per_mb * longest,
        pad_id=0,
        reduction="token",
        global_tokens=n_samples * lengths["response"],
        global_seqs=n_samples,
        device=device,
    )


def _step(model, teacher, opt, mbs: list, spec, timer) -> None:
    """The trainer's micro-batch loop (opsd.trainer.forward_backward) and update, without rollout."""
    from opsd import parallel
    from opsd.loss import fused_linear_distill
    from opsd.trainer import forward_backward

    def loss_fn(sh, th, tw, mb, adv):
        return fused_linear_distill(
            sh, parallel.full_head_weight(model), th, tw, mb.weights, mb.targets, spec
        )

    forward_backward(model, teacher, mbs, loss_fn, timer=timer)
    with timer("optimizer"):
        parallel.clip_grad_norm([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _build(setup: str, shape: dict, dist, gradient_checkpointing: bool):
    """(student, teacher or None, optimizer) for one setup."""
    from opsd import parallel
    from opsd.models import apply_lora, enable_gradient_checkpointing
    from opsd.teacher import Teacher

    dev, bf16 = dist.device, torch.bfloat16
    if setup.startswith("lora"):
        model = _model(shape, dev, bf16)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model = apply_lora(
            model,
            r=64,
            alpha=128,
            dropout=0.0,
            target_modules=LORA_TARGETS,
            gradient_checkpointing=gradient_checkpointing,
        )
        teacher = Teacher("fixed", model, lora=True)  # the base model with the adapter off
        if setup == "lora fsdp":
            parallel.shard_model(model, dist.mesh, param_dtype=bf16)
    else:
        model = _model(shape, dev, torch.float32)
        teacher = copy.deepcopy(model).to(bf16).requires_grad_(False).eval()
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        parallel.shard_model(teacher, dist.mesh, param_dtype=bf16)
        parallel.shard_model(model, dist.mesh, param_dtype=bf16, reduce_dtype=torch.float32)
        model.train()
        teacher = Teacher("external", model, lora=False, external=teacher)  # a separate frozen network
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    return model, teacher, opt


def bench_steps(
    setup: str, shape: dict, lengths: dict, dist, steps: int, gradient_checkpointing: bool
) -> dict:
    from opsd.loss import DistillSpec
    from opsd.metrics import StepTimer

    dev = dist.device
    t0 = time.perf_counter()
    model, teacher, opt = _build(setup, shape, dist, gradient_checkpointing)
    mbs = _microbatches(8, 4, lengths, shape["vocab_size"], dev)
    spec = DistillSpec(mode="jsd", beta=0.0, clip_mode="entry", clip=0.05)
    build_s = time.perf_counter() - t0
    _step(model, teacher, opt, mbs, spec, StepTimer(sync=dev.type == "cuda"))  # warm-up (allocator, kernels)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    runs = []
    for _ in range(steps):
        timer = StepTimer(sync=dev.type == "cuda")
        start = time.perf_counter()
        _step(model, teacher, opt, mbs, spec, timer)
        runs.append({**timer.times, "step": time.perf_counter() - start})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peak = _gb(dev)
    del model, teacher, opt, mbs
    gc.collect()  # sharded models hold a reference cycle (their registered forward method)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "setup": setup,
        "build_s": build_s,
        "trainable": trainable,
        "peak_gb": peak,
        "tokens": 8 * lengths["response"],
        **{k: statistics.mean(r[k] for r in runs) for k in (*PHASES, "step")},
    }


def bench_loss(n_tokens: int, shape: dict, device: torch.device, reps: int) -> dict:
    """fused_linear_distill forward+backward alone: bf16 hidden states and heads, student head trainable."""
    from opsd.loss import DistillSpec, fused_linear_distill

    v, h = shape["vocab_size"], shape["hidden_size"]
    g = torch.Generator(device=device).manual_seed(0)
    hs = torch.randn(n_tokens, h, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    ht = torch.randn(n_tokens, h, device=device, dtype=torch.bfloat16, generator=g)
    ws = (0.02 * torch.randn(v, h, device=device, dtype=torch.bfloat16, generator=g)).requires_grad_(True)
    wt = 0.02 * torch.randn(v, h, device=device, dtype=torch.bfloat16, generator=g)
    weights = torch.full((n_tokens,), 1.0 / n_tokens, device=device)
    spec = DistillSpec(mode="jsd", beta=0.0, clip_mode="entry", clip=0.05)

    def once() -> None:
        loss, _ = fused_linear_distill(hs, ws, ht, wt, weights, None, spec)
        loss.backward()
        hs.grad = ws.grad = None

    once()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - start)
    extra = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
    return {"tokens": n_tokens, "s": statistics.mean(times), "extra_gb": extra}


def _fmt_gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def render(rows: list[dict], loss_rows: list[dict], env: str, notes: list[str]) -> str:
    out = [
        env,
        "",
        "| setup | trainable params | build s | step s | teacher fwd s | student fwd+bwd s | fused loss s | "
        "optimizer s | response tok/s | peak GPU GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['setup']} | {r['trainable'] / 1e6:.1f}M | {r['build_s']:.0f} | {r['step']:.2f} | "
            f"{r['teacher']:.2f} | {r['student']:.2f} | {r['loss']:.2f} | {r['optimizer']:.2f} | "
            f"{r['tokens'] / r['step']:.0f} | {_fmt_gb(r['peak_gb'])} |"
        )
    out += [
        "",
        "Fused loss alone (`fused_linear_distill`, forward KL + entry clip, forward+backward, "
        "student head trainable, bf16 inputs, fp32 chunks):",
        "",
        "| response tokens | s | tokens/s | extra GPU GB over inputs |",
        "|---:|---:|---:|---:|",
    ]
    for r in loss_rows:
        out.append(
            f"| {r['tokens']} | {r['s']:.3f} | {r['tokens'] / r['s']:.0f} | {_fmt_gb(r['extra_gb'])} |"
        )
    out += ["", *notes, "", "Reproduce: `python bench/gpu_step.py` (one CUDA GPU; no download)."]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny config on any device, to check the script (no write)"
    )
    ap.add_argument("--steps", type=int, default=2, help="measured steps per setup (after one warm-up)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        print(
            "bench/gpu_step.py needs a CUDA GPU (none visible); `--tiny` runs a tiny config on the CPU "
            "to check the script",
            file=sys.stderr,
        )
        return 0
    start = time.perf_counter()
    shape, lengths = (TINY, TINY_LENGTHS) if args.tiny else (QWEN3_1P7B, LENGTHS)
    dist = _setup_process_group("auto")
    try:
        rows, notes = [], []
        for setup in ("lora", "lora fsdp", "full fsdp"):
            if time.perf_counter() - start > BUDGET_S:
                notes.append(f"- skipped {setup}: the {BUDGET_S // 60}-minute budget was spent")
                continue
            rows.append(bench_steps(setup, shape, lengths, dist, args.steps, args.gradient_checkpointing))
            print(
                f"{setup}: step {rows[-1]['step']:.2f}s, peak {_fmt_gb(rows[-1]['peak_gb'])} GB",
                file=sys.stderr,
            )
        loss_rows = [
            bench_loss(n, shape, dist.device, reps=3) for n in ((256, 1024) if args.tiny else (4096, 16384))
        ]
    finally:
        from opsd.distributed import shutdown

        shutdown()
    env = (
        f"Model: {'a tiny' if args.tiny else 'a Qwen3-1.7B-shaped'} config with random weights "
        f"(V={shape['vocab_size']}, H={shape['hidden_size']}, {shape['num_hidden_layers']} layers, tied "
        f"head), sdpa attention, bf16 compute. Per step: 8 samples (prompt {lengths['prompt']}, teacher "
        f"prompt {lengths['teacher_prompt']}, response {lengths['response']} tokens) in 2 micro-batches of "
        "4; loss: forward KL with entry clip 0.05; gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}; mean of {args.steps} steps after 1 warm-up.\n\n"
        f"Machine: {_common.describe_machine()}; total wall time {time.perf_counter() - start:.0f} s."
    )
    notes.append(
        "- Phases are synchronized wall times; `fused loss` includes the analytic gradients (the loss "
        "computes them while walking the chunks), `student fwd+bwd` is the student's forward and the "
        "model's backward (plus FSDP's gradient reduction), `optimizer` is clipping + AdamW."
    )
    text = render(rows, loss_rows, env, notes)
    print(text)
    if not args.no_write and not args.tiny:
        write_section(args.out, HEADING, text)
        print(f"wrote the '{HEADING}' section of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
