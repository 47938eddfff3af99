"""TRL's SDFTTrainer for bench/vs_trl.py's TRL child, timed per phase with its computation untouched:
the timers wrap its own methods. Imports torch and trl: only the TRL child imports it."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from _vs_trl_children import GRAD_CLIP, LR, MAX_PROMPT_LEN, PHASES, SEED, TEMPERATURE, Work
from transformers import TrainerCallback
from trl.experimental.sdft import SDFTConfig, SDFTTrainer

from opsd.data.prompts import DEFAULT_INSTRUCTION


class TimedSDFT(SDFTTrainer):
    """Adds up wall-clock time per phase into ``bench_steps[-1]``."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.bench_steps: list[dict] = []
        backward = self.accelerator.backward

        def timed_backward(loss, **kwargs):
            with self._phase("student"):
                return backward(loss, **kwargs)

        self.accelerator.backward = timed_backward

    @contextmanager
    def _phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.bench_steps[-1][f"time_{name}"] += time.perf_counter() - t

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.bench_steps.append(
            {"tokens": 0, "t0": time.perf_counter(), **{f"time_{p}": 0.0 for p in PHASES}}
        )
        out = super().training_step(model, inputs, num_items_in_batch)
        self.bench_steps[-1]["t_train_end"] = time.perf_counter()
        return out

    def _generate(self, prompt_ids):
        with self._phase("rollout"):
            prompt_ids, completions = super()._generate(prompt_ids)
        self.bench_steps[-1]["tokens"] += sum(len(c) for c in completions)
        return prompt_ids, completions

    def _forward_logits(self, model, input_ids, attention_mask, logits_to_keep):
        with self._phase("student" if torch.is_grad_enabled() else "teacher"):
            return super()._forward_logits(model, input_ids, attention_mask, logits_to_keep)

    def _compute_self_distillation_loss(self, model, inputs, distillation_logits):
        with self._phase("loss"):
            return super()._compute_self_distillation_loss(model, inputs, distillation_logits)


class StepEnd(TrainerCallback):
    """Clip, optimizer step, schedule and zero_grad run between training_step and on_step_end; its
    ``trainer`` (a :class:`TimedSDFT`) is set once that trainer exists."""

    trainer: TimedSDFT

    def on_step_end(self, args, state, control, **kwargs):
        rec = self.trainer.bench_steps[-1]
        now = time.perf_counter()
        rec["time_optim"] += now - rec.pop("t_train_end")
        rec["time_step"] = now - rec.pop("t0")


def sdft_examples(rows: list[dict]) -> list[dict]:
    """The MATH rows as TRL's examples: the student's prompt (problem and opsd's instruction) and the
    solution as privileged context."""
    return [
        {
            "prompt": [{"role": "user", "content": f"{r['problem']}\n\n{DEFAULT_INSTRUCTION}"}],
            "privileged_context": r["solution"],
        }
        for r in rows
    ]


def sdft_config(w: Work) -> SDFTConfig:
    """The shared settings in TRL's terms; ``w.trl_bf16`` picks bf16 weights or fp32 ones under autocast."""
    autocast = w.dtype == "bfloat16" and w.trl_bf16 == "autocast"
    weights = torch.bfloat16 if w.dtype == "bfloat16" and not autocast else torch.float32
    return SDFTConfig(
        output_dir=w.run_dir,
        per_device_train_batch_size=w.rows_per_step,
        gradient_accumulation_steps=1,
        num_generations=1,
        distillation_mode="full_logits",
        distillation_alpha=0.0,
        teacher_model_kind="base",
        max_prompt_length=MAX_PROMPT_LEN,
        max_completion_length=w.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        use_cpu=True,
        gradient_checkpointing=False,
        bf16=autocast,
        model_init_kwargs={"dtype": weights, "attn_implementation": "sdpa"},
        max_steps=1 + w.measured_steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=GRAD_CLIP,
        optim="adamw_torch",
        seed=SEED,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
