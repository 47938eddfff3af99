"""The fused loss's logit products on this CPU: float32 products against bf16 ones, error and speed.

The loss's product rule on a CPU with bf16 units: bf16 inputs with a float32 output from one
product, against ``logits_bf16``'s two bf16 products, both against the float64 oracle. torch 2.13
has no CPU kernel for a bf16 product with a float32 output
(``torch.mm(..., out_dtype=torch.float32)``: "aten::mm.dtype" is CUDA-only; the script probes it
and says). Its values are what a float32 product of the same bf16 inputs computes (bf16 -> float32
is exact and both accumulate in float32), so that is the one-product row here, at float32 speed:

* ``float32``: ``matmul_dtype=None``; bf16 hidden states and head upcast, float32 products;
* ``bf16 x2``: ``matmul_dtype=torch.bfloat16`` (what ``opsd.precision.loss_matmul_dtype`` picks for
  a bf16 model on bf16 units): two bf16 products per logit block, one per gradient product;
* ``bf16 x1``: one bf16 product rounded to bf16, for scale only (not a rule opsd has): why two.

Work: forward + backward of ``fused_linear_distill`` with a frozen head (LoRA), the paper's loss
(forward KL, T=1.1, per-entry clip 0.05), bf16 inputs at SmolLM2-135M's and Qwen3-1.7B's head
shapes. Error: the loss's relative error and ``max|g - g64| / max|g64|`` of the hidden states'
gradient against float64 autograd through ``distill_loss_dense`` on the same bf16 values (the
student's hidden states are a float32 leaf holding bf16 values, so the kernel's gradient is read
before a bf16 model would round it to bf16, 2^-9). Time: the
median of 3 runs. Also the product rate of one logit block's product in float32 and bf16.

    python bench/cpu/loss_products.py --wait-idle          # writes docs/results.md
    python bench/cpu/loss_products.py --quick --no-write   # SmolLM2 shape only, 1 run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/: the shared bench modules

import _common  # noqa: E402
import torch  # noqa: E402
from _md import write_section  # noqa: E402

from opsd.loss import DistillSpec, distill_loss_dense, fused_linear_distill  # noqa: E402
from opsd.loss import fused as fused_module  # noqa: E402
from opsd.loss.fused import auto_chunk_size  # noqa: E402

SECTION = "Loss products on this CPU (bench/cpu/loss_products.py)"
SHAPES = {"SmolLM2-135M": (576, 49152, 1024), "Qwen3-1.7B": (2048, 151936, 256)}  # H, V, rows
SPEC = DistillSpec(beta=0.0, temperature=1.1, clip_mode="entry", clip=0.05)
# The clip is a step in the gradient: an entry within rounding of 0.05 is kept by one product and cut by
# another, an O(1) difference in that entry whatever the precision. The unclipped loss shows the products'.
NO_CLIP = DistillSpec(beta=0.0, temperature=1.1)
LOGIT_SCALE = 3.0  # logits of std ~3: peaked, LM-like distributions rather than near-uniform ones
VARIANTS = ("float32", "bf16 x2", "bf16 x1")


def inputs(h: int, v: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 student and teacher hidden states ``[n, h]`` (the teacher's a perturbed copy), head ``[v, h]``."""
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g)
    ht = hs + 0.3 * torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * (LOGIT_SCALE / h**0.5)
    return hs.bfloat16(), ht.bfloat16(), w.bfloat16()


def oracle(
    hs: torch.Tensor, ht: torch.Tensor, w: torch.Tensor, spec: DistillSpec
) -> tuple[float, torch.Tensor]:
    """float64 loss and hidden-state gradient on the same bf16 values."""
    h64 = hs.double().requires_grad_()
    w64 = w.double()
    loss = distill_loss_dense(h64 @ w64.t(), ht.double() @ w64.t(), spec=spec)
    loss.backward()
    return loss.item(), h64.grad


def _one_bf16_product(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits_bf16``'s ``(hi, lo)`` with the second product's correction left out (a zero ``lo``)."""
    hi = h @ w.t()
    return hi, torch.zeros_like(hi)


def run(
    variant: str, hs: torch.Tensor, ht: torch.Tensor, w: torch.Tensor, spec: DistillSpec
) -> tuple[float, float, torch.Tensor]:
    """One forward + backward: (seconds, loss, hidden-state gradient)."""
    mm = None if variant == "float32" else torch.bfloat16
    two = fused_module.logits_bf16
    if variant == "bf16 x1":
        fused_module.logits_bf16 = _one_bf16_product
    try:
        h = hs.float().requires_grad_()  # bf16 values; a float32 leaf, so its gradient is not rounded to bf16
        t0 = time.perf_counter()
        loss, _ = fused_linear_distill(h, w, ht, w, spec=spec, with_stats=False, matmul_dtype=mm)
        loss.backward()
        seconds = time.perf_counter() - t0
    finally:
        fused_module.logits_bf16 = two
    return seconds, loss.item(), h.grad


def _grad_error(grad: torch.Tensor, ref: torch.Tensor) -> float:
    return (grad.double() - ref).abs().max().item() / ref.abs().max().item()


def probe_out_dtype() -> str:
    """Whether this torch multiplies bf16 into a float32 output on the CPU in one product."""
    a = torch.ones(2, 2, dtype=torch.bfloat16)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        first = str(e).splitlines()[0][:70]
        return f"no: `torch.mm(bf16, bf16, out_dtype=torch.float32)` on the CPU raises ({first}...)"
    return "yes: `torch.mm(..., out_dtype=torch.float32)` runs on the CPU (not used by this script)"


def measure(shape: str, repeats: int) -> list[dict]:
    h, v, n = SHAPES[shape]
    hs, ht, w = inputs(h, v, n)
    ref_loss, ref_grad = oracle(hs, ht, w, SPEC)
    ref_loss0, ref_grad0 = oracle(hs, ht, w, NO_CLIP)
    rows = []
    for variant in VARIANTS:
        times = []
        for _ in range(repeats):
            seconds, loss, grad = run(variant, hs, ht, w, SPEC)
            times.append(seconds)
        err_grad = _grad_error(grad, ref_grad)
        _, loss0, grad0 = run(variant, hs, ht, w, NO_CLIP)
        rows.append(
            dict(
                shape=shape,
                n=n,
                variant=variant,
                time_s=statistics.median(times),
                times=times,
                loss_err=abs(loss - ref_loss) / abs(ref_loss),
                grad_err=err_grad,
                loss_err0=abs(loss0 - ref_loss0) / abs(ref_loss0),
                grad_err0=_grad_error(grad0, ref_grad0),
            )
        )
        r = rows[-1]
        print(
            f"{shape} N={n} {variant}: {r['time_s']:.3f} s (runs {', '.join(f'{t:.3f}' for t in times)}), "
            f"clipped: loss error {r['loss_err']:.1e}, gradient error {err_grad:.1e}; unclipped: "
            f"{r['loss_err0']:.1e}, {r['grad_err0']:.1e}",
            flush=True,
        )
    return rows


def render(rows: list[dict], rates: dict, probe: str, before: str, after: str, machine: str) -> str:
    lines = [
        f"Machine: {machine}. Load average (1/5/15 min) before {before}, after {after}.",
        "",
        f"`python bench/cpu/loss_products.py`: forward + backward of `fused_linear_distill` on bf16 inputs, "
        f"frozen head (LoRA), forward KL, T={SPEC.temperature}, per-entry clip {SPEC.clip}; error against "
        "float64 autograd on the same bf16 values; time the median of the runs shown. `float32`: the "
        "inputs upcast, float32 products (the values one bf16-in/float32-out product gives); `bf16 x2`: "
        "`matmul_dtype=torch.bfloat16`, two bf16 products per logit block (`logits_bf16`); `bf16 x1`: one "
        "bf16 product rounded to bf16, for scale only. The unclipped columns take the same loss without "
        "the clip, whose step makes a few entries differ by O(1) at any precision. A bf16 product with a "
        f"float32 output in one call on the CPU: {probe}.",
        "",
        "| shape (H, V) | rows | products | fwd+bwd (s) | runs (s) | loss rel. error | gradient error "
        "| unclipped: loss rel. error | unclipped: gradient error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, v, _ = SHAPES[r["shape"]]
        runs = ", ".join(f"{t:.3f}" for t in r["times"])
        lines.append(
            f"| {r['shape']} ({h}, {v}) | {r['n']} | {r['variant']} | {r['time_s']:.3f} | {runs} | "
            f"{r['loss_err']:.1e} | {r['grad_err']:.1e} | {r['loss_err0']:.1e} | {r['grad_err0']:.1e} |"
        )
    lines.append("")
    for shape, (f32, b16) in rates.items():
        h, v, _ = SHAPES[shape]
        rows_ = auto_chunk_size(v)
        lines.append(
            f"- {shape}: one logit block's product [{rows_}, {h}] x [{h}, {v}]: float32 {f32:.0f} GFLOP/s, "
            f"bf16 {b16:.0f} GFLOP/s ({b16 / f32:.1f}x)."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shape only, 1 run each")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--wait-idle", action="store_true", help="wait for a 1-minute load below 0.5 first")
    ap.add_argument("--out", type=Path, default=_common.ROOT / "docs" / "results.md")
    args = ap.parse_args()
    if args.wait_idle:
        _common.wait_for_idle()
    load_before = _common.load_avg()
    before = _common.load_avgs(2)
    print(f"load average before: {before}", flush=True)
    shapes = ["SmolLM2-135M"] if args.quick else list(SHAPES)
    repeats = 1 if args.quick else 3
    rows = []
    rates = {}
    for shape in shapes:
        h, v, _ = SHAPES[shape]
        rows_ = auto_chunk_size(v)
        # One logit block's product [rows, h] x [h, v] in each dtype.
        rates[shape] = tuple(
            _common.matmul_rate(dt, m=rows_, k=h, n=v, reps=5) for dt in (torch.float32, torch.bfloat16)
        )
        print(f"{shape} product rate: float32 {rates[shape][0]:.0f}, bf16 {rates[shape][1]:.0f} GFLOP/s")
        rows += measure(shape, repeats)
    after = _common.load_avgs(2)
    print(f"load average after: {after}", flush=True)
    probe = probe_out_dtype()
    print(f"one bf16 product with a float32 output on the CPU: {probe}")
    if args.no_write or args.quick:
        return
    if load_before >= 0.5:
        print("started under load (1-minute load >= 0.5): not written", file=sys.stderr)
        sys.exit(1)
    text = render(rows, rates, probe, before, after, _common.describe_machine())
    write_section(args.out, SECTION, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
