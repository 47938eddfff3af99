"""The step's metrics record and its sinks: metrics.jsonl always; TensorBoard and W&B when asked for.

Metric names are constants here; ``opsd report`` imports them, so a metric the trainer writes
cannot silently go missing from the plots.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Hashable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from opsd.devices import peak_memory_gb, reset_peak_memory, synchronizes
from opsd.distributed import all_reduce_sum
from opsd.loss import LossStats

# Phases of a step, in order; each is timed into "time_<phase>" (seconds).
PHASES = ("rollout", "teacher", "student", "loss", "optim")
TIME_KEYS = tuple(f"time_{p}" for p in PHASES)
# Loss statistics (opsd.loss.LossStats.means()).
LOSS_STAT_KEYS = (
    "divergence",
    "clip_frac",
    "entropy_student",
    "entropy_teacher",
    "agreement",
    "overlap_mass",
)
LENGTH_KEYS = ("resp_len_mean", "resp_len_max", "truncated_frac")
# "repetition": the share of repeated n-grams of this length in a response (:func:`repetition`),
# averaged over the step's responses that have at least one.
REPETITION_N = 4
# Every key of a training step's record, in the order it is written.
STEP_KEYS = (
    "step",
    "loss",
    *LOSS_STAT_KEYS,
    "grad_norm",
    "lr",
    *LENGTH_KEYS,
    "repetition",
    "tokens",
    "tokens_per_s",
    "real_token_frac_teacher",
    "real_token_frac_student",
    "skipped_nonfinite",
    "prompt_truncated_student",
    "prompt_truncated_teacher",
    "epoch",
    *TIME_KEYS,
    "time_step",
    "peak_mem_gb",
)
# Written only when measured: the rollout/trainer log-prob gap (rollout.logprob_check), GRPO's reward,
# the rollouts' policy lag (rollout.overlap), RLSD's teacher share and token weights (objective=rlsd),
# and with rollout.reuse the response tokens generated at the step (0 where it reused) and whether it did.
RLSD_KEYS = ("rlsd_lambda", "rlsd_weight_mean", "rlsd_weight_clip_frac")
REUSE_KEYS = ("rollout/generated_tokens", "rollout/reused")
OPTIONAL_KEYS = ("logprob_gap", "reward_mean", "flat_group_frac", "policy_lag", *RLSD_KEYS, *REUSE_KEYS)


@dataclass
class StepFigures:
    """One step's figures over all ranks, what :func:`step_record` writes. ``response_lens`` and
    ``truncated`` cover every rank's responses; ``repetition``: their mean share of repeated n-grams
    (:func:`repetition`; 0 where not measured); ``real_tokens``, ``padded_tokens`` and
    ``prompt_truncated`` per side (teacher, student)."""

    step: int
    loss: float
    loss_stats: dict[str, float]
    grad_norm: float
    lr: float
    response_lens: list[int]
    truncated: int
    tokens: int
    real_tokens: dict[str, int]
    padded_tokens: dict[str, int]
    skipped: bool
    prompt_truncated: dict[str, int]
    epoch: int
    times: dict[str, float]
    elapsed: float
    peak_mem_gb: float
    repetition: float = 0.0


def step_record(fig: StepFigures) -> dict:
    """One line of metrics.jsonl, its keys :data:`STEP_KEYS` in order (then those measured)."""
    n = max(1, len(fig.response_lens))
    loss_stats = fig.loss_stats
    rec = {
        "step": fig.step,
        "loss": float(fig.loss),
        **{k: float(loss_stats[k]) for k in LOSS_STAT_KEYS},
        "grad_norm": float(fig.grad_norm),
        "lr": float(fig.lr),
        "resp_len_mean": sum(fig.response_lens) / n,
        "resp_len_max": max(fig.response_lens, default=0),
        "truncated_frac": fig.truncated / n,
        "repetition": float(fig.repetition),
        "tokens": int(fig.tokens),
        "tokens_per_s": fig.tokens / fig.elapsed if fig.elapsed > 0 else 0.0,
        "real_token_frac_teacher": fig.real_tokens["teacher"] / max(1, fig.padded_tokens["teacher"]),
        "real_token_frac_student": fig.real_tokens["student"] / max(1, fig.padded_tokens["student"]),
        "skipped_nonfinite": int(fig.skipped),
        "prompt_truncated_student": int(fig.prompt_truncated["student"]),
        "prompt_truncated_teacher": int(fig.prompt_truncated["teacher"]),
        "epoch": int(fig.epoch),
        **{f"time_{p}": float(fig.times.get(p, 0.0)) for p in PHASES},
        "time_step": float(fig.elapsed),
        "peak_mem_gb": float(fig.peak_mem_gb),
    }
    assert tuple(rec) == STEP_KEYS
    if "logprob_gap" in loss_stats:  # mean |log-prob of the rollout engine - the trainer's| per checked token
        rec["logprob_gap"] = float(loss_stats["logprob_gap"])
    return rec


def repetition(units: Sequence[Hashable], n: int = REPETITION_N) -> float | None:
    """The share of a response's n-grams that repeat an earlier one: 1 - distinct n-grams / all
    n-grams. 0: no n-gram occurs twice; near 1: the response loops on one phrase. ``units``: its token
    ids (training) or its words (`opsd compare`, which reads every engine's and tokenizer's text alike).
    None for a response shorter than ``n`` units (no n-gram to count)."""
    total = len(units) - n + 1
    if total < 1:
        return None
    distinct = len({tuple(units[i : i + n]) for i in range(total)})
    return 1.0 - distinct / total


def mean(xs: Sequence[float]) -> float | None:
    """The mean, or None for no values: a report shows "-" rather than dividing by zero."""
    return sum(xs) / len(xs) if xs else None


def reduce_over_ranks(
    sums: dict[str, float], per_sample: list[list[float]], *, rank: int, world: int
) -> tuple[dict[str, float], list[list[float]]]:
    """One all-reduce for a step's metrics: ``sums`` (named fields, summed over ranks) and each rank's
    ``per_sample`` rows (every rank has as many) in its own slots. Returns the summed fields and every
    rank's rows, rank after rank."""
    width = len(per_sample[0]) if per_sample else 1
    mine = torch.zeros(world, len(per_sample), width, dtype=torch.float64)
    if per_sample:
        mine[rank] = torch.tensor(per_sample, dtype=torch.float64)
    packed = torch.cat([torch.tensor(list(sums.values()), dtype=torch.float64), mine.flatten()])
    reduced = all_reduce_sum(packed)
    total = dict(zip(sums, reduced[: len(sums)].tolist()))
    return total, reduced[len(sums) :].view(-1, width).tolist()


def format_step_line(rec: dict) -> str:
    """The one console line per step (beside the progress bar)."""
    line = (
        f"step {rec['step']:>5} | loss {rec['loss']:.4f} | div {rec['divergence']:.4f} | "
        f"clip {rec['clip_frac']:.3f} | agree {rec['agreement']:.3f} | overlap {rec['overlap_mass']:.3f} | "
        f"len {rec['resp_len_mean']:.0f} | {rec['tokens_per_s']:.0f} tok/s | {rec['time_step']:.1f}s"
    )
    evals = [f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("eval/")]
    return line + (" | " + " ".join(evals) if evals else "")


def say(progress: bool, msg: str) -> None:
    """A progress line on stderr, above any progress bar rather than through it; nothing unless
    ``progress``."""
    if progress:
        tqdm.write(msg, file=sys.stderr)


def progress_bar(total: int, done: int, desc: str, shown: bool, end: int):
    """The training loop's bar over ``total`` steps from ``done``; kept on screen only when this call
    runs to the last step (``end == total``). Off a terminal (a log file, a cluster job, CI) there is no
    bar, only the step lines: its carriage-return redraws would interleave with them."""
    return tqdm(
        total=total,
        initial=done,
        desc=desc,
        unit="step",
        disable=None if shown else True,  # None: tqdm's own test, off where stderr is not a terminal
        dynamic_ncols=True,
        leave=end == total,
    )


def show_step(bar, rec: dict, *, lines: bool = True) -> None:
    """Advance the progress bar, with the loss in its postfix, and print the step's line under it."""
    bar.update(1)
    bar.set_postfix(
        loss=f"{rec['loss']:.4f}", div=f"{rec['divergence']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}"
    )
    if lines:
        tqdm.write(format_step_line(rec), file=sys.stderr)


def write_samples(
    path: Path, step: int, examples: list, responses: list[str], finish_reasons: list[str], show: bool = True
) -> None:
    """Append decoded responses to ``samples.jsonl``; print the first one."""
    with path.open("a") as f:
        for ex, response, reason in zip(examples, responses, finish_reasons):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "problem": ex.problem,
                        "answer": ex.answer,
                        "response": response,
                        "finish_reason": reason,
                    }
                )
                + "\n"
            )
    if responses and show:
        tqdm.write(
            f"  sample | {str(examples[0].problem)[:100]!r} -> {responses[0][:200]!r}", file=sys.stderr
        )


class StepTimer:
    """Accumulates wall time per phase of a step (rollout, teacher, student, loss, optim).

    With ``sync`` (CUDA) each phase ends with one synchronization, so its time is the GPU's; the
    step's first phase also starts with one. The phases of a step follow each other, so the next
    phase starts where the last one's synchronization left the queue empty: 4 synchronizations a
    micro-batch (teacher, student forward, loss, backward), not 8. GPU work queued between phases
    counts towards the next one."""

    def __init__(self, sync: bool = False) -> None:
        self.times: dict[str, float] = {}
        self.sync = sync
        self.started = time.perf_counter()
        self._queue_empty = False  # a synchronization ended the last phase

    @classmethod
    def for_step(cls, device: torch.device) -> StepTimer:
        """A step's timer on ``device``: CUDA phases are synchronized, and its peak memory counts
        from here (the step's own peak, not the run's)."""
        reset_peak_memory(device)
        return cls(sync=synchronizes(device))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextmanager
    def __call__(self, name: str):
        if self.sync and not self._queue_empty:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
                self._queue_empty = True
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def _truncate_after(path: Path, step: int) -> None:
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill: drop it
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
    tmp.replace(path)


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl``.

    ``after_step``: the step a resumed run continues from. Lines for later steps (written by the
    interrupted run after its last checkpoint) are dropped first, so the file holds exactly one
    line per step across resumes and readers need not de-duplicate.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "opsd",
        config: dict | None = None,
        after_step: int | None = None,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if after_step is not None and self.path.is_file():
            _truncate_after(self.path, after_step)
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


@dataclass
class StepOutputs:
    """What one optimizer step produced on this rank; :func:`step_metrics` turns it into the step's
    metrics over all ranks."""

    completions: list  # opsd.rollout.Completion
    example_indices: list[int]  # the example each prompt came from
    batches: list  # opsd.data.batching.MicroBatch
    scores: Any  # opsd.objectives.Scores
    loss_sum: torch.Tensor  # global (summed over ranks)
    stats: LossStats  # this rank's
    grad_norm: torch.Tensor
    finite: bool
    timer: StepTimer  # the phases' wall times
    policy_lag: float = 0.0  # optimizer steps between the sampling weights and the trained ones


def step_metrics(
    out: StepOutputs,
    *,
    step: int,
    lr: float,
    prompt_truncated: dict[str, int],
    epoch: int,
    device: torch.device,
    rank: int,
    world: int,
) -> tuple[dict, dict[str, float]]:
    """The step's record over all ranks, from one sum of named fields (every rank calls it): loss
    statistics, token counts, prompt truncation, the responses' repetition (:func:`repetition`), the
    objective's sums, and each rank's response lengths and truncation flags. Returns the record and
    the summed fields (the objective reads its own)."""
    sums = asdict(out.stats)
    for side in ("teacher", "student"):
        for kind in ("real", "padded"):
            name = f"{side}_{kind}_tokens"
            sums[name] = sum(getattr(mb, name) for mb in out.batches)
    for side, count in prompt_truncated.items():
        sums[f"prompt_truncated_{side}"] = count
    sums.update(out.scores.sums)
    shares = [r for r in (repetition(c.token_ids) for c in out.completions) if r is not None]
    sums["repetition_sum"], sums["repetition_count"] = sum(shares), len(shares)
    per_sample = [[len(c.token_ids), c.finish_reason == "length"] for c in out.completions]
    total, rows = reduce_over_ranks(sums, per_sample, rank=rank, world=world)
    stats = LossStats(**{k: total[k] for k in asdict(out.stats)})
    figures = StepFigures(
        step=step,
        loss=float(out.loss_sum),
        loss_stats=stats.means(),
        grad_norm=float(out.grad_norm),
        lr=lr,
        response_lens=[int(n) for n, _ in rows],
        truncated=int(sum(cut for _, cut in rows)),
        tokens=int(stats.tokens),
        real_tokens={side: int(total[f"{side}_real_tokens"]) for side in ("teacher", "student")},
        padded_tokens={side: int(total[f"{side}_padded_tokens"]) for side in ("teacher", "student")},
        skipped=not out.finite,
        prompt_truncated={s: int(total[f"prompt_truncated_{s}"]) for s in prompt_truncated},
        epoch=epoch,
        times=out.timer.times,
        elapsed=out.timer.elapsed(),
        peak_mem_gb=peak_memory_gb(device),
        repetition=total["repetition_sum"] / max(1.0, total["repetition_count"]),
    )
    return step_record(figures), total


def log_step(
    writer: MetricsWriter, bar, rec: dict, out: StepOutputs, examples: list, decode, logging_cfg
) -> None:
    """The step's record to the sinks and the progress bar, and every ``logging.sample_every`` steps
    the first ``logging.num_samples`` responses to samples.jsonl."""
    writer.write(rec)
    show_step(bar, rec, lines=logging_cfg.step_lines)
    if logging_cfg.sample_every and rec["step"] % logging_cfg.sample_every == 0:
        shown = out.completions[: logging_cfg.num_samples]
        write_samples(
            writer.path.parent / "samples.jsonl",
            rec["step"],
            [examples[out.example_indices[c.prompt_index]] for c in shown],
            [decode(c.token_ids) for c in shown],
            [c.finish_reason for c in shown],
            show=logging_cfg.step_lines,
        )
