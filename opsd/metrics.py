"""Metric sinks: metrics.jsonl always; TensorBoard and Weights & Biases only when asked for."""

from __future__ import annotations

import json
import resource
import time
from contextlib import contextmanager
from pathlib import Path

import torch


class StepTimer:
    """Accumulates wall time per phase of a step (rollout, teacher, student, loss, optim)."""

    def __init__(self, sync: bool = False) -> None:
        self.times: dict[str, float] = {}
        self.sync = sync

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsWriter:
    def __init__(self, run_dir: Path, *, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "opsd", config: dict | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("logging.tensorboard=true needs `pip install 'opsd[tensorboard]'`") from e
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb:
            try:
                import wandb as wb
            except ImportError as e:
                raise ImportError("logging.wandb=true needs `pip install 'opsd[wandb]'`") from e
            self._wandb = wb.init(project=wandb_project, dir=str(run_dir), config=config, resume="allow")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
