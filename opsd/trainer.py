"""The OPSD trainer. ``Trainer.step`` is the whole algorithm, top to bottom: draw problems -> student
rollouts -> splice responses after both prompts -> per micro-batch: teacher hidden states (no grad) ->
student hidden states -> chunked fused-linear loss -> backward -> clip -> AdamW -> schedule -> teacher
update / weight sync. Everything else sits behind named functions in the modules it imports.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from opsd import checkpoint, distributed, metrics, models, parallel, precision
from opsd.config import Config
from opsd.data import DataCursor, PromptBuilder, load_examples, make_microbatches, make_sample
from opsd.data.batching import pad_microbatches
from opsd.devices import resolve_device
from opsd.distributed import all_reduce_sum
from opsd.errors import TrainingError
from opsd.loss import LossStats, fused_linear_distill, fused_linear_policy_gradient, token_logprobs
from opsd.optim import make_optimizer
from opsd.parallel import forward_hidden, full_head_weight, parallelize
from opsd.rewards import flat_group_fraction, group_advantages, make_reward
from opsd.rollout import SamplingParams, make_engine
from opsd.rundir import GracefulStop, prepare_run_dir, record_config
from opsd.teacher import Teacher

__all__ = ["Trainer", "TrainingError", "forward_backward"]


def forward_backward(
    model,
    teacher: Teacher,
    batches: list,
    loss_fn,
    *,
    adv: list[float] | None = None,
    autocast=nullcontext,
    timer=None,
    backward: bool = True,
) -> tuple[Tensor, LossStats]:
    """The micro-batch loop of a step: per micro-batch, the teacher's hidden states (no grad) -> the
    student's -> ``loss_fn(s_hidden, t_hidden, t_head, mb, adv)`` -> backward. Returns the summed loss
    (float64, this rank's) and the loss statistics. ``backward=False`` computes the same numbers
    without gradients (held-out divergence); ``adv``: GRPO's advantages per sample (no teacher);
    ``autocast``: a context for the forwards (one process's bf16 compute). The trainer's step, the
    distributed tests and bench/smollm2_opsd.py run it; no other copy of this loop exists."""
    timer = timer or metrics.StepTimer(sync=False)
    loss_sum, stats = torch.zeros((), dtype=torch.float64), LossStats()
    with torch.enable_grad() if backward else torch.no_grad():
        for mb in batches:
            with timer("teacher"), autocast():  # GRPO has no teacher
                t_hidden, t_head = (
                    (None, None)
                    if adv is not None
                    else teacher.score(mb.teacher_ids, mb.teacher_mask, mb.teacher_pos)
                )
            with timer("student"), autocast():
                s_hidden = forward_hidden(model, mb.student_ids, mb.student_mask, mb.student_pos)
            with timer("loss"):
                loss, st = loss_fn(s_hidden, t_hidden, t_head, mb, adv)
            if backward:
                with timer("student"):
                    loss.backward()
            loss_sum += loss.detach().double().cpu()
            stats.add(
                st if mb.sample_indices else LossStats()
            )  # a zero-weight padding micro-batch adds nothing
    teacher.release()  # a sharded teacher network never runs backward, when FSDP would free its root
    return loss_sum, stats


class Trainer:
    """Builds everything from a :class:`Config`, then ``train()``.

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
        self.cfg, self.dist = (
            cfg,
            dist or distributed.Dist(device=distributed.use_device(resolve_device(cfg.device))),
        )
        self.rank, self.world, self.device = self.dist.rank, self.dist.world_size, self.dist.device
        self.run_dir = Path(cfg.logging.run_dir)
        torch.manual_seed(
            cfg.seed
        )  # the same on every rank: LoRA's initial weights must agree before sharding
        # Run directory, data, tokenizer and model: a failure on any rank ends every rank with its message.
        distributed.run_setup(lambda: self._load(resume, overwrite), "setup")
        self.reward = make_reward(cfg.grpo.grader) if cfg.objective == "grpo" else None
        self.teacher = Teacher(
            "live" if self.reward else cfg.teacher.mode,
            self.model,
            lora=cfg.model.lora.enabled,
            ema_decay=cfg.teacher.ema_decay,
            external=self._external,
            frozen_copy=cfg.teacher.frozen_copy,
            copy_dtype=self.precision.compute,
            sharded=self.dist.mesh is not None,
        )
        if self.dist.mesh is not None:  # under torchrun: FSDP2 over the mesh, teacher network first
            parallelize(
                self.model,
                self.teacher.model,
                self.dist.mesh,
                param_dtype=self._fsdp_param_dtype(),
                reduce_dtype=models.DTYPES[cfg.parallel.reduce_dtype],
                teacher_offload=self.teacher.offload_shards,
            )
        self.teacher.start()  # the EMA snapshot, of the student as sharded
        if self.rank:  # dropout and anything else random differs per rank; rank 0 draws as one process does
            torch.manual_seed(distributed.rank_seed(cfg.seed, self.rank))
        self.spec, self.check_lp = cfg.loss.to_spec(cfg.rollout.temperature), cfg.rollout.checks_logprobs()
        self.loss_mm = precision.loss_matmul_dtype(
            self.precision, self.device
        )  # bf16 products only on bf16 units
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer, self.scheduler = make_optimizer(
            self.params,
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            warmup=o.warmup_steps,
            total=o.max_steps,
            schedule=o.scheduler,
            min_ratio=o.min_lr_ratio,
        )
        amp = self.precision.compute if self.precision.mixed and self.dist.mesh is None else None
        self.engine = distributed.run_setup(
            lambda: make_engine(
                cfg.rollout,
                self.model,
                self.tokenizer,
                seed=cfg.seed,
                max_prompt_len=cfg.data.max_prompt_len,
                compute_dtype=self.precision.compute,
                autocast_dtype=amp,
            ),
            "rollout engine start",
        )
        self.engine.sleep()  # the budget is measured without vLLM resident (rollout() wakes it) ...
        adam_bytes = (
            2 * 4 * sum(parallel.local_numel(p) for p in self.params)
        )  # ... and room for AdamW's moments
        self.mb_tokens, why = models.microbatch_budget(
            o.max_tokens_per_microbatch,
            models.base_model(self.model).config,
            self.precision.compute,
            self.device,
            cfg.model.gradient_checkpointing,
            reserve=adam_bytes,
        )
        self.rank or print(f"micro-batches: up to {self.mb_tokens} padded tokens ({why})", file=sys.stderr)
        self.step_num, self.bad_steps, self.stop = 0, 0, GracefulStop()
        if resume and checkpoint.latest_checkpoint(self.run_dir) is not None:
            self._resume()
        self.metrics = distributed.run_setup(lambda: self._start(resume), "run directory setup")

    def _load(self, resume: bool, overwrite: bool) -> None:
        cfg, d, m = self.cfg, self.cfg.data, self.cfg.model
        self.prompts_per_rank = cfg.rollout.prompts_per_rank(self.world)
        if self.rank == 0:
            prepare_run_dir(
                self.run_dir,
                resume=resume,
                overwrite=overwrite,
                has_checkpoint=checkpoint.latest_checkpoint(self.run_dir) is not None,
            )
            checkpoint.clean_partial(self.run_dir)
        # Data: rows, a resumable cursor sharded by rank, prompts tokenized once per example.
        grpo = cfg.objective == "grpo"  # the RL baseline: rewards from the answers, no privileged information
        report = load_examples(
            d.path,
            problem_key=d.problem_key,
            solution_key=d.solution_key if cfg.teacher.privileged and not grpo else None,
            answer_key=d.answer_key,
            split=d.split,
            skip_bad_rows=d.skip_bad_rows,
            drop_empty_solution=d.drop_empty_solution,
            require_answer=grpo,
        )
        self.examples = report.examples
        if (
            cfg.teacher.solution_source == "other"
        ):  # a control: each problem comes with the next row's solution
            self.examples = [
                replace(ex, solution=self.examples[(i + 1) % len(self.examples)].solution)
                for i, ex in enumerate(self.examples)
            ]
        self.data_report = {
            "rows": len(report.examples),
            "skipped_bad": report.skipped_bad,
            "empty_solution": report.empty_solution,
            "dropped_empty": report.dropped_empty,
        }
        self.cursor = DataCursor(
            len(self.examples), seed=cfg.seed, rank=self.rank, world_size=self.world, shuffle=d.shuffle
        )
        # Held-out problems, validated at startup like the training data, so a bad file fails before any compute.
        e = cfg.eval
        self.eval_examples = (
            load_examples(
                e.path,
                problem_key=d.problem_key,
                solution_key=None,
                answer_key=e.answer_key,
                require_answer=True,
            ).examples[: e.limit]
            if e.path
            else []
        )
        # Model: the student (LoRA or full), its tokenizer, and an external teacher.
        self.tokenizer = models.load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self.prompts = PromptBuilder.from_config(self.tokenizer, d, privileged=cfg.teacher.privileged)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # model.dtype is the compute dtype; full fine-tuning in bf16 stores float32 master weights.
        self.precision = precision.resolve(
            m.dtype, self.device, full_finetune=not m.lora.enabled, pure_bf16=m.pure_bf16
        )
        if self.rank == 0:
            print(f"precision: {self.precision.describe()}", file=sys.stderr)
        self.model = models.load_model(
            m.path,
            dtype=self.precision.storage,
            attn_implementation=m.attn_implementation,
            device=str(self.device),
            trust_remote_code=m.trust_remote_code,
        )
        if m.gradient_checkpointing:
            models.enable_gradient_checkpointing(self.model)
        if m.lora.enabled:
            self.model = models.apply_lora(
                self.model,
                r=m.lora.r,
                alpha=m.lora.alpha,
                dropout=m.lora.dropout,
                target_modules=m.lora.target_modules,
                gradient_checkpointing=m.gradient_checkpointing,
            )
        self.model.train()
        models.check_plain_head(self.model)
        self._external = (
            Teacher.load_external(
                cfg.teacher.path,
                m.path,
                self.tokenizer.get_vocab(),
                dtype=self.precision.compute,
                attn_implementation=m.attn_implementation,
                device=str(self.device),
            )
            if cfg.teacher.mode == "external" and not grpo
            else None
        )

    def _start(self, resume: bool) -> metrics.MetricsWriter | None:
        """Rank 0 records the config and the data report and opens the metrics sinks."""
        if self.rank != 0:
            return None
        cfg, r = self.cfg, self.data_report
        record_config(self.run_dir, cfg.model_dump(mode="json"), resume=resume)
        (self.run_dir / "data_report.json").write_text(json.dumps({"source": cfg.data.path, **r}))
        print(
            f"data: {r['rows']} rows from {cfg.data.path} (skipped {r['skipped_bad']} bad, "
            f"{r['empty_solution']} with empty privileged info, dropped {r['dropped_empty']})",
            file=sys.stderr,
        )
        return metrics.MetricsWriter(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            config=cfg.model_dump(mode="json"),
            after_step=self.step_num,
        )

    # ------------------------------------------------------------------------------------------
    # The step

    def step(self) -> dict:
        """One optimizer step of OPSD. Returns the step's metrics."""
        cfg, timer, t_start = (
            self.cfg,
            metrics.StepTimer(sync=self.device.type == "cuda"),
            time.perf_counter(),
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        # 1-2. Draw this rank's share of the global batch; roll out n responses to each with the current weights.
        ex_idx = self.cursor.next_indices(self.prompts_per_rank)
        prompts = [self.prompts(i, self.examples[i]) for i in ex_idx]
        with timer("rollout"):
            completions = self.rollout([student for student, _ in prompts])

        # 3. Splice each response, token for token, after the student prompt and the teacher prompt.
        samples = [
            make_sample(
                *prompts[c.prompt_index],
                c.token_ids,
                ex_idx[c.prompt_index],
                c.finish_reason,
                c.logprobs if self.check_lp else None,
            )
            for c in completions
            if c.token_ids
        ]
        tokens, seqs = all_reduce_sum(
            torch.tensor([sum(s.response_len for s in samples), len(samples)], dtype=torch.float64)
        ).tolist()
        adv = (
            self.advantages(completions, ex_idx) if self.reward else None
        )  # GRPO: group-relative, per sample
        batches = pad_microbatches(
            make_microbatches(  # padded to as many on every rank: FSDP's collectives match
                samples,
                max_tokens=self.mb_tokens,
                min_real_frac=cfg.optim.min_real_token_frac,
                pad_id=self.pad_id,
                reduction=self.spec.reduction,
                global_tokens=tokens,
                global_seqs=seqs,
                device=self.device,
            ),
            self.pad_id,
            self.device,
        )

        # 4-7. Per micro-batch: the teacher scores the response, the student reads it, fused loss, backward.
        loss_sum, stats = self.forward_backward(batches, adv, timer=timer)

        # 8. Clip, AdamW, schedule, teacher update, weight sync (all skipped if anything is non-finite).
        with timer("optim"):
            loss_sum, grad_norm, finite = self.optimizer_step(loss_sum)
        self.step_num += 1
        self._last = (completions, ex_idx)
        return self._record(loss_sum, stats, grad_norm, finite, completions, batches, timer, t_start)

    def forward_backward(
        self, batches: list, adv: list[float] | None = None, *, timer=None, backward: bool = True
    ) -> tuple[Tensor, LossStats]:
        """This trainer's micro-batch loop (:func:`forward_backward`) with its model, teacher, loss and
        mixed precision; ``backward=False`` computes the same numbers without gradients."""
        return forward_backward(
            self.model,
            self.teacher,
            batches,
            self.loss,
            adv=adv,
            autocast=self.autocast,
            timer=timer,
            backward=backward,
        )

    def autocast(self):
        """bf16 compute over float32 master weights in one process (FSDP2 casts the gathered weights
        itself); around the model forwards only, never the loss."""
        return precision.autocast(self.precision, self.device) if self.dist.mesh is None else nullcontext()

    def _fsdp_param_dtype(self) -> torch.dtype | None:
        """FSDP2's compute dtype: parallel.param_dtype, or (auto) model.dtype's when it differs from storage."""
        par = self.cfg.parallel.param_dtype
        if par != "auto":
            return models.DTYPES[par]
        return self.precision.compute if self.precision.mixed else None

    def loss(
        self, s_hidden: Tensor, t_hidden: Tensor | None, t_head: Tensor | None, mb, adv: list[float] | None
    ):
        """The distillation loss against the teacher; with GRPO, the policy gradient ``-A log S(y)``."""
        head, chunk, r = full_head_weight(self.model), self.cfg.loss.chunk_size, self.cfg.rollout
        # The rollout check's log S(y) comes from the loss's own logits when they are tempered alike.
        mine = None
        if adv is None and mb.rollout_logprobs is not None and self.spec.temperature == r.temperature:
            mine = torch.full_like(mb.rollout_logprobs, float("nan"))
        if adv is None:
            loss, st = fused_linear_distill(
                s_hidden,
                head,
                t_hidden,
                t_head,
                mb.weights,
                mb.targets,
                self.spec,
                chunk_size=chunk,
                matmul_dtype=self.loss_mm,
                target_logprobs=mine,
            )
        else:
            a = mb.weights.new_tensor(
                [adv[i] for i, n in zip(mb.sample_indices, mb.response_lens) for _ in range(n)]
            )
            loss, st = fused_linear_policy_gradient(
                s_hidden,
                head,
                mb.targets,
                mb.weights * a,
                temperature=self.spec.temperature,
                chunk_size=chunk,
            )
        if mb.rollout_logprobs is not None:  # the train/inference mismatch: engine's log S(y) against ours
            if mine is None or bool(mine.isnan().any()):  # GRPO, another loss temperature, zero-weight rows
                mine = token_logprobs(s_hidden, head, mb.targets, temperature=r.temperature, chunk_size=chunk)
            st.logprob_gap, st.logprob_tokens = (
                float((mine - mb.rollout_logprobs).abs().sum()),
                float(mine.numel()),
            )
        return loss, st

    def advantages(self, completions: list, ex_idx: list[int]) -> list[float]:
        """Each response's reward (its grade against the answer) minus its group's mean, one entry per
        non-empty response (the samples); records the step's mean reward and flat-group fraction."""
        rewards = [
            self.reward(
                self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                self.examples[ex_idx[c.prompt_index]].answer,
            )
            for c in completions
        ]
        groups = [c.prompt_index for c in completions]
        adv = group_advantages(rewards, groups, scale=self.cfg.grpo.scale_rewards)
        self._grpo_sums = [
            sum(rewards),
            len(rewards),
            flat_group_fraction(rewards, groups) * len(set(groups)),
            len(set(groups)),
        ]
        return [a for a, c in zip(adv, completions) if c.token_ids]

    def rollout(self, prompts: list[list[int]]) -> list:
        """``rollout.n`` responses per prompt, seeded by step and rank: a resume samples what a run would have."""
        r = self.cfg.rollout
        seed = (distributed.rank_seed(self.cfg.seed, self.rank) * 1_000_003 + self.step_num * 7919) % 2**63
        params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_strings=list(r.stop_strings),
            seed=seed,
        )
        self.engine.wake()
        completions = self.engine.generate(prompts, r.n, params)
        self.engine.sleep()
        return completions

    def optimizer_step(self, loss_sum: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Clip and step. FSDP summed the gradients over ranks (the loss weights are normalized by global token
        counts); norm and loss are global, so all ranks decide alike. A non-finite loss or gradient skips the
        update but still consumes the batch and advances the LR schedule (same data order and schedule)."""
        grad_norm = parallel.clip_grad_norm(self.params, self.cfg.optim.grad_clip or float("inf"))
        loss_sum = all_reduce_sum(loss_sum)
        finite = bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.bad_steps = 0 if finite else self.bad_steps + 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if finite:
            self.teacher.update()
            self.engine.sync_weights(self.model)
        else:
            warnings.warn(
                f"step {self.step_num + 1}: non-finite loss or gradient norm; update skipped", stacklevel=3
            )
        return loss_sum, grad_norm, finite

    def _record(self, loss_sum, stats, grad_norm, finite, completions, batches, timer, t_start) -> dict:
        """The step's metrics over all ranks, from one sum: loss statistics, token counts, prompt truncation,
        and each rank's response lengths and truncation flags in its own slots (all ranks have as many)."""
        n, work = (
            len(completions),
            [f"{k}_{w}_tokens" for k in ("teacher", "student") for w in ("real", "padded")],
        )
        mine = torch.zeros(self.world, n, 2, dtype=torch.float64)
        mine[self.rank] = torch.tensor([[len(c.token_ids), c.finish_reason == "length"] for c in completions])
        counts = [sum(getattr(mb, w) for mb in batches) for w in work] + list(self.prompts.truncated.values())
        counts += self._grpo_sums if self.reward else []  # reward sum and count, flat groups and groups
        parts = [stats.as_tensor(), torch.tensor(counts, dtype=torch.float64), mine.flatten()]
        total, counts, per_sample = all_reduce_sum(torch.cat(parts)).split([len(x) for x in parts])
        stats, grpo, counts = (
            LossStats.from_tensor(total),
            counts[6:].tolist(),
            [int(x) for x in counts[:6].tolist()],
        )
        lens, cut = per_sample.view(-1, 2).long().T.tolist()
        rec = metrics.step_record(
            step=self.step_num,
            loss=float(loss_sum),
            loss_stats=stats.means(),
            grad_norm=float(grad_norm),
            lr=self.scheduler.get_last_lr()[0],
            response_lens=lens,
            truncated=sum(cut),
            tokens=int(stats.tokens),
            real_tokens={"teacher": counts[0], "student": counts[2]},
            padded_tokens={"teacher": counts[1], "student": counts[3]},
            skipped=not finite,
            prompt_truncated=dict(zip(self.prompts.truncated, counts[4:])),
            epoch=self.cursor.epoch,
            times=timer.times,
            elapsed=time.perf_counter() - t_start,
            peak_mem_gb=metrics.peak_memory_gb(self.device),
        )
        return rec | (
            {"reward_mean": grpo[0] / max(1, grpo[1]), "flat_group_frac": grpo[2] / max(1, grpo[3])}
            if grpo
            else {}
        )

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
        history: list[dict] = []
        bar = tqdm(
            total=cfg.optim.max_steps,
            initial=self.step_num,
            desc="opsd train",
            unit="step",
            disable=not cfg.logging.progress or self.rank != 0,
            dynamic_ncols=True,
            leave=end == cfg.optim.max_steps,
        )
        self.stop.requested = None
        try:
            with self.stop:
                while self.step_num < end:
                    rec = self.step()
                    if cfg.eval.every and self.step_num % cfg.eval.every == 0:
                        rec.update(self.evaluate())
                    history.append(rec)
                    self._log(rec, bar)
                    if self.bad_steps >= cfg.optim.max_bad_steps:
                        raise TrainingError(
                            f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (limit "
                            f"optim.max_bad_steps={cfg.optim.max_bad_steps}); stopping. Last good checkpoint: "
                            f"{checkpoint.latest_checkpoint(self.run_dir) or 'none yet'}. Try a lower optim.lr, "
                            "loss.clip, or model.dtype=float32."
                        )
                    if distributed.any_rank(
                        self.stop.requested is not None
                    ):  # a signal on any rank stops all after this step
                        self.stop.requested = self.stop.requested or "a signal to another rank"
                    every = cfg.checkpoint.every if cfg.checkpoint.enabled else 0
                    due = cfg.checkpoint.enabled and (
                        (every and self.step_num % every == 0) or self.step_num == end or self.stop.requested
                    )
                    if due and self.bad_steps == 0:
                        self.save()
                    if self.stop.requested:
                        if self.rank == 0:
                            print(
                                f"\nstopped by {self.stop.requested} after step {self.step_num}; resume with:\n"
                                f"  opsd train --resume {self.run_dir}",
                                file=sys.stderr,
                            )
                        break
        finally:
            bar.close()
            if self.metrics is not None:
                self.metrics.close()
        return history

    stopped = property(
        lambda self: self.stop.requested is not None, doc="The last ``train()`` ended on a signal."
    )

    def _log(self, rec: dict, bar) -> None:
        if self.metrics is not None:
            self.metrics.write(rec)
            metrics.show_step(bar, rec, lines=self.cfg.logging.step_lines)
            if self.cfg.logging.sample_every and rec["step"] % self.cfg.logging.sample_every == 0:
                shown = self._last[0][: self.cfg.logging.num_samples]
                metrics.write_samples(
                    self.run_dir / "samples.jsonl",
                    rec["step"],
                    [self.examples[self._last[1][c.prompt_index]] for c in shown],
                    [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in shown],
                    [c.finish_reason for c in shown],
                    show=self.cfg.logging.step_lines,
                )

    def evaluate(self) -> dict:
        """Held-out accuracy of the live model, without privileged information, sharded over ranks."""
        from opsd.eval import evaluate_sharded

        e = self.cfg.eval
        res = evaluate_sharded(
            self.model,
            self.tokenizer,
            self.eval_examples,
            rank=self.rank,
            world=self.world,
            k=e.k,
            temperature=e.temperature,
            max_new_tokens=e.max_new_tokens,
            instruction=self.cfg.data.instruction,
            enable_thinking=self.cfg.data.student_thinking,
            seed=distributed.rank_seed(self.cfg.seed, self.rank),
            engine=self.engine,
        )
        self.engine.sleep()  # generate() woke it: the checkpoint save and the next step run without vLLM resident
        return res.metrics(prefix="eval/")

    # ------------------------------------------------------------------------------------------
    # Setup, checkpoints

    def save(self) -> Path:
        """Every rank calls it: the checkpoint is written together (see :mod:`opsd.checkpoint`)."""
        shared = {
            "format": checkpoint.FORMAT,
            "step": self.step_num,
            "bad_steps": self.bad_steps,
            "scheduler": self.scheduler.state_dict(),
            "cursor": self.cursor.state_dict(),
        }
        return checkpoint.save_checkpoint(
            self.run_dir,
            self.step_num,
            self.model,
            self.tokenizer,
            shared,
            optimizer=self.optimizer,
            rank_state={"truncated": self.prompts.state_dict()},
            tensors=self.teacher.tensors(),
            keep_last=self.cfg.checkpoint.keep_last,
            save_merged=self.cfg.checkpoint.save_merged,
        )

    def _resume(self) -> None:
        """Continue exactly, at the checkpoint's number of ranks or another (everything reshards)."""
        ckpt = checkpoint.latest_checkpoint(self.run_dir)
        checkpoint.check_format(ckpt)
        state, mine = checkpoint.load_checkpoint(
            ckpt,
            self.model,
            self.optimizer,
            tensors=self.teacher.tensors(),
            seed=distributed.rank_seed(self.cfg.seed, self.rank),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        self.step_num, self.bad_steps = state["step"], state["bad_steps"]
        self.prompts.load_state_dict(mine.get("truncated", {"student": 0, "teacher": 0}))  # empty: a new rank
        self.engine.sync_weights(self.model)
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {self.step_num}", file=sys.stderr)

    def close(self) -> None:
        """Shut the rollout engine down while the process group still exists (vLLM's teardown uses it);
        call before :func:`opsd.distributed.shutdown`. Safe to call twice."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
