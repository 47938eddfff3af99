"""The Python checks of the GPU evidence run; ``bench/gpu/evidence.sh`` runs each under its own timeout.

    python bench/gpu/evidence.py trainer  [--tiny] [--out DIR]   # check 2: the Trainer, checkpoint, resume
    python bench/gpu/evidence.py torchrun [--tiny] [--out DIR]   # check 3: torchrun, FSDP2, bf16 policy
    python bench/gpu/evidence.py qwen3    [--tiny] [--out DIR]   # check 4: Qwen3-1.7B's shape, by phase,
                                                                  #   and the plain PyTorch baseline
    python bench/gpu/evidence.py loss     [--tiny] [--out DIR]   # check 5: bench/loss.py, dense vs chunked

Only public entry points: :class:`opsd.Config` through :func:`opsd.load_config`, :class:`opsd.Trainer`
(``train``, ``step``, ``record``, ``close``) and ``python -m opsd train``. Everything is built offline:
random weights, a tokenizer made here, a few rows of synthetic problems in a temporary directory.

Each check prints what it measures as it goes, appends one JSON object per measurement to
``DIR/evidence.jsonl`` (written at once, so a run cut short keeps what it measured), prints
``FIGURES key=value ...`` as its last line (``evidence.sh`` copies it into ``summary.tsv``) and exits
0 when what it checks holds, 1 when not, 77 when it cannot run here (no CUDA without ``--tiny``).
``--tiny``: the same code on the CPU at a tiny shape, so that the suite can run it
(``tests/train/test_gpu_evidence.py``).

Full fine-tuning runs before LoRA in every check, and each setup in a guard of its own (check 2: an
exception is caught and recorded; checks 3 and 4: a process of its own, under its own timeout), so that
one setup's failure costs its own figures only.

Check 4's arithmetic (``flops.py`` has it in full, and ``tests/train/test_gpu_flops.py`` checks it by hand):

    FLOPs = 6 N_body T_s + 2 N_body T_t + 8 V H R + attention     (full fine-tuning)
    FLOPs = 4 N_body T_s + 6 N_lora T_s + 2 N_body T_t + 6 V H R + attention     (LoRA)

N_body the decoder's matrices (1.41e9 at Qwen3-1.7B: no embedding, no head), N_lora the adapters
(6.97e7 at r=64 on every linear layer), T_s and T_t the student's and teacher's real tokens, R the
response tokens (the only rows the fused loss sends through the 151936 x 2048 head), attention causal:
2 d L (L + 1) per layer and sequence forward, 3x that for the student. MFU is quoted twice over: over
the teacher and student passes (the teacher, student and loss phases: what the FLOPs count) and over
the whole step (rollout and optimizer included), each against the datasheet's dense bf16 peak (989e12
FLOP/s) and against an 8192^3 bf16 matrix product measured on the spot.

The baseline (check 4, full fine-tuning): on the same model and on the very batches opsd trained on, a
plain PyTorch step: the student under bf16 autocast over float32 weights, a bf16 copy as the teacher,
full logits, KL(teacher || student) on the response positions with opsd's token weights, fused AdamW
(on CUDA). opsd runs that objective too (loss.beta 0, no clipping, temperature 1), so its first step's
loss and the baseline's on the same batch at the same initial weights must agree; the summary gives
opsd's time over the baseline's on the same batches, and both peaks.

The checks live beside this file, one module a phase: ``evidence_trainer.py`` (2),
``evidence_torchrun.py`` (3), ``evidence_qwen3.py`` (4), ``evidence_loss.py`` (5), and what they share
in ``evidence_shared.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(1, _p)
# Deterministic cuBLAS for check 2's bit-for-bit comparisons; read when CUDA starts, so set before torch.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from evidence_loss import check_loss  # noqa: E402
from evidence_qwen3 import check_qwen3, qwen3_baseline, qwen3_setup  # noqa: E402
from evidence_shared import SETUPS, SKIP  # noqa: E402
from evidence_torchrun import check_torchrun  # noqa: E402
from evidence_trainer import check_trainer, resume_passes  # noqa: E402

__all__ = ["CHECKS", "SKIP", "main", "resume_passes"]

CHECKS = {"trainer": check_trainer, "torchrun": check_torchrun, "qwen3": check_qwen3, "loss": check_loss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=sorted([*CHECKS, "qwen3-setup", "qwen3-baseline"]))
    ap.add_argument("--tiny", action="store_true", help="on the CPU at a tiny shape (checks the script)")
    ap.add_argument("--out", type=Path, default=None, help="where evidence.jsonl is appended to")
    ap.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)
    ap.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.check == "qwen3-setup":
        return qwen3_setup(args.setup, args.assets, args.tiny, args.out, args.peak)
    if args.check == "qwen3-baseline":
        return qwen3_baseline(args.assets, args.tiny, args.out, args.peak)
    return CHECKS[args.check](args.tiny, args.out)


if __name__ == "__main__":
    sys.exit(main())
