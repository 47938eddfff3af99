"""Check 5 of the GPU evidence run (bench/gpu/evidence.py): the loss alone, dense against chunked
(bench/loss.py)."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from evidence_shared import ROOT, SKIP, Report, device_for, stream

LOSS_LINE = re.compile(r"^(\S+) N=(\d+) (\S+): ([0-9.]+)s peak (-?[0-9.]+) MB loss (\S+)")


def check_loss(tiny: bool, out: Path | None) -> int:
    """``bench/loss.py``'s dense-versus-chunked comparison (forward and backward of the distillation loss
    from hidden states and the head) at Qwen3-1.7B's head on CUDA, N = 1024 and 4096 rows (--tiny:
    SmolLM2's head, 256 rows, on the CPU); its rows as measurements, chunked / dense time and peak."""
    rep = Report("loss", out)
    device = device_for(tiny)
    if device is None:
        print("no CUDA device: check 5 needs one (--tiny runs it on the CPU)")
        return SKIP
    shape, ns = ("SmolLM2-135M", ["256"]) if tiny else ("Qwen3-1.7B", ["1024", "4096"])
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "bench" / "loss.py"), "--device", device, "--shapes", shape]
        code, lines = stream([*cmd, "--ns", *ns, "--out", str(Path(tmp) / "loss.md")])
    rows: dict[tuple[int, str], dict] = {}
    for line in lines:
        m = LOSS_LINE.match(line)
        if m:
            row = {"n": int(m[2]), "impl": m[3], "time_s": float(m[4]), "peak_mb": float(m[5]), "loss": m[6]}
            rows[(row["n"], row["impl"])] = row
            rep.add("row", shape=m[1], **row)
    ok = code == 0
    for n in map(int, ns):
        chunked, dense = rows.get((n, "opsd-chunked")), rows.get((n, "naive"))
        ok &= chunked is not None
        if chunked and dense:
            rep.figure(**{f"n{n}_time_ratio": round(chunked["time_s"] / dense["time_s"], 3)})
            rep.figure(
                **{f"n{n}_chunked_mb": round(chunked["peak_mb"]), f"n{n}_dense_mb": round(dense["peak_mb"])}
            )
        elif chunked:
            rep.figure(**{f"n{n}_chunked_mb": round(chunked["peak_mb"]), f"n{n}_dense": "skipped"})
    return rep.finish(ok)
