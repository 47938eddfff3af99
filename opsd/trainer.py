"""The OPSD trainer. ``Trainer.step`` is the whole algorithm, top to bottom: draw problems -> student
rollouts -> splice responses after both prompts -> per micro-batch: teacher hidden states (no grad) ->
student hidden states -> chunked fused-linear loss -> backward -> clip -> AdamW -> schedule -> teacher
update / weight sync. ``Trainer.setup`` builds the parts in order (:mod:`opsd.setup`).
"""

from __future__ import annotations

import sys
import warnings
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from opsd import checkpoint, cpu, distributed, metrics, models, precision, setup
from opsd.anchor import SFTAnchor
from opsd.config import Config, resolve_engine
from opsd.cpu.heap import reuse_freed_blocks, trim_heap
from opsd.data import PromptBuilder, make_microbatches, make_sample
from opsd.data.batching import MicroBatch, loss_tokens, pad_microbatches
from opsd.devices import check_compiler, resolve_device
from opsd.distributed import all_reduce_sum
from opsd.errors import TrainingError, UserError
from opsd.eval.heldout import heldout_accuracy, heldout_divergence
from opsd.grading import as_grade, resolve_grader
from opsd.guard import Guard
from opsd.loss import LossStats
from opsd.microbatch import forward_backward
from opsd.objectives import Objective, Scores, floor_end_tokens, make_distillation, make_objective
from opsd.parallel import clip_grad_norm, full_head_weight
from opsd.rollout import EngineError
from opsd.rollout.base import _stop_ids
from opsd.rollout.queue import RolloutQueue
from opsd.rundir import GracefulStop, prepare_run_dir

StepOutputs = metrics.StepOutputs

__all__ = ["StepOutputs", "Trainer", "TrainingError", "forward_backward"]


class Trainer:
    """Builds everything from a :class:`Config` (:meth:`setup`), then ``train()``.

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
    ) -> None:
        self.cfg = cfg
        self.dist = dist or distributed.Dist(device=distributed.use_device(resolve_device(cfg.device)))
        self.rank = self.dist.rank
        self.world = self.dist.world_size
        self.device = self.dist.device
        self.run_dir = Path(cfg.logging.run_dir)
        self.step_num = 0
        self.bad_steps = 0
        self.stop = GracefulStop()
        self.progress_desc = "opsd train"  # the progress bar's label (opsd compare: method and seed)
        self.setup(resume, overwrite)

    def setup(self, resume: bool, overwrite: bool) -> None:
        """The parts, in the order they need each other; a failure on any rank ends every rank."""
        cfg = self.cfg
        sharded = self.dist.mesh is not None
        # The same seed on every rank: LoRA's initial weights must agree before sharding.
        torch.manual_seed(cfg.seed)
        if cfg.model.compile:  # refused before anything loads
            if sharded:
                raise UserError("model.compile=true runs in one process, not under torchrun: set it false")
            check_compiler(self.device)
        # Precision: model.dtype is the compute dtype; full fine-tuning in bf16 keeps float32 masters.
        m = cfg.model
        self.precision = precision.resolve(
            m.dtype, self.device, full_finetune=not m.lora.enabled, pure_bf16=m.pure_bf16
        )
        # rollout.engine resolved once (auto: vLLM where installed); every part below takes the kind.
        kind, chosen = resolve_engine(cfg.rollout.engine)
        self.engine_kind = kind
        dtype = self.precision.compute
        # The CPU plan (empty on a GPU), then what is trained for: distillation, GRPO, both, or RLSD.
        plan = cpu.resolve_plan(cfg.cpu, self.device, dtype, engine=kind, sharded=sharded, compiled=m.compile)
        chunk = cfg.loss.chunk_size or plan.loss_chunk_rows
        self.objective = make_objective(cfg, chunk, plan.loss_slab_elements)
        # eval.divergence measures the distillation loss, whatever objective trains.
        self.divergence_objective = make_distillation(cfg, chunk, plan.loss_slab_elements)
        grader = resolve_grader(cfg.eval.grader, "eval.grader")
        self.eval_grader = lambda response, gold: as_grade(grader(response, gold))
        self.spec = cfg.loss.to_spec(cfg.rollout.temperature)
        self.skip_end = cfg.loss.end_token == "skip" and cfg.objective == "opsd"
        self.check_lp = cfg.rollout.checks_logprobs(kind)
        products = precision.loss_matmul_dtype(self.precision, self.device)
        self.loss_mm = products if cfg.loss.products == "auto" else None
        # Run directory, data and tokenizer; then the model and its teacher, every transform in order.
        distributed.run_setup(lambda: self._load(resume, overwrite), "setup")
        # Without a teacher term the teacher runs only for eval.divergence: the initial policy where it
        # costs nothing (LoRA, adapter off), the live one otherwise (no second copy of the weights).
        no_term = "fixed" if m.lora.enabled else "live"
        teacher_mode = cfg.teacher.mode if self.objective.uses_teacher else no_term
        self.model, self.teacher, self.plan = setup.prepare_model(
            cfg, self.dist, self.precision, plan, teacher_mode=teacher_mode, vocab=self.tokenizer.get_vocab()
        )
        if cfg.loss.end_token == "floor":  # the end tokens are known once the tokenizer and model are
            ends = tuple(_stop_ids(self.tokenizer, self.model, []))
            self.objective = floor_end_tokens(self.objective, ends)
            self.spec = replace(self.spec, end_ids=ends)
        if self.rank:  # dropout and anything else random differs per rank; rank 0 draws as one process does
            torch.manual_seed(distributed.rank_seed(cfg.seed, self.rank))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = setup.make_optimizer_for(cfg, self.params)
        parts = (cfg, kind, self.model, self.tokenizer, self.precision, self.dist, self.plan)
        self.engine = distributed.run_setup(lambda: setup.make_rollout_engine(*parts), "rollout engine start")
        self.engine.sleep()  # the budget is measured without vLLM resident (rollout() wakes it)
        self.mb_tokens, why = setup.microbatch_tokens(
            cfg, self.model, self.params, self.precision, self.device, beside_vllm=kind == "vllm"
        )
        drawn = (self.cursor, self.prompts, self.examples)
        self.queue = RolloutQueue(cfg, self.engine, *drawn, self.dist, trim_heap=self.plan.trim_heap)
        if self.rank == 0:
            print(f"rollout engine: {kind} ({chosen})", file=sys.stderr)
            print(f"precision: {self.precision.describe()}", file=sys.stderr)
            if self.objective.uses_teacher:
                print(f"loss: {self.spec.describe()}", file=sys.stderr)
            print(f"cpu plan: {self.plan.describe()}", file=sys.stderr)
            print(f"micro-batches: up to {self.mb_tokens} padded tokens ({why})", file=sys.stderr)
        if resume and checkpoint.latest_checkpoint(self.run_dir) is not None:
            self._resume()
        # Rank 0 records the config, the CPU plan and the data report and opens the metrics sinks.
        opened = lambda: setup.open_run(cfg, self.run_dir, self.data_report, self.plan, resume, self.step_num)  # noqa: E731
        self.metrics = distributed.run_setup(
            lambda: opened() if self.rank == 0 else None, "run directory setup"
        )

    def _load(self, resume: bool, overwrite: bool) -> None:
        """The run directory, the rows and the tokenizer (a failure on any rank ends every rank)."""
        cfg = self.cfg
        if self.rank == 0:
            has_checkpoint = checkpoint.latest_checkpoint(self.run_dir) is not None
            prepare_run_dir(self.run_dir, resume=resume, overwrite=overwrite, has_checkpoint=has_checkpoint)
            checkpoint.clean_partial(self.run_dir)
        privileged = cfg.teacher.privileged and (self.objective.uses_teacher or cfg.loss.sft_coef > 0)
        needs = self.objective.needs_answers
        data = setup.load_data(
            cfg, privileged=privileged, needs_answers=needs, rank=self.rank, world=self.world
        )
        self.examples, self.cursor, self.eval_examples = data.examples, data.cursor, data.eval_examples
        self.data_report = data.report
        self.tokenizer = models.load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.prompts = PromptBuilder.from_config(self.tokenizer, cfg.data, privileged=cfg.teacher.privileged)
        self.eval_prompts = PromptBuilder.from_config(self.tokenizer, cfg.data, privileged=True)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        coef, limit = cfg.loss.sft_coef, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
        self.anchor = SFTAnchor(coef, self.tokenizer, self.examples, cfg.data, limit) if coef > 0 else None

    # ------------------------------------------------------------------------------------------
    # The step

    def step(self) -> StepOutputs:
        """One optimizer step of the objective (OPSD by default); :meth:`record` makes its metrics."""
        timer = metrics.StepTimer.for_step(self.device)

        # 1-2. Draw this rank's share of the global batch; roll out n responses to each (with
        # rollout.overlap, requested one step ago and the next step's requested now).
        ex_idx, prompts, completions, lag = self.queue.next(self.step_num, timer)

        # 3. Splice each response, token for token, after the student prompt and the teacher prompt.
        rows = [(c, prompts[c.prompt_index], ex_idx[c.prompt_index]) for c in completions if c.token_ids]
        lps = [c.logprobs if self.check_lp else None for c, _, _ in rows]
        samples = [make_sample(*p, c.token_ids, i, c.finish_reason, lp) for (c, p, i), lp in zip(rows, lps)]
        # What the objective reads from the rollouts as a whole (GRPO: rewards, group advantages).
        answers = [self.examples[i].answer for i in ex_idx]
        scores = self.objective.score(completions, answers, self.decode, step=self.step_num)
        batches = self.microbatches(samples)

        # 4-7. Per micro-batch: the teacher scores the response (Teacher.score, no grad), the student
        # reads it, the fused loss, backward (opsd.microbatch.forward_backward).
        loss_sum, stats = self.forward_backward(batches, scores, timer=timer)
        # 7b. The SFT anchor (loss.sft_coef): the step's reference solutions, end token included.
        if self.anchor is not None:
            with timer("student"):
                solutions = partial(self.microbatches, skip_end=False)
                loss_sum += self.anchor.backward(self.model, ex_idx, solutions, self.autocast, scores.sums)

        # 8. Clip, AdamW, schedule, teacher update, weight sync (all skipped if anything is non-finite).
        with timer("optim"):
            loss_sum, grad_norm, finite = self.optimizer_step(loss_sum)
        self.step_num += 1
        return StepOutputs(
            completions, ex_idx, batches, scores, loss_sum, stats, grad_norm, finite, timer, lag
        )

    def microbatches(self, samples: list, skip_end: bool | None = None) -> list[MicroBatch]:
        """Pack this rank's samples into micro-batches within the token budget, weighted by the global
        token and sequence counts, and padded to as many on every rank (FSDP's collectives match).
        ``skip_end``: whether a stopped response's end token weighs 0 (default loss.end_token's)."""
        skip_end = self.skip_end if skip_end is None else skip_end
        lens = [loss_tokens(s, skip_end) for s in samples]
        read = sum(n > 0 for n in lens)
        tokens, seqs = all_reduce_sum(torch.tensor([sum(lens), read], dtype=torch.float64)).tolist()
        counts = dict(reduction=self.spec.reduction, global_tokens=tokens, global_seqs=seqs)
        counts["skip_end"] = skip_end
        plan = dict(device=self.device, bucket=self.plan.bucket_widths, pack_from=self.plan.pack_from)
        budget = dict(max_tokens=self.mb_tokens, min_real_frac=self.cfg.optim.min_real_token_frac)
        batches = make_microbatches(samples, pad_id=self.pad_id, **budget, **counts, **plan)
        return pad_microbatches(batches, self.pad_id, self.device)

    def forward_backward(
        self, batches: list, scores: Scores | None = None, *, timer=None, backward: bool = True
    ) -> tuple[Tensor, LossStats]:
        """This trainer's micro-batch loop (:func:`opsd.microbatch.forward_backward`) with its model,
        teacher, objective and mixed precision; with the CPU plan's ``tune_malloc``, inside glibc
        settings that reuse the blocks it frees (:func:`opsd.cpu.heap.reuse_freed_blocks`)."""
        plan = self.plan
        tuned = reuse_freed_blocks(keep_pages=plan.keep_pages) if plan.tune_malloc else nullcontext()
        teacher = self.teacher if self.objective.uses_teacher else None
        parts = (self.model, teacher, batches, self.loss)
        with tuned:
            return forward_backward(
                *parts, scores=scores or Scores(), autocast=self.autocast, timer=timer, backward=backward
            )

    def loss(self, s_hidden, t_hidden, t_head, mb, scores: Scores, *, objective: Objective | None = None):
        """The objective's loss on one micro-batch (or ``objective``'s: the held-out divergence), with
        this model's head and loss precision."""
        objective = objective or self.objective
        head = full_head_weight(self.model)
        return objective.loss(s_hidden, t_hidden, t_head, mb, scores, head=head, matmul_dtype=self.loss_mm)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def autocast(self):
        """bf16 compute over float32 master weights in one process, and LoRA's float32 adapters
        computing in bf16 over a bf16 base; around the model forwards only, never the loss. Under
        torchrun FSDP2's mixed-precision policy casts instead (:func:`opsd.setup.fsdp_param_dtype`)."""
        if self.dist.mesh is not None:
            return nullcontext()
        adapters = self.model if self.cfg.model.lora.enabled else None
        return precision.autocast(self.precision, self.device, adapters)

    def rollout(self, prompts: list[list[int]], *, n: int | None = None, step: int | None = None) -> list:
        """``rollout.n`` (or ``n``) responses per prompt, seeded by step (this one, or ``step``) and rank."""
        return self.queue.generate(prompts, n=n, step=self.step_num if step is None else step)

    pending = property(lambda self: self.queue.pending, doc="The next step's rollouts, in flight.")

    def optimizer_step(self, loss_sum: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Clip and step. FSDP summed the gradients over ranks (the loss weights are normalized by global
        token counts); norm and loss are global, so all ranks decide alike. A non-finite loss or gradient
        skips the update but still consumes the batch and advances the LR schedule (same data order and
        schedule)."""
        grad_norm = clip_grad_norm(self.params, self.cfg.optim.grad_clip or float("inf"))
        loss_sum = all_reduce_sum(loss_sum)
        finite = bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.bad_steps = 0 if finite else self.bad_steps + 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.queue.settle()  # every rollout requested ahead is sampled before the weights move
        if finite:
            self.teacher.update()
            self.engine.sync_weights(self.model)
        else:
            warnings.warn(
                f"step {self.step_num + 1}: non-finite loss or gradient norm; update skipped", stacklevel=3
            )
        return loss_sum, grad_norm, finite

    def record(self, out: StepOutputs) -> dict:
        """The step's metrics over all ranks (:func:`opsd.metrics.step_metrics`; every rank calls it)."""
        lr, epoch = self.scheduler.get_last_lr()[0], self.cursor.epoch
        where = dict(device=self.device, rank=self.rank, world=self.world)
        rec, total = metrics.step_metrics(
            out, step=self.step_num, lr=lr, prompt_truncated=self.prompts.truncated, epoch=epoch, **where
        )
        lag = {"policy_lag": out.policy_lag} if self.cfg.rollout.overlap else {}
        anchor = {"sft_loss": total["sft_loss"]} if "sft_loss" in total else {}
        return rec | self.objective.metrics(total) | lag | anchor

    # ------------------------------------------------------------------------------------------
    # The loop

    def train(self, until_step: int | None = None) -> list[dict]:
        """Run to ``optim.max_steps`` (or ``until_step``); checkpoint every K steps and at the end."""
        cfg = self.cfg
        end = min(cfg.optim.max_steps, until_step or cfg.optim.max_steps)
        if self.step_num >= cfg.optim.max_steps and self.rank == 0:
            print(
                f"{self.run_dir} is complete: it reached optim.max_steps={cfg.optim.max_steps}. To train "
                f"further: opsd train --resume {self.run_dir} optim.max_steps=N (N > {self.step_num})",
                file=sys.stderr,
            )
        history, guard = [], Guard.for_run(cfg, self.run_dir, self.step_num, self.rank)  # stops, best ckpt
        shown = cfg.logging.progress and self.rank == 0
        bar = metrics.progress_bar(cfg.optim.max_steps, self.step_num, self.progress_desc, shown, end)
        self.stop.requested = None
        try:
            with self.stop:
                while self.step_num < end:
                    out = self.step()
                    if self.plan.trim_heap:  # the heap's holes back to the OS: RSS does not creep
                        trim_heap()
                    rec = self.record(out)
                    if cfg.eval.every and self.step_num % cfg.eval.every == 0:
                        rec.update(self.evaluate())
                    history.append(rec)
                    if self.metrics is not None:
                        metrics.log_step(self.metrics, bar, rec, out, self.examples, self.decode, cfg.logging)
                    self._check_bad_steps()
                    # A signal on any rank, or a guard on rank 0, stops all of them after this step.
                    if distributed.any_rank(guard.stops(rec, self.stop)):
                        self.stop.requested = self.stop.requested or "a signal to another rank"
                    if self._checkpoint_due(end) and self.bad_steps == 0:
                        guard.saved(self.save(), rec)
                    if self.stop.requested:
                        guard.say_stopped(self.stop, self.step_num)
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
        return c.enabled and bool(periodic or self.step_num == end or self.stop.requested)

    stopped = property(
        lambda self: self.stop.requested is not None, doc="The last ``train()`` ended on a signal."
    )

    def evaluate(self) -> dict:
        """Held-out accuracy of the live model (no privileged information) and, with ``eval.divergence``,
        the held-out divergence, sharded over ranks."""
        parts = (self.model, self.tokenizer, self.eval_examples, self.cfg, self.engine, self.eval_grader)
        out = heldout_accuracy(*parts, self.rank, self.world).metrics(prefix="eval/")
        if self.cfg.eval.divergence:
            out["eval/divergence"] = self.heldout_divergence()["divergence"]
        return out

    def heldout_divergence(self) -> dict:
        """The distillation loss's statistics on the held-out problems (:mod:`opsd.eval.heldout`): one
        response each from a seed stream no training step uses, the same at every evaluation."""
        generate = partial(self.rollout, n=1, step=-1)
        loss = partial(self.loss, objective=self.divergence_objective)
        parts = (
            self.model,
            self.teacher,
            self.eval_examples,
            self.eval_prompts,
            generate,
            self.microbatches,
            loss,
        )
        return heldout_divergence(*parts, autocast=self.autocast, rank=self.rank, world=self.world)

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def save(self) -> Path:
        """Every rank calls it: the checkpoint is written together (see :mod:`opsd.checkpoint`)."""
        c = self.cfg.checkpoint
        shared = {"format": checkpoint.FORMAT, "step": self.step_num, "bad_steps": self.bad_steps}
        shared |= {"scheduler": self.scheduler.state_dict(), "cursor": self.cursor.state_dict()}
        mine = {"truncated": self.prompts.state_dict(), "pending": self.queue.state_dict()}
        return checkpoint.save_checkpoint(
            *(self.run_dir, self.step_num, self.model, self.tokenizer, shared),
            optimizer=self.optimizer,
            rank_state=mine,
            tensors=self.teacher.tensors(),
            keep_last=c.keep_last,
            save_merged=c.save_merged,
        )

    def _resume(self) -> None:
        """Continue exactly, at the checkpoint's number of ranks or another (everything reshards)."""
        ckpt = checkpoint.latest_checkpoint(self.run_dir)
        checkpoint.check_format(ckpt)
        seed = distributed.rank_seed(self.cfg.seed, self.rank)
        tensors = self.teacher.tensors()
        state, mine = checkpoint.load_checkpoint(ckpt, self.model, self.optimizer, tensors=tensors, seed=seed)
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        self.step_num, self.bad_steps = state["step"], state["bad_steps"]
        self.prompts.load_state_dict(mine.get("truncated", {"student": 0, "teacher": 0}))  # empty: a new rank
        self.queue.load_state_dict(mine.get("pending"))
        self.engine.sync_weights(self.model)
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {self.step_num}", file=sys.stderr)

    def close(self) -> None:
        """Shut the rollout engine down while the process group still exists (vLLM's teardown uses it);
        call before :func:`opsd.distributed.shutdown`. Safe to call twice."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
