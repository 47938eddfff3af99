"""The OPSD trainer. ``Trainer.step`` is the whole algorithm, top to bottom: draw problems -> student
rollouts -> splice responses after both prompts -> per micro-batch: teacher hidden states (no grad) ->
student hidden states -> chunked fused-linear loss -> backward -> clip -> AdamW -> schedule -> teacher
update / weight sync. :func:`opsd.setup.build` makes the parts it runs; the Trainer runs them: the
loop, the step, evaluation and checkpoints.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from opsd import checkpoint, distributed, metrics, setup
from opsd.config import Config
from opsd.data.batching import (
    MicroBatch,
    TokenWeights,
    loss_tokens,
    make_microbatches,
    make_sample,
    pad_microbatches,
)
from opsd.errors import EngineError, TrainingError
from opsd.eval.heldout import (
    DivergenceStep,
    EvalResult,
    SetResult,
    artifact_share,
    drift_references,
    evaluate_set,
    heldout_accuracy,
    heldout_divergence,
    logits_of,
    solution_accuracy,
)
from opsd.guard import BestCheckpoint, StopRules
from opsd.parallel import clip_grad_norm

StepOutputs = metrics.StepOutputs

__all__ = ["Evaluation", "StepOutputs", "Trainer", "TrainingError"]


@dataclass
class Evaluation:
    """One held-out evaluation of the live model: the accuracy result (its figures global, its graded
    ``items`` this rank's) and, with ``eval.divergence``, the held-out divergence."""

    accuracy: EvalResult
    divergence: float | None = None
    sets: dict[str, SetResult] = field(default_factory=dict)  # eval.sets, by name
    artifacts: float | None = None  # eval.artifacts' share of eval.path's responses

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """The figures the step record logs, named ``prefix`` + metric (a set's ``prefix`` + NAME/)."""
        out = self.accuracy.metrics(prefix=prefix)
        if self.divergence is not None:
            out[f"{prefix}divergence"] = self.divergence
        if self.artifacts is not None:
            out[f"{prefix}artifacts"] = self.artifacts
        for name, result in self.sets.items():
            out |= result.metrics(prefix=f"{prefix}{name}/")
        return out


class Trainer:
    """Runs the parts :func:`opsd.setup.build` makes from a :class:`Config` (or the ``parts`` given):
    ``train()``, ``step()``, ``evaluate()`` (an :class:`Evaluation`) and checkpoints.

    ``resume=True`` continues the latest checkpoint in ``logging.run_dir`` exactly; ``overwrite=True``
    deletes an existing run directory first; without either, an existing run directory is refused.
    ``dist``: this process's place among torchrun's ranks (:func:`opsd.distributed.init_distributed`);
    without it the trainer is one process on ``cfg.device``, whatever process group may exist.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        resume: bool = False,
        overwrite: bool = False,
        dist: distributed.Dist | None = None,
        parts: setup.RunParts | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.progress_desc = "opsd train"  # the progress bar's label (opsd compare: method and seed)
        # Every part, as built; read where used (self.run.model, ...), never copied.
        self.run = parts or setup.build(cfg, dist, resume=resume, overwrite=overwrite)
        # The initial model's answers to the drift sets, before any step or resume moves it.
        run = self.run
        drift_references(run.eval_sets, run.engine, run.tokenizer, self.answer_logits(), cfg, run.dist.rank)
        if resume and checkpoint.latest_checkpoint(self.run_dir) is not None:
            self._resume()
        self.metrics = setup.open_metrics(cfg, run, resume=resume, after_step=self.step_num)

    @property
    def step_num(self) -> int:
        """Optimizer steps taken (``run.progress``, which checkpoints carry)."""
        return self.run.progress.step

    @property
    def bad_steps(self) -> int:
        """Consecutive steps skipped as non-finite, up to the last one."""
        return self.run.progress.bad_steps

    # ------------------------------------------------------------------------------------------
    # The step

    def step(self) -> StepOutputs:
        """One optimizer step of the objective (OPSD by default); :meth:`record` makes its metrics."""
        run = self.run  # the parts this step runs (opsd.setup.build)
        timer = metrics.StepTimer.for_step(run.dist.device)

        # 1-2. Draw this rank's share of the global batch; roll out n responses to each (with
        # rollout.overlap, requested one step ago and the next step's requested now; objective: sft,
        # each problem's reference solution instead, nothing generated).
        ex_idx, prompts, completions, lag = run.queue.next(self.step_num, timer)

        # 3. Splice each response, token for token, after the student prompt and the teacher prompt.
        samples = []
        for c in completions:
            if not c.token_ids:
                continue
            student, teacher = prompts[c.prompt_index]
            lp = c.logprobs if run.check_lp else None
            sample = make_sample(student, teacher, c.token_ids, ex_idx[c.prompt_index], c.finish_reason, lp)
            samples.append(sample)
        # What the objective reads from the rollouts as a whole (GRPO: rewards, group advantages).
        answers = [run.data.examples[i].answer for i in ex_idx]
        scores = run.objective.score(completions, answers, self.decode, step=self.step_num)
        batches = self.microbatches(samples)

        # 4-7. Per micro-batch: the teacher scores the response (Teacher.score, no grad), the student
        # reads it, the fused loss, backward (opsd.microbatch.forward_backward).
        loss_sum, stats = run.forward_backward(batches, scores, timer=timer)
        # 7b. The SFT anchor (loss.sft_coef): the step's reference solutions, end token included.
        if run.anchor is not None:
            with timer("student"):
                solutions = partial(self.microbatches, skip_end=False)
                loss_sum += run.anchor.backward(run.model, ex_idx, solutions, run.autocast, scores.sums)

        # 8. Clip, AdamW, schedule, teacher update, weight sync (all skipped if anything is non-finite).
        with timer("optim"):
            loss_sum, grad_norm, finite = self.optimizer_step(loss_sum)
        run.progress.step += 1
        return StepOutputs(
            completions, ex_idx, batches, scores, loss_sum, stats, grad_norm, finite, timer, lag
        )

    def microbatches(self, samples: list, skip_end: bool | None = None) -> list[MicroBatch]:
        """Pack this rank's samples into micro-batches within the token budget, weighted by the global
        token and sequence counts, and padded to as many on every rank (FSDP's collectives match).
        ``skip_end``: whether a stopped response's end token weighs 0 (default loss.end_token's)."""
        skip_end = self.run.skip_end if skip_end is None else skip_end
        lens = [loss_tokens(s, skip_end) for s in samples]
        read = sum(n > 0 for n in lens)
        counted = torch.tensor([sum(lens), read], dtype=torch.float64)
        tokens, seqs = distributed.all_reduce_sum(counted).tolist()
        batches = make_microbatches(
            samples,
            max_tokens=self.run.mb_tokens,
            pad_id=self.run.pad_id,
            weights=TokenWeights(self.run.spec.reduction, tokens, seqs, skip_end),
            device=self.run.dist.device,
            min_real_frac=self.cfg.optim.min_real_token_frac,
            widths=self.run.plan.row_widths(),
        )
        return pad_microbatches(batches, self.run.pad_id, self.run.dist.device)

    def decode(self, token_ids: list[int]) -> str:
        return self.run.tokenizer.decode(token_ids, skip_special_tokens=True)

    def rollout(self, prompts: list[list[int]], *, n: int | None = None, step: int | None = None) -> list:
        """``rollout.n`` (or ``n``) responses per prompt, seeded by step (this one, or ``step``) and rank."""
        return self.run.queue.generate(prompts, n=n, step=self.step_num if step is None else step)

    @property
    def pending(self):
        """The next step's rollouts, in flight (``rollout.overlap``)."""
        return self.run.queue.pending

    def optimizer_step(self, loss_sum: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Clip and step. FSDP summed the gradients over ranks (the loss weights are normalized by global
        token counts); norm and loss are global, so all ranks decide alike. A non-finite loss or gradient
        skips the update but still consumes the batch and advances the LR schedule (same data order and
        schedule)."""
        grad_norm = clip_grad_norm(self.run.params, self.cfg.optim.grad_clip or float("inf"))
        loss_sum = distributed.all_reduce_sum(loss_sum)
        finite = bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(grad_norm))
        if finite:
            self.run.optimizer.step()
        self.run.progress.bad_steps = 0 if finite else self.bad_steps + 1
        self.run.optimizer.zero_grad(set_to_none=True)
        self.run.scheduler.step()
        self.run.queue.settle()  # every rollout requested ahead is sampled before the weights move
        if finite:
            self.run.teacher.update()
            self.run.engine.sync_weights(self.run.model)
        else:
            warnings.warn(
                f"step {self.step_num + 1}: non-finite loss or gradient norm; update skipped", stacklevel=3
            )
        return loss_sum, grad_norm, finite

    def record(self, out: StepOutputs) -> dict:
        """The step's metrics over all ranks (:func:`opsd.metrics.step_metrics`; every rank calls it)."""
        lr, epoch = self.run.scheduler.get_last_lr()[0], self.run.data.cursor.epoch
        rec, total = metrics.step_metrics(
            out,
            step=self.step_num,
            lr=lr,
            prompt_truncated=self.run.prompts.truncated,
            epoch=epoch,
            device=self.run.dist.device,
            rank=self.run.dist.rank,
            world=self.run.dist.world_size,
        )
        lagging = self.cfg.rollout.overlap or self.cfg.rollout.reuse.refresh_every is not None
        lag = {"policy_lag": out.policy_lag} if lagging else {}
        anchor = {"sft_loss": total["sft_loss"]} if "sft_loss" in total else {}
        reuse = self.run.queue.observe(rec)  # rollout.reuse: generated tokens, reused or not
        return rec | self.run.objective.metrics(total) | lag | anchor | reuse

    # ------------------------------------------------------------------------------------------
    # The loop

    def train(self, until_step: int | None = None) -> list[dict]:
        """Run to ``optim.max_steps`` (or ``until_step``); checkpoint every K steps and at the end."""
        cfg = self.cfg
        end = min(cfg.optim.max_steps, until_step or cfg.optim.max_steps)
        if self.step_num >= cfg.optim.max_steps and self.run.dist.rank == 0:
            print(
                f"{self.run_dir} is complete: it reached optim.max_steps={cfg.optim.max_steps}. To train "
                f"further: opsd train --resume {self.run_dir} optim.max_steps=N (N > {self.step_num})",
                file=sys.stderr,
            )
        history = []
        rules = StopRules.for_run(cfg, self.run_dir, self.step_num, self.run.dist.rank)
        best = BestCheckpoint.for_run(cfg, self.run_dir, self.run.dist.rank)
        shown = cfg.logging.progress and self.run.dist.rank == 0
        bar = metrics.progress_bar(cfg.optim.max_steps, self.step_num, self.progress_desc, shown, end)
        self.run.stop.requested = None
        try:
            with self.run.stop:
                while self.step_num < end:
                    out = self.step()
                    self.run.plan.after_step()
                    rec = self.record(out)
                    if cfg.eval.every and self.step_num % cfg.eval.every == 0:
                        rec.update(self.evaluate().metrics(prefix="eval/"))
                    history.append(rec)
                    if self.metrics is not None:
                        metrics.log_step(
                            self.metrics, bar, rec, out, self.run.data.examples, self.decode, cfg.logging
                        )
                    self._check_bad_steps()
                    # A signal on any rank, or a guard on rank 0, stops all of them after this step.
                    if distributed.any_rank(rules.stops(rec, self.run.stop)):
                        self.run.stop.join_peers()
                    if self._checkpoint_due(end) and self.bad_steps == 0:
                        best.saved(self.save(), rec)
                    if self.run.stop.requested:
                        rules.say_stopped(self.run.stop, self.step_num)
                        break
        except EngineError as e:  # a rollout server failed: what was saved is intact, say where
            last = checkpoint.latest_checkpoint(self.run_dir) or "none yet"
            raise TrainingError(
                f"{e}. Last good checkpoint: {last}; once the engine is back: "
                f"opsd train --resume {self.run_dir}"
            ) from None
        finally:
            bar.close()
            if self.metrics is not None:
                self.metrics.close()
        return history

    def _check_bad_steps(self) -> None:
        limit = self.cfg.optim.max_bad_steps
        if self.bad_steps >= limit:
            last = checkpoint.latest_checkpoint(self.run_dir) or "none yet"
            raise TrainingError(
                f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (limit "
                f"optim.max_bad_steps={limit}); stopping. Last good checkpoint: {last}. "
                "Try a lower optim.lr, loss.clip, or model.dtype=float32."
            )

    def _checkpoint_due(self, end: int) -> bool:
        c = self.cfg.checkpoint
        periodic = c.every and self.step_num % c.every == 0
        return c.enabled and bool(periodic or self.step_num == end or self.run.stop.requested)

    @property
    def stopped(self) -> bool:
        """Whether the last ``train()`` ended on a signal."""
        return self.run.stop.requested is not None

    def evaluate(self, sets: bool = True) -> Evaluation:
        """Held-out accuracy of the live model (no privileged information), with ``eval.divergence`` the
        held-out divergence, and with ``sets`` every ``eval.sets`` entry (:mod:`opsd.eval.sets`), sharded
        over ranks (every rank calls it)."""
        accuracy = self.accuracy(self.run.data.eval_examples, self.run.eval_grader)
        divergence = self.heldout_divergence()["divergence"] if self.cfg.eval.divergence else None
        results = self.evaluate_sets() if sets else {}
        return Evaluation(
            accuracy, divergence, results, artifact_share(accuracy.items, self.cfg.eval.artifacts)
        )

    def evaluate_sets(self) -> dict[str, SetResult]:
        """Every ``eval.sets`` entry's accuracy, drift and split, by name."""
        phrases, logits = self.cfg.eval.artifacts, self.answer_logits()
        return {s.name: evaluate_set(s, self.accuracy, logits, phrases) for s in self.run.eval_sets}

    def accuracy(self, examples: list, grader) -> EvalResult:
        """The live model's accuracy on ``examples`` under ``grader``, sharded over ranks."""
        return heldout_accuracy(
            self.run.model,
            self.run.tokenizer,
            examples,
            self.cfg,
            self.run.engine,
            grader,
            self.run.dist.rank,
            self.run.dist.world_size,
        )

    def answer_logits(self):
        """Samples to their response-position logits under the live model (made per call: a function
        kept on the trainer would hold it in a reference cycle)."""
        return logits_of(self.run.model, self.run.autocast, self.microbatches)

    def evaluate_with_solutions(self, examples: list) -> EvalResult:
        """Greedy accuracy of the live model on ``examples`` (held-out rows with their solutions) with
        each solution in its prompt, the teacher's prompt: the teacher's ceiling (eval.grader)."""
        return solution_accuracy(
            self.run.model,
            self.run.tokenizer,
            examples,
            self.run.eval_prompts,
            self.cfg,
            self.run.engine,
            self.run.eval_grader,
        )

    def heldout_divergence(self) -> dict:
        """The distillation loss's statistics on the held-out problems (:mod:`opsd.eval.heldout`): one
        response each from a seed stream no training step uses, the same at every evaluation."""
        return heldout_divergence(
            self.run.model,
            self.run.teacher,
            self.run.data.eval_examples,
            self.run.eval_prompts,
            partial(self.rollout, n=1, step=-1),
            DivergenceStep(self.microbatches, self.run.divergence_loss, self.run.autocast),
            self.run.dist.rank,
            self.run.dist.world_size,
        )

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def save(self) -> Path:
        """Every rank calls it: the checkpoint is written together (see :mod:`opsd.checkpoint`); what it
        holds is :meth:`opsd.setup.RunParts.checkpointed`."""
        c = self.cfg.checkpoint
        return checkpoint.save_checkpoint(
            self.run_dir,
            self.step_num,
            self.run.checkpointed(),
            keep_last=c.keep_last,
            save_merged=c.save_merged,
        )

    def _resume(self) -> None:
        """Continue exactly, at the checkpoint's number of ranks or another (everything reshards)."""
        ckpt = checkpoint.latest_checkpoint(self.run_dir)
        seed = distributed.rank_seed(self.cfg.seed, self.run.dist.rank)
        checkpoint.load_checkpoint(ckpt, self.run.checkpointed(), seed=seed)
        self.run.engine.sync_weights(self.run.model)
        if self.run.dist.rank == 0:
            print(f"resumed from {ckpt} at step {self.step_num}", file=sys.stderr)

    def close(self) -> None:
        """Shut the rollout engine down while the process group still exists (vLLM's teardown uses it);
        call before :func:`opsd.distributed.shutdown`. Safe to call twice."""
        run = getattr(self, "run", None)
        if run is not None and run.engine is not None:
            run.engine.close()
            run.engine = None
