"""What every check of the GPU evidence run (bench/gpu/evidence.py) shares: its report, its device,
the tiny model and data of checks 2 and 3, and running a command with its output streamed."""

from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SKIP = 77  # the exit status evidence.sh reads as "skipped"
SETUPS = ("full", "lora")  # full fine-tuning first: a LoRA failure must not cost its figures


class Report:
    """What a check measured: printed, and appended to ``evidence.jsonl`` line by line."""

    def __init__(self, check: str, out: Path | None) -> None:
        self.check, self.path, self.figures = check, (out / "evidence.jsonl" if out else None), {}

    def add(self, what: str, **values) -> None:
        rec = {"check": self.check, "what": what, **values}
        line = json.dumps(rec, default=str)
        print(f"EVIDENCE {line}", flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")

    def figure(self, **values) -> None:
        self.figures.update(values)

    def failed(self, what: str, err: BaseException) -> None:
        """A guarded setup that raised: its traceback printed, one record of it, the check goes on."""
        import traceback

        traceback.print_exception(err)
        self.add(what, error=f"{type(err).__name__}: {err}"[:500], passed=False)
        self.figure(**{f"{what}_error": type(err).__name__})

    def finish(self, ok: bool) -> int:
        def fmt(v) -> str:
            return f"{v:.4g}" if isinstance(v, float) else str(v)

        print("FIGURES " + " ".join(f"{k}={fmt(v)}" for k, v in self.figures.items()), flush=True)
        return 0 if ok else 1


def device_for(tiny: bool) -> str | None:
    """cpu for --tiny, cuda otherwise; None where there is no CUDA to run on."""
    if tiny:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def left_after() -> float:
    """The accelerator memory still allocated (MiB) once the caller has closed its Trainer and dropped
    every reference to it and to what its steps returned: what a Trainer leaves behind."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**20


def tiny_assets(root: Path, rows: int = 8) -> dict:
    """The tiny BPE tokenizer and a 2-layer model (opsd.tiny), and addition problems with solutions."""
    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = [
        {
            "problem": f"What is {a} + {b}?",
            "solution": f"{a} + {b} = {a + b}. The answer is {a + b}.",
            "answer": a + b,
        }
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2), (4, 5), (6, 1)][:rows]
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return {"model": str(root / "model"), "data": str(root / "train.jsonl")}


def tiny_overrides(assets: dict, run_dir: Path, device: str, **over) -> list[str]:
    base = {
        "device": device,
        "model.path": assets["model"],
        "data.path": assets["data"],
        "logging.run_dir": str(run_dir),
        "model.lora.r": 4,
        "model.lora.alpha": 8,
        "rollout.engine": "hf",  # there is no vLLM on the GPU machine; auto would pick it where it is
        "rollout.prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 8,
        "rollout.temperature": 1.0,
        "optim.lr": 0.01,  # large: the weights move visibly in a few steps
        "loss.clip_mode": "none",
        "data.max_prompt_len": 256,
        "logging.progress": "false",
        "logging.sample_every": 0,
        "logging.step_lines": "false",
    }
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


def stream(cmd: list[str], timeout: float | None = None) -> tuple[int, list[str]]:
    """Run ``cmd`` from the repository root with its output streamed as it comes and kept; past
    ``timeout`` seconds its whole process group is killed and the exit status is 124 (as `timeout`'s)."""
    import signal
    import threading

    print("$ " + " ".join(cmd), flush=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill) if timeout else None
    if timer is not None:
        timer.start()
    lines = []
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
        code = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if expired.is_set():
        print(f"== cut off after {timeout:.0f} s", flush=True)
        return 124, lines
    return code, lines
