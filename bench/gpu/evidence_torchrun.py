"""Check 3 of the GPU evidence run (bench/gpu/evidence.py): torchrun, FSDP2 on NCCL, the bf16
mixed-precision policy."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from evidence_shared import SETUPS, SKIP, Report, device_for, stream, tiny_assets, tiny_overrides


def _torchrun(config: Path, nproc: int = 1, timeout: float | None = None) -> tuple[int, list[str]]:
    """``torchrun --standalone --nproc-per-node N -m opsd train --config CONFIG``, its output streamed
    (``torchrun`` as this very Python's ``-m torch.distributed.run``: one on the PATH may be another's)."""
    from opsd.distributed import torchrun_command

    return stream(torchrun_command(nproc, "-m", "opsd", "train", "--config", str(config)), timeout)


def check_torchrun(tiny: bool, out: Path | None) -> int:
    """`torchrun -m opsd train` on one rank: FSDP2 (NCCL on a GPU, gloo with --tiny) with model.dtype
    bfloat16, full fine-tuning (float32 masters, bf16 gathered weights, float32 gradient reduction)
    and then LoRA (bf16 base, float32 adapters); 2 steps each and the final checkpoint. Each launch is a
    process group of its own under its own timeout (none with --tiny: the check's own bounds it)."""
    rep = Report("torchrun", out)
    device = device_for(tiny)
    if device is None:
        print("no CUDA device: check 3 needs one (--tiny runs it on the CPU with gloo)")
        return SKIP
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = tiny_assets(root)
        for setup, budget in zip(SETUPS, (28, 26)):
            try:
                ok &= _torchrun_setup(setup, root, assets, device, None if tiny else budget, rep)
            except Exception as err:  # noqa: BLE001 - the guard: this setup's figures are lost, not the next's
                rep.failed(setup, err)
                ok = False
    return rep.finish(ok)


def _yaml_config(overrides: list[str], path: Path) -> Path:
    """``key.sub=value`` overrides as a YAML config file (what `opsd train --config` reads)."""
    import yaml

    tree: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(tree))
    return path


def _torchrun_setup(
    setup: str, root: Path, assets: dict, device: str, budget: float | None, rep: Report
) -> bool:
    run_dir = root / f"torchrun-{setup}"
    over = tiny_overrides(
        assets,
        run_dir,
        device,
        **{"model.lora.enabled": str(setup == "lora").lower(), "model.dtype": "bfloat16"},
        **{"optim.max_steps": 2, "checkpoint.every": 0, "teacher.frozen_copy": "device"},
    )
    config = _yaml_config(over, root / f"{setup}.yaml")
    t0 = time.perf_counter()
    code, lines = _torchrun(config, timeout=budget)
    seconds = time.perf_counter() - t0
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    precision = next((x.split("precision:", 1)[1].strip() for x in lines if "precision:" in x), "?")
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if code == 0 else []
    finite = bool(recs) and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    passed = code == 0 and [r["step"] for r in recs] == [1, 2] and finite and bool(saved)
    rep.add(
        setup,
        exit=code,
        precision=precision,
        losses=[r["loss"] for r in recs],
        grad_norms=[r["grad_norm"] for r in recs],
        checkpoints=saved,
        seconds=seconds,
        passed=passed,
    )
    rep.figure(**{f"{setup}_exit": code, f"{setup}_steps": len(recs), f"{setup}_s": round(seconds, 1)})
    return passed
