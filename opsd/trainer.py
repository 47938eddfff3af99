"""The OPSD trainer. ``Trainer.step`` is the whole algorithm, top to bottom.

    draw problems -> student rollouts -> teacher sequences -> per micro-batch:
    teacher hidden states (no grad) -> student hidden states -> chunked fused-linear loss ->
    backward -> clip -> AdamW step -> LR schedule -> EMA / weight sync
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm.auto import tqdm

from opsd.checkpoint import latest_checkpoint, load_state, rng_state, save_checkpoint, set_rng_state
from opsd.config import Config, save_config
from opsd.data import (
    DataCursor,
    Sample,
    load_examples,
    make_sample,
    pack_microbatches,
    raw_splice_teacher_ids,
    student_prompt_ids,
    teacher_prompt_ids,
)
from opsd.loss import LossStats, fused_linear_distill
from opsd.metrics import MetricsWriter, StepTimer, peak_memory_gb
from opsd.models import load_model, load_tokenizer
from opsd.rollout import SamplingParams, make_engine
from opsd.teacher import Teacher, check_plain_head, final_hidden, head_weight, pad_right, response_positions


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps); the last good checkpoint is intact."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_sum(x: Tensor) -> Tensor:
    """Global sums across data-parallel ranks (a no-op on one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x)
    return x


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Builds everything from a :class:`Config`, then ``train()``.

    ``resume=True`` continues the latest checkpoint in ``logging.run_dir`` exactly;
    ``overwrite=True`` deletes an existing run directory first. Without either, an existing
    run directory is refused.
    """

    def __init__(self, cfg: Config, *, resume: bool = False, overwrite: bool = False) -> None:
        self.cfg = cfg
        self.rank, self.world = _rank_world()
        self.run_dir = Path(cfg.logging.run_dir)
        self._prepare_run_dir(resume, overwrite)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )

        # Data: rows, then a resumable cursor sharded by rank.
        report = load_examples(
            cfg.data.path, problem_key=cfg.data.problem_key,
            solution_key=cfg.data.solution_key if cfg.teacher.privileged else None,
            answer_key=cfg.data.answer_key, split=cfg.data.split, skip_bad_rows=cfg.data.skip_bad_rows,
            drop_empty_solution=cfg.data.drop_empty_solution,
        )
        self.examples = report.examples
        self.data_report = {"rows": len(report.examples), "skipped_bad": report.skipped_bad,
                            "empty_solution": report.empty_solution, "dropped_empty": report.dropped_empty}
        self.cursor = DataCursor(len(self.examples), seed=cfg.seed, rank=self.rank, world_size=self.world,
                                 shuffle=cfg.data.shuffle)
        self._prompt_cache: dict[int, tuple[list[int], list[int]]] = {}
        self.truncated = {"student": 0, "teacher": 0}

        # Model: the student (LoRA or full), its tokenizer, and the teacher.
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.model = self._build_student()
        check_plain_head(self.model)
        external = None
        if cfg.teacher.mode == "external":
            external = self._load_external_teacher()
        self.teacher = Teacher(
            cfg.teacher.mode, self.model, lora=cfg.model.lora.enabled, ema_decay=cfg.teacher.ema_decay,
            external=external, frozen_copy=cfg.teacher.frozen_copy,
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )
        o = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, warmup=o.warmup_steps, total=o.max_steps, schedule=o.scheduler,
                                min_ratio=o.min_lr_ratio),
        )
        r = cfg.rollout
        engine_kw = {"batch_size": r.batch_size}
        if r.engine == "vllm":
            engine_kw = {"gpu_memory_utilization": r.gpu_memory_utilization,
                         "tensor_parallel_size": r.tensor_parallel_size, "seed": cfg.seed}
        self.engine = make_engine(r.engine, self.model, self.tokenizer, **engine_kw)
        self.step_num = 0
        self.bad_steps = 0
        self._stop_signal: str | None = None

        if resume:
            self._resume()
        elif self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        if self.rank == 0:
            (self.run_dir / "data_report.json").write_text(json.dumps({"source": cfg.data.path, **self.data_report}))
            d = self.data_report
            print(f"data: {d['rows']} rows from {cfg.data.path} (skipped {d['skipped_bad']} bad, "
                  f"{d['empty_solution']} with empty privileged info, dropped {d['dropped_empty']})", file=sys.stderr)
        self.metrics = MetricsWriter(
            self.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project, config=cfg.model_dump(mode="json"),
        ) if self.rank == 0 else None

    # ------------------------------------------------------------------------------------------
    # Setup helpers

    def _prepare_run_dir(self, resume: bool, overwrite: bool) -> None:
        if resume and overwrite:
            raise ValueError("choose one of resume and overwrite")
        if self.rank != 0:  # rank 0 checks and prepares the directory; the others wait for it
            dist.barrier()
            return
        exists = self.run_dir.exists() and any(self.run_dir.iterdir())
        if resume and latest_checkpoint(self.run_dir) is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {self.run_dir / 'checkpoints'}")
        if exists and not resume:
            if not overwrite:
                raise FileExistsError(
                    f"run directory {self.run_dir} already exists: pass --resume to continue it "
                    "or --overwrite to start over (it will be deleted)"
                )
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.world > 1:
            dist.barrier()

    def _build_student(self) -> nn.Module:
        m = self.cfg.model
        model = load_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation, device=str(self.device))
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not m.lora.enabled:
            return model.train()
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
            target_modules=m.lora.target_modules, task_type="CAUSAL_LM",
        )
        if m.gradient_checkpointing:
            model.enable_input_require_grads()
        return get_peft_model(model, lora).train()

    def _load_external_teacher(self) -> nn.Module:
        path = self.cfg.teacher.path
        tok = load_tokenizer(path)
        if tok.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                f"teacher.path={path}: its tokenizer differs from the student's ({self.cfg.model.path}); "
                "an external teacher must share the student's vocabulary token for token"
            )
        return load_model(path, dtype=self.cfg.model.dtype, attn_implementation=self.cfg.model.attn_implementation,
                          device=str(self.device))

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run_dir)
        state = load_state(ckpt)
        self._load_model_weights(ckpt / "model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.teacher.load_state_dict(state["teacher"])
        self.cursor.load_state_dict(state["cursor"])
        self.truncated = state["truncated"]
        self.step_num = state["step"]
        self.bad_steps = state["bad_steps"]
        set_rng_state(state["rng"])
        self.engine.sync_weights(self.model)
        print(f"resumed from {ckpt} at step {self.step_num}", file=sys.stderr)

    def _load_model_weights(self, model_dir: Path) -> None:
        from safetensors.torch import load_file

        if self.cfg.model.lora.enabled:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(model_dir / "adapter_model.safetensors"))
        else:
            fresh = type(self.model).from_pretrained(model_dir, torch_dtype=self.model.dtype)
            self.model.load_state_dict(fresh.state_dict())

    def _prompts(self, i: int) -> tuple[list[int], list[int]]:
        """Student and teacher prompt ids of example ``i``, tokenized once."""
        if i not in self._prompt_cache:
            d, ex = self.cfg.data, self.examples[i]
            s_ids, s_cut = student_prompt_ids(
                self.tokenizer, ex.problem, instruction=d.instruction, enable_thinking=d.student_thinking,
                max_len=d.max_prompt_len,
            )
            if not self.cfg.teacher.privileged:
                t_ids, t_cut = s_ids, False
            elif d.raw_splice:
                sol = self.tokenizer(ex.solution, add_special_tokens=False)["input_ids"]
                t_ids = raw_splice_teacher_ids(s_ids, sol)[: d.max_teacher_prompt_len]
                t_cut = len(s_ids) + len(sol) > d.max_teacher_prompt_len
            else:
                t_ids, t_cut = teacher_prompt_ids(
                    self.tokenizer, ex.problem, ex.solution, template=d.teacher_template,
                    instruction=d.instruction, enable_thinking=d.teacher_thinking, max_len=d.max_teacher_prompt_len,
                )
            self.truncated["student"] += int(s_cut)
            self.truncated["teacher"] += int(t_cut)
            self._prompt_cache[i] = (s_ids, t_ids)
        return self._prompt_cache[i]

    # ------------------------------------------------------------------------------------------
    # The step

    def step(self) -> dict:
        """One optimizer step of OPSD. Returns the step's metrics."""
        cfg, dev = self.cfg, self.device
        timer = StepTimer(sync=dev.type == "cuda")
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t_start = time.perf_counter()

        # 1. Draw problems (this rank's share of the global batch).
        ex_idx = self.cursor.next_indices(cfg.rollout.prompts_per_step)
        prompts = [self._prompts(i) for i in ex_idx]

        # 2. Roll out n responses per problem with the current weights. The seed depends on the
        #    step only, so a resumed run samples exactly what an uninterrupted one would.
        r = cfg.rollout
        params = SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
            stop_strings=list(r.stop_strings), seed=cfg.seed * 1_000_003 + self.step_num * 7919 + self.rank,
        )
        with timer("rollout"):
            self.engine.wake()
            completions = self.engine.generate([s for s, _ in prompts], r.n, params)
            self.engine.sleep()

        # 3. Splice each response, token for token, after both prompts.
        samples: list[Sample] = [
            make_sample(prompts[c.prompt_index][0], prompts[c.prompt_index][1], c.token_ids,
                        ex_idx[c.prompt_index], c.finish_reason)
            for c in completions if c.token_ids
        ]
        counts = _all_reduce_sum(torch.tensor(
            [sum(s.response_len for s in samples), len(samples)], dtype=torch.float64))
        global_tokens, global_seqs = counts.tolist()
        groups = pack_microbatches(
            [max(len(s.student_ids), len(s.teacher_ids)) for s in samples], cfg.optim.max_tokens_per_microbatch
        )

        # 4-7. Per micro-batch: teacher hidden states, student hidden states, fused loss, backward.
        lc = cfg.loss
        loss_total = torch.zeros((), dtype=torch.float64)
        stats = LossStats()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        student_head = head_weight(self.model)
        for group in groups:
            mb = [samples[i] for i in group]
            resp = [s.response_len for s in mb]
            weights = torch.cat([
                torch.full((n,), 1.0 / (global_tokens if lc.reduction == "token" else n * global_seqs))
                for n in resp
            ]).to(dev)
            targets = torch.tensor([t for s in mb for t in s.student_ids[-s.response_len:]], device=dev)

            with timer("teacher"):
                t_ids, t_mask = pad_right([s.teacher_ids for s in mb], pad, dev)
                t_pos = response_positions([len(s.teacher_ids) for s in mb], resp, t_ids.shape[1])
                t_hidden, t_head = self.teacher.score(t_ids, t_mask, t_pos)

            with timer("student"):
                s_ids, s_mask = pad_right([s.student_ids for s in mb], pad, dev)
                s_pos = response_positions([len(s.student_ids) for s in mb], resp, s_ids.shape[1])
                s_hidden = final_hidden(self.model, s_ids, s_mask, s_pos)

            with timer("loss"):
                loss, st = fused_linear_distill(
                    s_hidden, student_head, t_hidden, t_head, weights, targets,
                    mode=lc.mode, beta=lc.beta, temperature=cfg.loss_temperature, clip_mode=lc.clip_mode,
                    clip=lc.clip, topk=lc.topk, chunk_size=lc.chunk_size,
                )
            with timer("student"):
                loss.backward()
            loss_total += loss.detach().double().cpu()
            stats.add(st)
            del t_hidden, s_hidden, loss

        # 8. Sum gradients over data-parallel ranks (weights were normalized by the global token
        #    count, so the sum is the one-big-batch gradient), clip, step, schedule; skip the
        #    update if anything is non-finite.
        with timer("optim"):
            if self.world > 1:
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip or float("inf"))
            loss_total = _all_reduce_sum(loss_total)
            finite = bool(torch.isfinite(loss_total)) and bool(torch.isfinite(grad_norm))
            if finite:
                self.optimizer.step()
                self.bad_steps = 0
            else:
                self.bad_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            if finite:
                self.teacher.update()
                self.engine.sync_weights(self.model)
        self.step_num += 1

        stats = LossStats.from_tensor(_all_reduce_sum(stats.as_tensor()))
        lens = [len(c.token_ids) for c in completions]
        elapsed = time.perf_counter() - t_start
        record = {
            "step": self.step_num,
            "loss": float(loss_total),
            **stats.means(),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "resp_len_mean": sum(lens) / max(1, len(lens)),
            "resp_len_max": max(lens, default=0),
            "truncated_frac": sum(c.finish_reason == "length" for c in completions) / max(1, len(completions)),
            "tokens": int(global_tokens),
            "tokens_per_s": global_tokens / elapsed,
            "skipped_nonfinite": int(not finite),
            "prompt_truncated_student": self.truncated["student"],
            "prompt_truncated_teacher": self.truncated["teacher"],
            "epoch": self.cursor.epoch,
            **{f"time_{k}": v for k, v in timer.times.items()},
            "time_step": elapsed,
            "peak_mem_gb": peak_memory_gb(dev),
        }
        if not finite:
            warnings.warn(f"step {self.step_num}: non-finite loss or gradient norm; update skipped", stacklevel=2)
        self._last_completions = (completions, ex_idx)
        return record

    # ------------------------------------------------------------------------------------------
    # The loop

    def train(self, until_step: int | None = None) -> list[dict]:
        """Run to ``optim.max_steps`` (or ``until_step``); checkpoint every K steps and at the end."""
        cfg = self.cfg
        end = min(cfg.optim.max_steps, until_step or cfg.optim.max_steps)
        history = []
        self._install_signal_handlers()
        bar = tqdm(total=cfg.optim.max_steps, initial=self.step_num, desc="opsd train", unit="step",
                   disable=not cfg.logging.progress or self.rank != 0, dynamic_ncols=True)
        try:
            while self.step_num < end:
                rec = self.step()
                if cfg.eval.every and self.step_num % cfg.eval.every == 0:
                    rec.update(self.evaluate())
                history.append(rec)
                self._log(rec, bar)
                if self.bad_steps >= cfg.optim.max_bad_steps:
                    last = latest_checkpoint(self.run_dir)
                    raise TrainingError(
                        f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (limit "
                        f"optim.max_bad_steps={cfg.optim.max_bad_steps}); stopping. Last good checkpoint: "
                        f"{last or 'none yet'}. Try a lower optim.lr, loss.clip, or model.dtype=float32."
                    )
                ck = cfg.checkpoint.every
                due = (ck and self.step_num % ck == 0) or self.step_num == end or self._stop_signal
                if due and self.bad_steps == 0:
                    self.save()
                if self._stop_signal:
                    print(f"\nstopped by {self._stop_signal} after step {self.step_num}; resume with:\n"
                          f"  opsd train --resume {self.run_dir}", file=sys.stderr)
                    break
        finally:
            bar.close()
            self._restore_signal_handlers()
            if self.metrics is not None:
                self.metrics.close()
        return history

    def _log(self, rec: dict, bar) -> None:
        if self.metrics is None:
            return
        self.metrics.write(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.4f}", div=f"{rec['divergence']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        line = (f"step {rec['step']:>5} | loss {rec['loss']:.4f} | div {rec['divergence']:.4f} | "
                f"clip {rec['clip_frac']:.3f} | agree {rec['agreement']:.3f} | len {rec['resp_len_mean']:.0f} | "
                f"{rec['tokens_per_s']:.0f} tok/s | {rec['time_step']:.1f}s")
        if any(k.startswith("eval/") for k in rec):
            line += " | " + " ".join(f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("eval/"))
        tqdm.write(line, file=sys.stderr)
        every = self.cfg.logging.sample_every
        if every and rec["step"] % every == 0:
            self._log_samples(rec["step"])

    def _log_samples(self, step: int) -> None:
        completions, ex_idx = self._last_completions
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for i, c in enumerate(completions[: self.cfg.logging.num_samples]):
                ex = self.examples[ex_idx[c.prompt_index]]
                response = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                f.write(json.dumps({"step": step, "problem": ex.problem, "answer": ex.answer,
                                    "response": response, "finish_reason": c.finish_reason}) + "\n")
                if i == 0:
                    tqdm.write(f"  sample | {str(ex.problem)[:100]!r} -> {response[:200]!r}", file=sys.stderr)

    def evaluate(self) -> dict:
        """Held-out accuracy of the live model, without privileged information."""
        from opsd.eval import evaluate_model

        e = self.cfg.eval
        if not hasattr(self, "_eval_examples"):
            rep = load_examples(e.path, problem_key=self.cfg.data.problem_key, solution_key=None,
                        answer_key=e.answer_key, require_answer=True)
            self._eval_examples = rep.examples[: e.limit] if e.limit else rep.examples
        res = evaluate_model(
            self.model, self.tokenizer, self._eval_examples, k=e.k, temperature=e.temperature,
            max_new_tokens=e.max_new_tokens, instruction=self.cfg.data.instruction,
            enable_thinking=self.cfg.data.student_thinking, seed=self.cfg.seed, engine=self.engine,
        )
        return res.metrics(prefix="eval/")

    def save(self) -> Path | None:
        if self.rank != 0:
            return None
        state = {
            "step": self.step_num,
            "bad_steps": self.bad_steps,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "teacher": self.teacher.state_dict(),
            "cursor": self.cursor.state_dict(),
            "truncated": dict(self.truncated),
            "rng": rng_state(),
        }
        return save_checkpoint(
            self.run_dir, self.step_num, self.model, self.tokenizer, state,
            keep_last=self.cfg.checkpoint.keep_last, save_merged=self.cfg.checkpoint.save_merged,
        )

    # ------------------------------------------------------------------------------------------
    # Ctrl-C / SIGTERM: finish the current step, save, exit cleanly. A second signal aborts.

    def _install_signal_handlers(self) -> None:
        import threading

        self._old_handlers = {}
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if self._stop_signal:
                raise KeyboardInterrupt
            self._stop_signal = signal.Signals(signum).name
            print(f"\n{self._stop_signal}: finishing the current step, then saving a checkpoint "
                  "(signal again to abort without saving)", file=sys.stderr)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
