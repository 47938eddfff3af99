"""The OPSD trainer. ``Trainer.step`` is the whole algorithm, top to bottom.

    draw problems -> student rollouts -> splice responses after both prompts -> per micro-batch:
    teacher hidden states (no grad) -> student hidden states -> chunked fused-linear loss ->
    backward -> clip -> AdamW step -> LR schedule -> teacher update / weight sync

Everything else (loading, checkpoints, the run directory, metrics) sits behind named functions in
the modules it imports.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from opsd import checkpoint, distributed
from opsd.config import Config
from opsd.data import DataCursor, PromptBuilder, load_examples, make_microbatches, make_sample
from opsd.distributed import all_reduce_sum, forward_hidden, full_head_weight, pad_microbatches
from opsd.errors import TrainingError
from opsd.loss import LossStats, fused_linear_distill
from opsd.metrics import (
    MetricsWriter,
    StepTimer,
    format_step_line,
    peak_memory_gb,
    step_record,
    write_samples,
)
from opsd.models import (
    DTYPES,
    apply_lora,
    check_plain_head,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    resolve_device,
)
from opsd.optim import make_optimizer
from opsd.rollout import SamplingParams, make_engine
from opsd.rundir import GracefulStop, prepare_run_dir, record_config
from opsd.teacher import Teacher

__all__ = ["Trainer", "TrainingError"]


class Trainer:
    """Builds everything from a :class:`Config`, then ``train()``.

    ``resume=True`` continues the latest checkpoint in ``logging.run_dir`` exactly;
    ``overwrite=True`` deletes an existing run directory first. Without either, an existing
    run directory is refused. ``dist`` is this process's place among torchrun's ranks
    (:func:`opsd.distributed.init_distributed`); without it the trainer is one process on
    ``cfg.device``, whatever process group may exist.
    """

    def __init__(self, cfg: Config, *, resume: bool = False, overwrite: bool = False, dist: distributed.Dist | None = None) -> None:
        self.cfg, self.dist = cfg, dist or distributed.Dist(device=resolve_device(cfg.device))
        self.rank, self.world, self.device = self.dist.rank, self.dist.world_size, self.dist.device
        self.run_dir = Path(cfg.logging.run_dir)
        torch.manual_seed(cfg.seed)  # the same on every rank: LoRA's initial weights must agree before sharding
        # Run directory, data, tokenizer and model: a failure on any rank ends every rank with its message.
        distributed.run_setup(lambda: self._load(resume, overwrite), "setup")
        m = cfg.model
        self.teacher = Teacher(
            cfg.teacher.mode, self.model, lora=m.lora.enabled, ema_decay=cfg.teacher.ema_decay,
            external=self._external, frozen_copy=cfg.teacher.frozen_copy,
            shard=self._shard if self.dist.mesh is not None else None,
        )
        if self.rank:  # dropout and anything else random differs per rank; rank 0 draws as one process does
            torch.manual_seed(distributed.rank_seed(cfg.seed, self.rank))
        self.spec = cfg.loss.to_spec(cfg.rollout.temperature)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer, self.scheduler = make_optimizer(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, warmup=o.warmup_steps,
            total=o.max_steps, schedule=o.scheduler, min_ratio=o.min_lr_ratio,
        )
        self.engine = distributed.run_setup(lambda: make_engine(cfg.rollout, self.model, self.tokenizer, seed=cfg.seed,
                                                    max_prompt_len=cfg.data.max_prompt_len), "rollout engine start")
        self.step_num = 0
        self.bad_steps = 0
        self.stop = GracefulStop()
        if resume and checkpoint.latest_checkpoint(self.run_dir) is not None:
            self._resume()
        self.metrics = distributed.run_setup(lambda: self._start(resume), "run directory setup")

    def _load(self, resume: bool, overwrite: bool) -> None:
        cfg, d, m = self.cfg, self.cfg.data, self.cfg.model
        self.prompts_per_rank = cfg.rollout.prompts_per_rank(self.world)
        if self.rank == 0:
            prepare_run_dir(self.run_dir, resume=resume, overwrite=overwrite,
                            has_checkpoint=checkpoint.latest_checkpoint(self.run_dir) is not None)
            checkpoint.clean_partial(self.run_dir)
        # Data: rows, a resumable cursor sharded by rank, prompts tokenized once per example.
        report = load_examples(
            d.path, problem_key=d.problem_key, solution_key=d.solution_key if cfg.teacher.privileged else None,
            answer_key=d.answer_key, split=d.split, skip_bad_rows=d.skip_bad_rows,
            drop_empty_solution=d.drop_empty_solution,
        )
        self.examples = report.examples
        self.data_report = {"rows": len(report.examples), "skipped_bad": report.skipped_bad,
                            "empty_solution": report.empty_solution, "dropped_empty": report.dropped_empty}
        self.cursor = DataCursor(len(self.examples), seed=cfg.seed, rank=self.rank, world_size=self.world,
                                 shuffle=d.shuffle)
        self.eval_examples = self._load_eval_examples() if cfg.eval.path else []
        # Model: the student (LoRA or full), its tokenizer, and an external teacher.
        self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self.prompts = PromptBuilder.from_config(self.tokenizer, d, privileged=cfg.teacher.privileged)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model = load_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                                device=str(self.device), trust_remote_code=m.trust_remote_code)
        if m.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if m.lora.enabled:
            self.model = apply_lora(self.model, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout,
                                    target_modules=m.lora.target_modules,
                                    gradient_checkpointing=m.gradient_checkpointing)
        self.model.train()
        check_plain_head(self.model)
        self._external = Teacher.load_external(
            cfg.teacher.path, m.path, self.tokenizer.get_vocab(), dtype=m.dtype,
            attn_implementation=m.attn_implementation, device=str(self.device),
        ) if cfg.teacher.mode == "external" else None

    def _shard(self, module: nn.Module, cpu_offload: bool) -> nn.Module:
        """FSDP2 over this run's mesh with the ``parallel:`` mixed-precision settings."""
        p = self.cfg.parallel
        return distributed.shard_model(module, self.dist.mesh, param_dtype=None if p.param_dtype == "auto" else DTYPES[p.param_dtype],
                           reduce_dtype=DTYPES[p.reduce_dtype], cpu_offload=cpu_offload and self.device.type == "cuda")

    def _start(self, resume: bool) -> MetricsWriter | None:
        """Rank 0 records the config and the data report and opens the metrics sinks."""
        if self.rank != 0:
            return None
        cfg, r = self.cfg, self.data_report
        record_config(self.run_dir, cfg.model_dump(mode="json"), resume=resume)
        (self.run_dir / "data_report.json").write_text(json.dumps({"source": cfg.data.path, **r}))
        print(f"data: {r['rows']} rows from {cfg.data.path} (skipped {r['skipped_bad']} bad, "
              f"{r['empty_solution']} with empty privileged info, dropped {r['dropped_empty']})", file=sys.stderr)
        return MetricsWriter(
            self.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project, config=cfg.model_dump(mode="json"), after_step=self.step_num,
        )

    # ------------------------------------------------------------------------------------------
    # The step

    def step(self) -> dict:
        """One optimizer step of OPSD. Returns the step's metrics."""
        cfg, timer, t_start = self.cfg, StepTimer(sync=self.device.type == "cuda"), time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        # 1-2. Draw this rank's share of the global batch; roll out n responses to each with the current weights.
        ex_idx = self.cursor.next_indices(self.prompts_per_rank)
        prompts = [self.prompts(i, self.examples[i]) for i in ex_idx]
        with timer("rollout"):
            completions = self.rollout([student for student, _ in prompts])

        # 3. Splice each response, token for token, after the student prompt and the teacher prompt.
        samples = [make_sample(*prompts[c.prompt_index], c.token_ids, ex_idx[c.prompt_index], c.finish_reason)
                   for c in completions if c.token_ids]
        tokens, seqs = all_reduce_sum(torch.tensor(
            [sum(s.response_len for s in samples), len(samples)], dtype=torch.float64)).tolist()
        batches = make_microbatches(samples, max_tokens=cfg.optim.max_tokens_per_microbatch, pad_id=self.pad_id,
                                    reduction=self.spec.reduction, global_tokens=tokens, global_seqs=seqs,
                                    device=self.device)
        batches = pad_microbatches(batches, self.pad_id, self.device)  # as many on every rank, for FSDP

        # 4-7. Per micro-batch: the teacher scores the response, the student reads it, fused loss, backward.
        loss_sum, stats = torch.zeros((), dtype=torch.float64), LossStats()
        for mb in batches:
            with timer("teacher"):
                t_hidden, t_head = self.teacher.score(mb.teacher_ids, mb.teacher_mask, mb.teacher_pos)
            with timer("student"):
                s_hidden = forward_hidden(self.model, mb.student_ids, mb.student_mask, mb.student_pos)
            with timer("loss"):
                loss, st = fused_linear_distill(s_hidden, full_head_weight(self.model), t_hidden, t_head, mb.weights,
                                                mb.targets, self.spec, chunk_size=cfg.loss.chunk_size)
            with timer("student"):
                loss.backward()
            loss_sum += loss.detach().double().cpu()
            stats.add(st if mb.sample_indices else LossStats())  # a zero-weight padding micro-batch adds nothing

        # 8. Clip, AdamW, schedule, teacher update, weight sync (all skipped if anything is non-finite).
        with timer("optim"):
            loss_sum, grad_norm, finite = self.optimizer_step(loss_sum)
        self.step_num += 1
        self._last = (completions, ex_idx)
        return self._record(loss_sum, stats, grad_norm, finite, completions, batches, timer, t_start)

    def rollout(self, prompts: list[list[int]]) -> list:
        """``rollout.n`` responses per prompt. The seed depends on the step and the rank only, so a
        resumed run samples exactly what an uninterrupted one would (at the same number of ranks)."""
        r = self.cfg.rollout
        seed = (distributed.rank_seed(self.cfg.seed, self.rank) * 1_000_003 + self.step_num * 7919) % 2**63
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, stop_strings=list(r.stop_strings), seed=seed)
        self.engine.wake()
        completions = self.engine.generate(prompts, r.n, params)
        self.engine.sleep()
        return completions

    def optimizer_step(self, loss_sum: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Clip and step. Under FSDP the gradients arrive summed over ranks (the loss weights were
        normalized by the global token count, so the sum is the one-big-batch gradient); the norm and
        the loss are global, so every rank takes the same decision. A non-finite loss or gradient
        skips the update but still consumes the batch and advances the LR schedule, so a resumed or
        skipped run stays on the same data order and schedule."""
        self.teacher.release()
        grad_norm = distributed.clip_grad_norm(self.params, self.cfg.optim.grad_clip or float("inf"))
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
            warnings.warn(f"step {self.step_num + 1}: non-finite loss or gradient norm; update skipped", stacklevel=3)
        return loss_sum, grad_norm, finite

    def _record(self, loss_sum, stats, grad_norm, finite, completions, batches, timer, t_start) -> dict:
        """The step's metrics over all ranks, from one sum: loss statistics, token counts, prompt
        truncation, and every rank's response lengths and truncation flags (each rank fills its own
        slots; every rank has as many completions)."""
        n, work = len(completions), [f"{k}_{w}_tokens" for k in ("teacher", "student") for w in ("real", "padded")]
        mine = torch.zeros(self.world, n, 2, dtype=torch.float64)
        mine[self.rank] = torch.tensor([[len(c.token_ids), c.finish_reason == "length"] for c in completions])
        counts = [sum(getattr(mb, w) for mb in batches) for w in work] + list(self.prompts.truncated.values())
        parts = [stats.as_tensor(), torch.tensor(counts, dtype=torch.float64), mine.flatten()]
        total, counts, per_sample = all_reduce_sum(torch.cat(parts)).split([len(x) for x in parts])
        stats, counts = LossStats.from_tensor(total), [int(x) for x in counts.tolist()]
        lens, cut = per_sample.view(-1, 2).long().T.tolist()
        return step_record(
            step=self.step_num, loss=float(loss_sum), loss_stats=stats.means(), grad_norm=float(grad_norm),
            lr=self.scheduler.get_last_lr()[0], response_lens=lens, truncated=sum(cut), tokens=int(stats.tokens),
            real_tokens={"teacher": counts[0], "student": counts[2]},
            padded_tokens={"teacher": counts[1], "student": counts[3]},
            skipped=not finite, prompt_truncated=dict(zip(self.prompts.truncated, counts[4:])), epoch=self.cursor.epoch,
            times=timer.times, elapsed=time.perf_counter() - t_start, peak_mem_gb=peak_memory_gb(self.device),
        )

    # ------------------------------------------------------------------------------------------
    # The loop

    def train(self, until_step: int | None = None) -> list[dict]:
        """Run to ``optim.max_steps`` (or ``until_step``); checkpoint every K steps and at the end."""
        cfg = self.cfg
        end = min(cfg.optim.max_steps, until_step or cfg.optim.max_steps)
        if self.step_num >= cfg.optim.max_steps and self.rank == 0:
            print(f"{self.run_dir} is complete: it reached optim.max_steps={cfg.optim.max_steps}. To train "
                  f"further: opsd train --resume {self.run_dir} optim.max_steps=N (N > {self.step_num})",
                  file=sys.stderr)
        history: list[dict] = []
        bar = tqdm(total=cfg.optim.max_steps, initial=self.step_num, desc="opsd train", unit="step",
                   disable=not cfg.logging.progress or self.rank != 0, dynamic_ncols=True)
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
                            f"{checkpoint.latest_checkpoint(self.run_dir) or 'none yet'}. Try a lower optim.lr, loss.clip, "
                            "or model.dtype=float32."
                        )
                    if distributed.any_rank(self.stop.requested is not None):  # a signal on any rank stops all after this step
                        self.stop.requested = self.stop.requested or "a signal to another rank"
                    every = cfg.checkpoint.every if cfg.checkpoint.enabled else 0
                    due = cfg.checkpoint.enabled and (
                        (every and self.step_num % every == 0) or self.step_num == end or self.stop.requested)
                    if due and self.bad_steps == 0:
                        self.save()
                    if self.stop.requested:
                        if self.rank == 0:
                            print(f"\nstopped by {self.stop.requested} after step {self.step_num}; resume with:\n"
                                  f"  opsd train --resume {self.run_dir}", file=sys.stderr)
                        break
        finally:
            bar.close()
            if self.metrics is not None:
                self.metrics.close()
        return history

    @property
    def stopped(self) -> bool:
        """True when the last ``train()`` ended on a Ctrl-C / SIGTERM."""
        return self.stop.requested is not None

    def _log(self, rec: dict, bar) -> None:
        if self.metrics is None:
            return
        self.metrics.write(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.4f}", div=f"{rec['divergence']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        tqdm.write(format_step_line(rec), file=sys.stderr)
        if self.cfg.logging.sample_every and rec["step"] % self.cfg.logging.sample_every == 0:
            completions, ex_idx = self._last
            shown = completions[: self.cfg.logging.num_samples]
            write_samples(self.run_dir / "samples.jsonl", rec["step"], [self.examples[ex_idx[c.prompt_index]] for c in shown],
                          [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in shown],
                          [c.finish_reason for c in shown])

    def evaluate(self) -> dict:
        """Held-out accuracy of the live model, without privileged information. Each rank grades an
        equal share of the problems (topped up with repeats that are not counted: sharded generation
        runs in step on every rank) and the counts are summed over ranks."""
        from opsd.eval import evaluate_model

        e, k, share = self.cfg.eval, self.cfg.eval.k, -(-len(self.eval_examples) // self.world)
        mine = self.eval_examples[self.rank * share : (self.rank + 1) * share]
        res = evaluate_model(
            self.model, self.tokenizer, mine + self.eval_examples[: share - len(mine)], k=k, temperature=e.temperature,
            max_new_tokens=e.max_new_tokens, instruction=self.cfg.data.instruction,
            enable_thinking=self.cfg.data.student_thinking, seed=distributed.rank_seed(self.cfg.seed, self.rank), engine=self.engine,
        )
        rows = [[1, sum(it["correct"]), it[f"pass@{k}"], sum(it["response_tokens"]), it["finish_reasons"].count("length"),
                 it["extracted"].count(None), len(it["errors"]) - it["errors"].count(None)] for it in res.items[: len(mine)]]
        sums = torch.tensor(rows, dtype=torch.float64).reshape(-1, 7).sum(0)
        n, right, passed, length, cut, none, errors = all_reduce_sum(sums).tolist()
        return replace(res, num_problems=int(n), avg_at_k=right / (n * k), pass_at_k=passed / n,
                       resp_len_mean=length / (n * k), truncated_frac=cut / (n * k), no_answer_frac=none / (n * k),
                       grading_errors=int(errors)).metrics(prefix="eval/")

    # ------------------------------------------------------------------------------------------
    # Setup, checkpoints

    def _load_eval_examples(self) -> list:
        """Validated at startup, like the training data, so a bad eval file fails before any compute."""
        e = self.cfg.eval
        rep = load_examples(e.path, problem_key=self.cfg.data.problem_key, solution_key=None,
                            answer_key=e.answer_key, require_answer=True)
        return rep.examples[: e.limit] if e.limit else rep.examples

    def save(self) -> Path:
        """Every rank calls it: the checkpoint is written together (see :mod:`opsd.checkpoint`)."""
        shared = {"step": self.step_num, "bad_steps": self.bad_steps, "scheduler": self.scheduler.state_dict(),
                  "cursor": self.cursor.state_dict()}
        return checkpoint.save_checkpoint(
            self.run_dir, self.step_num, self.model, self.tokenizer, shared, optimizer=self.optimizer,
            rank_state={"truncated": self.prompts.state_dict()}, tensors=self.teacher.tensors(),
            keep_last=self.cfg.checkpoint.keep_last, save_merged=self.cfg.checkpoint.save_merged,
        )

    def _resume(self) -> None:
        """Continue exactly, at the checkpoint's number of ranks or another (everything reshards)."""
        ckpt = checkpoint.latest_checkpoint(self.run_dir)
        state, mine = checkpoint.load_checkpoint(ckpt, self.model, self.optimizer, tensors=self.teacher.tensors(),
                                                 seed=distributed.rank_seed(self.cfg.seed, self.rank))
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        self.step_num, self.bad_steps = state["step"], state["bad_steps"]
        if mine:  # a rank the saving run had: its own count of truncated prompts
            self.prompts.load_state_dict(mine["truncated"])
        self.engine.sync_weights(self.model)
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {self.step_num}", file=sys.stderr)
