"""The OPSD trainer. ``Trainer.step`` is the whole algorithm, top to bottom: draw problems -> student
rollouts -> splice responses after both prompts -> per micro-batch: teacher hidden states (no grad) ->
student hidden states -> chunked fused-linear loss -> backward -> clip -> AdamW -> schedule -> teacher
update / weight sync. Everything else sits behind named functions in the modules it imports.
"""

from __future__ import annotations

import json
import sys
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from opsd import checkpoint, distributed, metrics, models, parallel, precision
from opsd.config import Config, resolve_engine
from opsd.data import DataCursor, PromptBuilder, load_examples, make_microbatches, make_sample
from opsd.data.batching import MicroBatch, pad_microbatches
from opsd.devices import bucket_widths, per_row_from, release_freed_memory, resolve_device, reuse_freed_memory
from opsd.distributed import all_reduce_sum
from opsd.engines import make_engine
from opsd.errors import TrainingError, UserError
from opsd.grading import as_grade, resolve_grader
from opsd.loss import LossStats
from opsd.objectives import Objective, Scores, loss_chunk_size, make_distillation, make_objective
from opsd.optim import make_optimizer
from opsd.parallel import forward_hidden, full_head_weight, parallelize
from opsd.rollout import Completion, EngineError, SamplingParams, VLLMEngine
from opsd.rundir import GracefulStop, prepare_run_dir, record_config
from opsd.teacher import Teacher

__all__ = ["StepOutputs", "Trainer", "TrainingError", "forward_backward"]


def forward_backward(
    model,
    teacher: Teacher | None,
    batches: list,
    loss_fn,
    *,
    scores: Scores | None = None,
    autocast=nullcontext,
    timer=None,
    backward: bool = True,
) -> tuple[Tensor, LossStats]:
    """The micro-batch loop of a step: per micro-batch, the teacher's hidden states (no grad) -> the
    student's -> ``loss_fn(s_hidden, t_hidden, t_head, mb, scores)`` -> backward. Returns the summed
    loss (float64, this rank's) and the loss statistics. ``backward=False`` computes the same numbers
    without gradients (held-out divergence); ``teacher=None``: an objective without a teacher (GRPO
    alone); ``scores``: what the objective read from the rollouts, handed to ``loss_fn``;
    ``autocast``: a context for the forwards (one process's bf16 compute). The trainer's step, the
    distributed tests and bench/smollm2_opsd.py run it; no other copy of this loop exists."""
    timer = timer or metrics.StepTimer(sync=False)
    loss_sum = torch.zeros((), dtype=torch.float64)
    stats = LossStats()
    with torch.enable_grad() if backward else torch.no_grad():
        for mb in batches:
            t_hidden, t_head = None, None
            if teacher is not None:
                with timer("teacher"), autocast():
                    t_hidden, t_head = teacher.score(
                        mb.teacher_ids, mb.teacher_mask, mb.teacher_pos, mb.teacher_rows
                    )
            with timer("student"), autocast():
                s_hidden = forward_hidden(
                    model, mb.student_ids, mb.student_mask, mb.student_pos, mb.student_rows
                )
            with timer("loss"):
                loss, st = loss_fn(s_hidden, t_hidden, t_head, mb, scores)
            if backward:
                with timer("student"):
                    loss.backward()
            loss_sum += loss.detach().double().cpu()
            # A zero-weight padding micro-batch adds nothing.
            stats.add(st if mb.sample_indices else LossStats())
    if teacher is not None:
        # A sharded teacher network never runs backward, when FSDP would free its root.
        teacher.release()
    return loss_sum, stats


@dataclass
class StepOutputs:
    """What one optimizer step produced on this rank; :meth:`Trainer.record` turns it into the
    step's metrics over all ranks."""

    completions: list[Completion]
    example_indices: list[int]  # the example each prompt came from
    batches: list[MicroBatch]
    scores: Scores
    loss_sum: Tensor  # global (summed over ranks)
    stats: LossStats  # this rank's
    grad_norm: Tensor
    finite: bool
    timer: metrics.StepTimer  # the phases' wall times
    policy_lag: float = 0.0  # optimizer steps between the sampling weights and the trained ones


@dataclass
class Pending:
    """Rollouts requested one step ahead (``rollout.overlap``): the problems, and the engine's handle
    until the responses are collected."""

    example_indices: list[int]
    prompts: list[tuple[list[int], list[int]]]
    handle: Any = None
    completions: list[Completion] | None = None


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
        self.cfg = cfg
        self.dist = dist or distributed.Dist(device=distributed.use_device(resolve_device(cfg.device)))
        self.rank = self.dist.rank
        self.world = self.dist.world_size
        self.device = self.dist.device
        self.run_dir = Path(cfg.logging.run_dir)
        # The same seed on every rank: LoRA's initial weights must agree before sharding.
        torch.manual_seed(cfg.seed)
        # What is trained for: distillation, GRPO, or both; it says what it needs from data and teacher.
        engine_kind = resolve_engine(cfg.rollout.engine)[0]
        loss_chunk = loss_chunk_size(cfg.loss.chunk_size, self.device, engine_kind)
        self.objective = make_objective(cfg, loss_chunk)
        # The held-out divergence (eval.divergence) is distillation's, whatever the objective.
        self.heldout = make_distillation(cfg, loss_chunk)
        grader = resolve_grader(cfg.eval.grader, "eval.grader")
        self.eval_grader = lambda response, gold: as_grade(grader(response, gold))
        if cfg.model.compile:  # refused before anything loads
            if self.dist.mesh is not None:
                raise UserError("model.compile=true runs in one process, not under torchrun: set it false")
            models.check_compiler(self.device)
        # Run directory, data, tokenizer and model: a failure on any rank ends every rank with its message.
        distributed.run_setup(lambda: self._load(resume, overwrite), "setup")
        # Without a teacher term the teacher runs only for eval.divergence: the initial policy where it
        # costs nothing (LoRA, adapter off), the live one otherwise (no second copy of the weights).
        no_term = "fixed" if cfg.model.lora.enabled else "live"
        self.teacher = Teacher(
            cfg.teacher.mode if self.objective.uses_teacher else no_term,
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
        if self.dist.mesh is None and self.device.type == "cpu":  # faster CPU GEMMs on frozen weights
            # Column-major only where this process decodes: a weight sync into vLLM would transpose.
            models.frozen_weights_for_cpu(self.model, self.teacher.model, column_major=engine_kind == "hf")
        if cfg.model.compile:  # after the weights' last change of layout, which the compiled code assumes
            n = models.compile_layers(self.model, self.teacher.model)
            print(f"model.compile: {n} decoder layers compile at the first step", file=sys.stderr)
        else:  # compiled layers fuse the norms themselves
            models.lean_rms_norms(self.model, self.teacher.model)
        self.teacher.start()  # the EMA snapshot, of the student as sharded
        if self.rank:  # dropout and anything else random differs per rank; rank 0 draws as one process does
            torch.manual_seed(distributed.rank_seed(cfg.seed, self.rank))
        self.spec = cfg.loss.to_spec(cfg.rollout.temperature)
        self.check_lp = cfg.rollout.checks_logprobs()
        # The loss's matrix products in bf16 only on bf16 units.
        self.loss_mm = precision.loss_matmul_dtype(self.precision, self.device)
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
                ranks=self.dist,
                run_dir=cfg.logging.run_dir,
            ),
            "rollout engine start",
        )
        beside_vllm = isinstance(self.engine, VLLMEngine)  # colocated: its copy and cache in this process
        self.engine.sleep()  # the budget is measured without vLLM resident (rollout() wakes it) ...
        # ... and with room for AdamW's moments.
        adam_bytes = 2 * 4 * sum(parallel.local_numel(p) for p in self.params)
        self.mb_tokens, why = models.microbatch_budget(
            o.max_tokens_per_microbatch,
            models.base_model(self.model).config,
            self.precision.compute,
            self.device,
            cfg.model.gradient_checkpointing,
            reserve=adam_bytes,
            beside_vllm=beside_vllm,
        )
        if self.rank == 0:
            print(f"micro-batches: up to {self.mb_tokens} padded tokens ({why})", file=sys.stderr)
        # The heap trims keep an HF-engine CPU step under 2 GiB. Beside the colocated vLLM engine (near
        # 4 GiB resident anyway) they made every step fault its activations and loss blocks afresh:
        # ~1.3 s of a 12.7 s bf16 step (docs/benchmarks.md, "Heap trims beside vLLM"); there glibc is
        # also kept from trimming the heap by itself after the loop (forward_backward's keep_pages).
        self.trim_heap = not beside_vllm
        sharded = self.dist.mesh is not None
        self.per_row_from = per_row_from(self.device, sharded, models.non_embedding_params(self.model))
        if self.per_row_from is not None and not cfg.model.compile:  # compiled layers keep a forward per row
            models.pack_rows(self.model, self.teacher.model)
        self.step_num = 0
        self.bad_steps = 0
        self.stop = GracefulStop()
        self.pending: Pending | None = None  # rollout.overlap: the next step's rollouts, in flight
        self.progress_desc = "opsd train"  # the progress bar's label (opsd compare: method and seed)
        if resume and checkpoint.latest_checkpoint(self.run_dir) is not None:
            self._resume()
        self.metrics = distributed.run_setup(lambda: self._start(resume), "run directory setup")

    def _load(self, resume: bool, overwrite: bool) -> None:
        cfg = self.cfg
        d = cfg.data
        m = cfg.model
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
        # Solutions only where a teacher reads them; answers where the objective grades against them.
        privileged = cfg.teacher.privileged and self.objective.uses_teacher
        report = load_examples(
            d.path,
            problem_key=d.problem_key,
            solution_key=d.solution_key if privileged else None,
            answer_key=d.answer_key,
            split=d.split,
            skip_bad_rows=d.skip_bad_rows,
            drop_empty_solution=d.drop_empty_solution,
            require_answer=self.objective.needs_answers,
        )
        self.examples = report.examples
        if cfg.teacher.solution_source == "other":
            # A control: each problem comes with the next row's solution.
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
        # Held-out problems, validated at startup like the training data, so a bad file fails before any
        # compute.
        e = cfg.eval
        self.eval_examples = (
            load_examples(
                e.path,
                problem_key=d.problem_key,
                # Solutions only for the held-out divergence: accuracy never shows them to the student.
                solution_key=d.solution_key if e.divergence else None,
                answer_key=e.answer_key,
                require_answer=True,
            ).examples[: e.limit]
            if e.path
            else []
        )
        # Model: the student (LoRA or full), its tokenizer, and an external teacher.
        self.tokenizer = models.load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self.prompts = PromptBuilder.from_config(self.tokenizer, d, privileged=cfg.teacher.privileged)
        self.eval_prompts = PromptBuilder.from_config(self.tokenizer, d, privileged=True)
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
            if cfg.teacher.mode == "external" and self.objective.uses_teacher
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

    def step(self) -> StepOutputs:
        """One optimizer step of the objective (OPSD by default); :meth:`record` makes its metrics."""
        timer = metrics.StepTimer.for_step(self.device)

        # 1-2. Draw this rank's share of the global batch; roll out n responses to each (with
        # rollout.overlap, requested one step ago and the next step's requested now).
        ex_idx, prompts, completions, lag = self.rollouts(timer)

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
        # What the objective reads from the rollouts as a whole (GRPO: rewards, group advantages).
        answers = [self.examples[i].answer for i in ex_idx]
        scores = self.objective.score(completions, answers, self.decode)
        batches = self.microbatches(samples)

        # 4-7. Per micro-batch: the teacher scores the response, the student reads it, the loss, backward.
        loss_sum, stats = self.forward_backward(batches, scores, timer=timer)

        # 8. Clip, AdamW, schedule, teacher update, weight sync (all skipped if anything is non-finite).
        with timer("optim"):
            loss_sum, grad_norm, finite = self.optimizer_step(loss_sum)
        self.step_num += 1
        return StepOutputs(
            completions=completions,
            example_indices=ex_idx,
            batches=batches,
            scores=scores,
            loss_sum=loss_sum,
            stats=stats,
            grad_norm=grad_norm,
            finite=finite,
            timer=timer,
            policy_lag=lag,
        )

    def rollouts(self, timer) -> tuple[list[int], list, list[Completion], float]:
        """This step's problems (example indices and prompt pairs), their responses, and the responses'
        policy lag (optimizer steps between the weights that sampled them and the ones they train).

        With ``rollout.overlap`` the responses were requested one step ago, before the last update,
        and the next step's are requested now, so the servers sample them while this step trains."""
        # (A batch restored from an overlapping run's checkpoint is used even with overlap off.)
        if not self.cfg.rollout.overlap and self.pending is None:
            ex_idx, prompts = self.draw()
            with timer("rollout"):
                completions = self.engine_call(lambda: self.rollout([s for s, _ in prompts]))
            return ex_idx, prompts, completions, 0.0
        pending, lag = self.pending, 1.0
        if pending is None:  # the first step, or a resume without one: nothing was requested ahead
            pending, lag = self.request(self.step_num), 0.0
        with timer("rollout"):
            completions = self.engine_call(lambda: self.collect(pending))
        ahead = self.cfg.rollout.overlap and self.step_num + 1 < self.cfg.optim.max_steps
        self.pending = self.request(self.step_num + 1) if ahead else None
        return pending.example_indices, pending.prompts, completions, lag

    def engine_call(self, fn):
        """``fn()`` on every rank, agreeing on its outcome: an engine failing on one rank (a server
        down) stops every rank with its message, not only that one while the others wait."""
        try:
            result, err = fn(), None
        except EngineError as e:
            result, err = None, e
        found = distributed.first_error(err)
        if found is not None:
            raise err if err is not None else EngineError(f"rank {found[0]}: {found[1]}")
        return result

    def draw(self) -> tuple[list[int], list]:
        ex_idx = self.cursor.next_indices(self.prompts_per_rank)
        return ex_idx, [self.prompts(i, self.examples[i]) for i in ex_idx]

    def request(self, step: int) -> Pending:
        """Draw ``step``'s problems and ask the engine for their responses without waiting."""
        ex_idx, prompts = self.draw()
        handle = self.engine.submit([s for s, _ in prompts], self.cfg.rollout.n, self.sampling(step))
        return Pending(ex_idx, prompts, handle)

    def collect(self, pending: Pending) -> list[Completion]:
        if pending.completions is None:
            pending.completions = self.engine.collect(pending.handle)
            pending.handle = None
        return pending.completions

    def microbatches(self, samples: list) -> list[MicroBatch]:
        """Pack this rank's samples into micro-batches within the token budget, weighted by the global
        token and sequence counts, and padded to as many on every rank (FSDP's collectives match)."""
        lens = [s.response_len for s in samples]
        counts = torch.tensor([sum(lens), len(lens)], dtype=torch.float64)
        tokens, seqs = all_reduce_sum(counts).tolist()
        batches = make_microbatches(
            samples,
            max_tokens=self.mb_tokens,
            min_real_frac=self.cfg.optim.min_real_token_frac,
            pad_id=self.pad_id,
            reduction=self.spec.reduction,
            global_tokens=tokens,
            global_seqs=seqs,
            device=self.device,
            bucket=bucket_widths(self.device, self.precision.compute),
            per_row_from=self.per_row_from,
        )
        return pad_microbatches(batches, self.pad_id, self.device)

    def forward_backward(
        self, batches: list, scores: Scores | None = None, *, timer=None, backward: bool = True
    ) -> tuple[Tensor, LossStats]:
        """This trainer's micro-batch loop (:func:`forward_backward`) with its model, teacher, objective
        and mixed precision; ``backward=False`` computes the same numbers without gradients. On a CPU
        the loop reuses the heap blocks it frees (:func:`opsd.devices.reuse_freed_memory`), and beside
        the colocated vLLM engine keeps their pages after it too (``keep_pages``)."""
        with reuse_freed_memory(self.device, keep_pages=not self.trim_heap):
            return forward_backward(
                self.model,
                self.teacher if self.objective.uses_teacher else None,
                batches,
                self.loss,
                scores=scores or Scores(),
                autocast=self.autocast,
                timer=timer,
                backward=backward,
            )

    def loss(
        self,
        s_hidden: Tensor,
        t_hidden: Tensor | None,
        t_head: Tensor | None,
        mb,
        scores: Scores,
        *,
        objective: Objective | None = None,
    ):
        """The objective's loss on one micro-batch (or ``objective``'s: the held-out divergence), with
        this model's head and loss precision."""
        objective = objective or self.objective
        head = full_head_weight(self.model)
        return objective.loss(s_hidden, t_hidden, t_head, mb, scores, head=head, matmul_dtype=self.loss_mm)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def autocast(self):
        """bf16 compute over float32 master weights in one process (FSDP2 casts the gathered weights
        itself), and LoRA's float32 adapters computing in bf16 over a bf16 base (one process; under
        torchrun peft's float32 adapter path stays); around the model forwards only, never the loss."""
        if self.dist.mesh is not None:
            return nullcontext()
        adapters = self.model if self.cfg.model.lora.enabled else None
        return precision.autocast(self.precision, self.device, adapters)

    def _fsdp_param_dtype(self) -> torch.dtype | None:
        """FSDP2's compute dtype: parallel.param_dtype, or (auto) model.dtype's when it differs from
        storage."""
        par = self.cfg.parallel.param_dtype
        if par != "auto":
            return models.DTYPES[par]
        return self.precision.compute if self.precision.mixed else None

    def rollout(self, prompts: list[list[int]], *, n: int | None = None, step: int | None = None) -> list:
        """``rollout.n`` (or ``n``) responses per prompt, seeded by step (this one, or ``step``) and rank:
        a resume samples what a run would have."""
        params = self.sampling(self.step_num if step is None else step)
        self.engine.wake()
        completions = self.engine.generate(prompts, n or self.cfg.rollout.n, params)
        self.engine.sleep()
        # Generation's freed buffers (its cache, the folded LoRA copies) back to the OS before the
        # micro-batch loop: left as heap holes, they raised that loop's peak RSS by ~0.16 GiB.
        if self.trim_heap:
            release_freed_memory(self.device)
        return completions

    def sampling(self, step: int) -> SamplingParams:
        r = self.cfg.rollout
        seed = (distributed.rank_seed(self.cfg.seed, self.rank) * 1_000_003 + step * 7919) % 2**63
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_strings=list(r.stop_strings),
            seed=seed,
        )

    def optimizer_step(self, loss_sum: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Clip and step. FSDP summed the gradients over ranks (the loss weights are normalized by global
        token counts); norm and loss are global, so all ranks decide alike. A non-finite loss or gradient
        skips the update but still consumes the batch and advances the LR schedule (same data order and
        schedule)."""
        grad_norm = parallel.clip_grad_norm(self.params, self.cfg.optim.grad_clip or float("inf"))
        loss_sum = all_reduce_sum(loss_sum)
        finite = bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.bad_steps = 0 if finite else self.bad_steps + 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.pending is not None:  # every rollout requested ahead is sampled before the weights move
            pending = self.pending
            self.engine_call(lambda: self.collect(pending))
        if finite:
            self.teacher.update()
            self.engine.sync_weights(self.model)
        else:
            warnings.warn(
                f"step {self.step_num + 1}: non-finite loss or gradient norm; update skipped", stacklevel=3
            )
        return loss_sum, grad_norm, finite

    def record(self, out: StepOutputs) -> dict:
        """The step's metrics over all ranks, from one sum of named fields (every rank calls it): loss
        statistics, token counts, prompt truncation, the objective's sums, and each rank's response
        lengths and truncation flags in its own slots (all ranks have as many)."""
        sums = asdict(out.stats)
        for side in ("teacher", "student"):
            for kind in ("real", "padded"):
                name = f"{side}_{kind}_tokens"
                sums[name] = sum(getattr(mb, name) for mb in out.batches)
        for side, count in self.prompts.truncated.items():
            sums[f"prompt_truncated_{side}"] = count
        sums.update(out.scores.sums)
        n = len(out.completions)
        mine = torch.zeros(self.world, n, 2, dtype=torch.float64)
        per_sample = [[len(c.token_ids), c.finish_reason == "length"] for c in out.completions]
        mine[self.rank] = torch.tensor(per_sample)
        packed = torch.cat([torch.tensor(list(sums.values()), dtype=torch.float64), mine.flatten()])
        reduced = all_reduce_sum(packed)
        total = dict(zip(sums, reduced[: len(sums)].tolist()))
        lens, cut = reduced[len(sums) :].view(-1, 2).long().T.tolist()
        stats = LossStats(**{k: total[k] for k in asdict(out.stats)})
        rec = metrics.step_record(
            step=self.step_num,
            loss=float(out.loss_sum),
            loss_stats=stats.means(),
            grad_norm=float(out.grad_norm),
            lr=self.scheduler.get_last_lr()[0],
            response_lens=lens,
            truncated=sum(cut),
            tokens=int(stats.tokens),
            real_tokens={side: int(total[f"{side}_real_tokens"]) for side in ("teacher", "student")},
            padded_tokens={side: int(total[f"{side}_padded_tokens"]) for side in ("teacher", "student")},
            skipped=not out.finite,
            prompt_truncated={s: int(total[f"prompt_truncated_{s}"]) for s in self.prompts.truncated},
            epoch=self.cursor.epoch,
            times=out.timer.times,
            elapsed=out.timer.elapsed(),
            peak_mem_gb=metrics.peak_memory_gb(self.device),
        )
        lag = {"policy_lag": out.policy_lag} if self.cfg.rollout.overlap else {}
        return rec | self.objective.metrics(total) | lag

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
            desc=self.progress_desc,
            unit="step",
            disable=not cfg.logging.progress or self.rank != 0,
            dynamic_ncols=True,
            leave=end == cfg.optim.max_steps,
        )
        self.stop.requested = None
        try:
            with self.stop:
                while self.step_num < end:
                    out = self.step()
                    if self.trim_heap:  # the heap's holes back to the OS: RSS does not creep
                        release_freed_memory(self.device)
                    rec = self.record(out)
                    if cfg.eval.every and self.step_num % cfg.eval.every == 0:
                        rec.update(self.evaluate())
                    history.append(rec)
                    self._log(rec, out, bar)
                    self._check_bad_steps()
                    # A signal on any rank stops all of them after this step.
                    if distributed.any_rank(self.stop.requested is not None):
                        self.stop.requested = self.stop.requested or "a signal to another rank"
                    if self._checkpoint_due(end) and self.bad_steps == 0:
                        self.save()
                    if self.stop.requested:
                        self._say_stopped()
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
        if self.bad_steps < limit:
            return
        last = checkpoint.latest_checkpoint(self.run_dir) or "none yet"
        raise TrainingError(
            f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (limit "
            f"optim.max_bad_steps={limit}); stopping. Last good checkpoint: {last}. "
            "Try a lower optim.lr, loss.clip, or model.dtype=float32."
        )

    def _checkpoint_due(self, end: int) -> bool:
        c = self.cfg.checkpoint
        if not c.enabled:
            return False
        periodic = c.every and self.step_num % c.every == 0
        return bool(periodic or self.step_num == end or self.stop.requested)

    def _say_stopped(self) -> None:
        if self.rank == 0:
            print(
                f"\nstopped by {self.stop.requested} after step {self.step_num}; resume with:\n"
                f"  opsd train --resume {self.run_dir}",
                file=sys.stderr,
            )

    stopped = property(
        lambda self: self.stop.requested is not None, doc="The last ``train()`` ended on a signal."
    )

    def _log(self, rec: dict, out: StepOutputs, bar) -> None:
        if self.metrics is not None:
            self.metrics.write(rec)
            metrics.show_step(bar, rec, lines=self.cfg.logging.step_lines)
            if self.cfg.logging.sample_every and rec["step"] % self.cfg.logging.sample_every == 0:
                shown = out.completions[: self.cfg.logging.num_samples]
                metrics.write_samples(
                    self.run_dir / "samples.jsonl",
                    rec["step"],
                    [self.examples[out.example_indices[c.prompt_index]] for c in shown],
                    [self.decode(c.token_ids) for c in shown],
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
            grader=self.eval_grader,
        )
        # generate() woke it: the checkpoint save and the next step run without vLLM resident
        self.engine.sleep()
        out = res.metrics(prefix="eval/")
        if e.divergence:
            out["eval/divergence"] = self.heldout_divergence()["divergence"]
        return out

    def heldout_divergence(self) -> dict:
        """:meth:`_heldout_divergence` with the model in eval mode: no dropout in a metric, and no
        draws from the training RNG."""
        training = self.model.training
        self.model.eval()
        try:
            return self._heldout_divergence()
        finally:
            self.model.train(training)

    @torch.no_grad()
    def _heldout_divergence(self) -> dict:
        """The distillation loss's statistics on the held-out problems for the current student: one
        sampled response per problem (the rollout's settings, one seed for every evaluation), scored by
        the teacher with the held-out solutions as a training step scores it, with no gradient. Where
        accuracy is near zero, this is the number that moves. Collective: every rank scores its share."""
        mine = list(range(self.rank, len(self.eval_examples), self.world))
        pairs = [self.eval_prompts(i, self.eval_examples[i]) for i in mine]
        # One response each, from a seed stream no training step uses, the same at every evaluation.
        completions = self.rollout([student for student, _ in pairs], n=1, step=-1)
        samples = [
            make_sample(*pairs[c.prompt_index], c.token_ids, mine[c.prompt_index], c.finish_reason)
            for c in completions
            if c.token_ids
        ]
        loss_sum, stats = forward_backward(
            self.model,
            self.teacher,
            self.microbatches(samples),
            partial(self.loss, objective=self.heldout),
            autocast=self.autocast,
            backward=False,
        )
        total = LossStats.from_tensor(all_reduce_sum(stats.as_tensor()))
        return {"loss": float(all_reduce_sum(loss_sum)), **total.means()}

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
            rank_state={"truncated": self.prompts.state_dict(), "pending": self._pending_state()},
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
        self.pending = _pending_from_state(mine.get("pending"))
        if distributed.any_rank(self.pending is None):  # another number of ranks: nothing ahead on some
            self.pending = None
        self.engine.sync_weights(self.model)
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {self.step_num}", file=sys.stderr)

    def _pending_state(self) -> dict | None:
        """The rollouts requested ahead, collected, in types a weights-only load accepts: regenerating
        them on resume would need the previous step's weights."""
        if self.pending is None:
            return None
        done = self.collect(self.pending)
        return {
            "example_indices": self.pending.example_indices,
            "prompts": [[list(s), list(t)] for s, t in self.pending.prompts],
            "completions": [[c.prompt_index, c.token_ids, c.logprobs, c.finish_reason] for c in done],
        }

    def close(self) -> None:
        """Shut the rollout engine down while the process group still exists (vLLM's teardown uses it);
        call before :func:`opsd.distributed.shutdown`. Safe to call twice."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()


def _pending_from_state(state: dict | None) -> Pending | None:
    if not state:
        return None
    completions = [
        Completion(i, list(t), list(lp) if lp is not None else None, r)
        for i, t, lp, r in state["completions"]
    ]
    prompts = [(list(s), list(t)) for s, t in state["prompts"]]
    return Pending(list(state["example_indices"]), prompts, None, completions)
