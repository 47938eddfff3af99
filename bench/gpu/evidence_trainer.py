"""Check 2 of the GPU evidence run (bench/gpu/evidence.py): the Trainer on one device; a checkpoint
and an exact resume."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from evidence_shared import SETUPS, SKIP, Report, device_for, left_after, tiny_assets, tiny_overrides

# The resume check's floor: nondeterministic kernels (SDPA's backward on CUDA) can leave a resumed run
# this far from a straight one even where a second straight run happened to match the first exactly.
RESUME_FLOOR = {"record": 1e-4, "weights": 1e-5}
RECORD_KEYS = ("loss", "grad_norm", "divergence", "entropy_student", "entropy_teacher", "agreement")


def _trained(trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().float().cpu().clone()
        for n, p in trainer.run.model.named_parameters()
        if p.requires_grad
    }


def _run(
    overrides: list[str], *, until: int | None = None, resume: bool = False
) -> tuple[list[dict], dict, float]:
    from opsd import Trainer, load_config

    trainer = Trainer(load_config(None, overrides), resume=resume)
    history = trainer.train(until_step=until)
    weights = _trained(trainer)
    trainer.close()
    del trainer
    return history, weights, left_after()


def _differences(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> dict[str, float]:
    """The largest differences between two runs' last step records and their trained weights."""
    (ha, wa), (hb, wb) = a, b
    rec = max(abs(ha[-1][k] - hb[-1][k]) for k in RECORD_KEYS)
    weights = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
    return {"record": rec, "weights": weights}


def resume_passes(diff: dict[str, float], noise: dict[str, float] | None) -> bool:
    """A resume that is not bit-exact passes where it is no further from the straight run than 10 times
    a second straight run is (nondeterministic kernels), or than :data:`RESUME_FLOOR`."""
    if noise is None:
        return all(diff[k] == 0.0 for k in diff)
    return all(diff[k] <= max(10 * noise[k], RESUME_FLOOR[k]) for k in diff)


def check_trainer(tiny: bool, out: Path | None) -> int:
    """Full fine-tuning, then LoRA, on one device: 4 steps straight against 2 steps, a checkpoint and a
    resumed process for the last 2; the last step's record and the trained weights must be equal bit
    for bit. Where they are not, a second straight run tells run-to-run noise (nondeterministic
    kernels) from a resume defect (:func:`resume_passes`). Each setup in its own guard."""
    rep = Report("trainer", out)
    device = device_for(tiny)
    if device is None:
        print("no CUDA device: check 2 needs one (--tiny runs it on the CPU)")
        return SKIP
    torch.use_deterministic_algorithms(True, warn_only=True)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = tiny_assets(root)
        for setup in SETUPS:
            try:
                ok &= _trainer_setup(setup, root, assets, device, rep)
            except Exception as err:  # noqa: BLE001 - the guard: this setup's figures are lost, not the next's
                rep.failed(setup, err)
                ok = False
                left_after()
    return rep.finish(ok)


def _trainer_setup(setup: str, root: Path, assets: dict, device: str, rep: Report) -> bool:
    t0 = time.perf_counter()
    over = {"model.lora.enabled": str(setup == "lora").lower(), "model.dtype": "float32"}
    over |= {"optim.max_steps": 4, "checkpoint.every": 2, "checkpoint.keep_last": 2}

    def cfg(name: str) -> list[str]:
        return tiny_overrides(assets, root / f"{setup}-{name}", device, **over)

    straight, w_straight, left = _run(cfg("straight"))
    first, _, _ = _run(cfg("resumed"), until=2)
    ckpt = root / f"{setup}-resumed" / "checkpoints"
    ckpt_mib = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**20
    resumed, w_resumed, _ = _run(cfg("resumed"), resume=True)
    diff = _differences((straight, w_straight), (resumed, w_resumed))
    exact = diff["record"] == 0.0 and diff["weights"] == 0.0
    noise = None
    if not exact:
        again, w_again, _ = _run(cfg("again"))
        noise = _differences((straight, w_straight), (again, w_again))
    steps = [r["step"] for r in first] + [r["step"] for r in resumed]
    passed = steps == [1, 2, 3, 4] and resume_passes(diff, noise)
    moved = max(float(w.abs().max()) for w in w_straight.values()) > 0
    passed = passed and moved and all(torch.isfinite(torch.tensor(r["loss"])) for r in straight)
    rep.add(
        setup,
        steps=steps,
        last=straight[-1],
        resume_exact=exact,
        resume_diff=diff,
        rerun_diff=noise,
        checkpoint_mib=ckpt_mib,
        left_after_mib=left,
        seconds=time.perf_counter() - t0,
        passed=passed,
    )
    rep.figure(**{f"{setup}_exact": exact, f"{setup}_diff": max(diff.values())})
    rep.figure(**{f"{setup}_left_mib": round(left, 1), f"{setup}_ckpt_mib": round(ckpt_mib, 2)})
    return passed
