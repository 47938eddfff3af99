"""Forward+backward of the distillation loss: opsd's chunked loss vs naive dense vs Liger.

Each (shape, N, implementation) runs in a fresh subprocess so that peak memory is its own:
on CPU the peak resident set size above the RSS just after the inputs exist; on CUDA
``max_memory_allocated`` above the inputs. The student weight requires grad (full fine-tuning,
the harder case), beta=0.5, T=1.0, fp32 inputs. Writes a table into docs/results.md.

    python bench/loss.py                 # all shapes
    python bench/loss.py --quick         # SmolLM2 shape, N=256 and 1024 (the README's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import _common
import torch
from _md import write_section

from opsd.procs import run_owned

SHAPES = {"SmolLM2-135M": (576, 49152), "Qwen3-1.7B": (2048, 151936)}
NS = (256, 1024, 4096)
IMPLS = ("opsd-chunked", "naive", "liger")
BETA = 0.5


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _inputs(n: int, h: int, v: int, device: str, dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(0)
    hs = torch.randn(n, h, generator=g).to(device, dtype)
    ht = (hs.float().cpu() + 0.3 * torch.randn(n, h, generator=g)).to(device, dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    return hs, ht, w, y


def _run_once(impl: str, hs, ht, w, y) -> float:
    from opsd.loss import DistillSpec, distill_loss_dense, fused_linear_distill

    hs = hs.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if impl == "opsd-chunked":
        loss, _ = fused_linear_distill(hs, w, ht, w, spec=DistillSpec(beta=BETA), with_stats=False)
    elif impl == "naive":
        loss = distill_loss_dense(hs @ w.t(), ht @ w.t().detach(), spec=DistillSpec(beta=BETA))
    else:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA, compiled=False)
        loss = fn(hs, w, ht, w.detach(), y)
    loss.backward()
    return float(loss)


def child(impl: str, h: int, v: int, n: int, device: str, reps: int) -> dict:
    """Time and measure one configuration; runs inside its own process."""
    import opsd.loss  # noqa: F401  (imports count as baseline, not as the loss's memory)

    if impl == "liger":
        import liger_kernel.chunked_loss  # noqa: F401
    torch.manual_seed(0)
    hs, ht, w, y = _inputs(n, h, v, device)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        loss = _run_once(impl, hs, ht, w, y)
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    best = min(times[1:]) if len(times) > 1 else times[0]
    return {"impl": impl, "h": h, "v": v, "n": n, "time_s": best, "peak_mb": peak / 2**20, "loss": loss}


def bf16_accuracy(device: str) -> tuple[float, float]:
    """Relative error of the chunked loss on bf16 inputs vs float64 on the same (bf16) values:
    with float32 matrix products (the default) and with ``matmul_dtype=torch.bfloat16``."""
    from opsd.loss import DistillSpec, distill_loss_dense, fused_linear_distill

    spec = DistillSpec(beta=BETA)
    hs, ht, w, _ = _inputs(512, 576, 49152, device, torch.bfloat16)
    ref = distill_loss_dense(hs.double() @ w.double().t(), ht.double() @ w.double().t(), spec=spec).item()
    errs = []
    for mm in (None, torch.bfloat16):
        got, _ = fused_linear_distill(hs, w, ht, w, spec=spec, with_stats=False, matmul_dtype=mm)
        errs.append(abs(got.item() - ref) / abs(ref))
    return errs[0], errs[1]


def _naive_fits(n: int, v: int, device: str) -> bool:
    need = 10 * n * v * 4  # logits, log-probs, probs, mixtures, grads: about ten [N, V] fp32 buffers
    if device == "cuda":
        return need < 0.8 * torch.cuda.get_device_properties(0).total_memory
    import psutil

    return need < 0.6 * psutil.virtual_memory().available


def _have_liger() -> bool:
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception:
        return False
    return True


def machine(device: str) -> str:
    if device != "cpu":
        return _common.describe_machine()
    return (
        f"{_common.describe_machine()}, load average at the end {_common.load_avgs()} "
        f"(above {os.cpu_count()} means other jobs shared the cores)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--quick", action="store_true", help="SmolLM2 shape, N=256 and 1024 only; no file written"
    )
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--ns", nargs="*", type=int, default=list(NS))
    ap.add_argument("--out", default=str(_common.ROOT / "docs" / "results.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    print(f"load average (1 min) before: {_common.load_avg():.2f}", flush=True)
    shapes, ns = (["SmolLM2-135M"], [256, 1024]) if args.quick else (args.shapes, args.ns)
    impls = [i for i in IMPLS if i != "liger" or _have_liger()]
    rows = []
    for shape in shapes:
        h, v = SHAPES[shape]
        for n in ns:
            for impl in impls:
                if impl == "naive" and not _naive_fits(n, v, args.device):
                    rows.append({"impl": impl, "h": h, "v": v, "n": n, "skipped": "does not fit in memory"})
                    print(f"{shape} N={n} {impl}: skipped (memory)", flush=True)
                    continue
                reps = 3 if n * v < 6e7 else 1  # big shapes: one run (seconds to minutes each)
                r = _spawn(dict(impl=impl, h=h, v=v, n=n, device=args.device, reps=reps))
                if r is not None and args.device == "cpu":
                    # Memory in its own run with glibc's mmap threshold pinned: freed blocks go back
                    # to the OS, so peak RSS is the live high-water mark, not allocator caching.
                    m = _spawn(
                        dict(impl=impl, h=h, v=v, n=n, device=args.device, reps=1),
                        env={"MALLOC_MMAP_THRESHOLD_": "131072"},
                    )
                    r = {**r, "peak_mb": m["peak_mb"]} if m is not None else None
                if r is None:
                    rows.append({"impl": impl, "h": h, "v": v, "n": n, "skipped": "failed (see console)"})
                    continue
                r["shape"] = shape
                rows.append(r)
                print(
                    f"{shape} N={n} {impl}: {r['time_s']:.3f}s peak {r['peak_mb']:.0f} MB loss "
                    f"{r['loss']:.6f}",
                    flush=True,
                )
    err = bf16_accuracy(args.device)
    print(
        f"bf16 inputs vs the float64 oracle: relative loss error {err[0]:.2e} (float32 products), "
        f"{err[1]:.2e} (matmul_dtype=bfloat16)"
    )
    print(f"load average (1 min) after: {_common.load_avg():.2f}", flush=True)
    if args.quick:
        return
    write_section(Path(args.out), f"Loss ({args.device}, bench/loss.py)", render(rows, err, args.device))
    print(f"wrote {args.out}")


def _spawn(spec: dict, env: dict | None = None) -> dict | None:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    out = run_owned(cmd, capture=True, env={**os.environ, **(env or {})})  # ends with this script
    if out.status != 0:
        print(f"{spec}: FAILED {out.stderr[-500:]}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(rows: list[dict], bf16_err: tuple[float, float], device: str) -> str:
    by = {(r["v"], r["n"], r["impl"]): r for r in rows}
    lines = [
        f"Machine: {machine(device)}.",
        "",
        f"Forward + backward, fp32 inputs, beta={BETA}, T=1, student weight requires grad. Peak memory is "
        "above the inputs (CPU: peak RSS in a separate run with `MALLOC_MMAP_THRESHOLD_=131072`, so that "
        "freed blocks return to the OS and the figure is the live high-water mark rather than glibc's "
        "cache; CUDA: max allocated). Liger runs `LigerFusedLinearJSDLoss` with `compiled=False`, "
        "`weight_hard_loss=0`.",
        "",
        "| shape (H, V) | N | impl | time (s) | peak mem (MB) | speed-up vs naive |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = next(k for k, (h, v) in SHAPES.items() if v == r["v"])
        if "skipped" in r:
            lines.append(f"| {name} ({r['h']}, {r['v']}) | {r['n']} | {r['impl']} | - | - | {r['skipped']} |")
            continue
        naive = by.get((r["v"], r["n"], "naive"))
        speed = f"{naive['time_s'] / r['time_s']:.2f}x" if naive and "time_s" in naive else "-"
        lines.append(
            f"| {name} ({r['h']}, {r['v']}) | {r['n']} | {r['impl']} | {r['time_s']:.3f} | "
            f"{r['peak_mb']:.0f} | {speed} |"
        )
    lines += ["", "Targets:", ""]
    for name, (_h, v) in SHAPES.items():
        a, b = by.get((v, 256, "opsd-chunked")), by.get((v, 4096, "opsd-chunked"))
        if a and b and "peak_mb" in a and "peak_mb" in b:
            growth = b["peak_mb"] / a["peak_mb"]
            lines.append(f"- {name}: chunked peak at N=4096 / N=256 = {growth:.2f}x (target <= 1.2x)")
        c, nv = by.get((v, 1024, "opsd-chunked")), by.get((v, 1024, "naive"))
        if c and nv and "time_s" in nv:
            lines.append(
                f"- {name}: N=1024 speed-up over naive {nv['time_s'] / c['time_s']:.2f}x (target >= 2x)"
            )
        lg = by.get((v, 1024, "liger"))
        if c and lg and "time_s" in lg:
            lines.append(
                f"- {name}: N=1024 Liger time / opsd time = {lg['time_s'] / c['time_s']:.2f}x (target >= 1x)"
            )
    lines.append(
        f"- bf16 inputs: relative loss error vs the float64 oracle on the same values = {bf16_err[0]:.1e} "
        "(target <= 1e-4)"
    )
    lines.append(f"- bf16 inputs with `matmul_dtype=torch.bfloat16`: {bf16_err[1]:.1e} (target <= 1e-3)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
