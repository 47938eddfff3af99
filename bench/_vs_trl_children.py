"""bench/vs_trl.py's children: one trainer each on the same work, timed per phase.

Imported by the parent too (for :class:`Work` and the shared settings), so nothing here imports torch
until a child runs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import _common

PHASES = ("rollout", "teacher", "student", "loss", "optim")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_PROMPT_LEN = 1024  # TRL's max_prompt_length cuts student and teacher prompts alike
# TRL's default teacher prompt is "{prompt}\n\n{privileged_context}" with the prompt being the last user
# message (problem + instruction); this opsd template renders the same text.
OPSD_TEACHER_TEMPLATE = "{problem}\n\n{instruction}\n\n{solution}"
LR, GRAD_CLIP, SEED = 5e-6, 0.1, 0
TEMPERATURE, ENTRY_CLIP = 1.1, 0.05  # bench/train_step.py's


@dataclass
class Work:
    """What one run does; written to JSON for the child process."""

    side: str
    dtype: str  # float32 | bfloat16
    model: str
    rows_file: str
    rows_per_step: int
    measured_steps: int
    max_new_tokens: int
    run_dir: str
    trl_bf16: (
        str  # weights: load the model in bf16 (as opsd's model.dtype); autocast: fp32 weights, bf16=True
    )
    opsd_engine: str  # rollout.engine for opsd (auto: vLLM where installed, else HF)
    opsd_set: list[str]  # extra opsd config overrides (--opsd-set), after the shared settings


def run_opsd(w: Work) -> tuple[list[dict], dict]:
    """opsd's Trainer; the phase times are its own metrics.jsonl."""
    from opsd.config import load_config
    from opsd.cpu import command_defaults
    from opsd.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"model.path={w.model}",
            f"model.dtype={w.dtype}",
            "model.attn_implementation=sdpa",
            "model.gradient_checkpointing=false",
            "model.lora.r=16",
            "model.lora.alpha=32",
            "model.lora.dropout=0",
            f"model.lora.target_modules={json.dumps(LORA_TARGETS)}",
            f"data.path={w.rows_file}",
            "data.shuffle=false",
            f"data.max_prompt_len={MAX_PROMPT_LEN}",
            f"data.max_teacher_prompt_len={MAX_PROMPT_LEN}",
            f"data.teacher_template={json.dumps(OPSD_TEACHER_TEMPLATE)}",
            f"rollout.engine={w.opsd_engine}",
            f"rollout.prompts_per_step={w.rows_per_step}",
            "rollout.n=1",
            f"rollout.max_new_tokens={w.max_new_tokens}",
            f"rollout.temperature={TEMPERATURE}",
            "rollout.top_p=1.0",
            "rollout.top_k=0",
            "loss.mode=jsd",
            "loss.beta=0",
            "loss.clip_mode=entry",
            f"loss.clip={ENTRY_CLIP}",
            "loss.reduction=token",
            f"loss.temperature={TEMPERATURE}",
            "teacher.mode=fixed",
            f"optim.max_steps={1 + w.measured_steps}",
            f"optim.lr={LR}",
            f"optim.grad_clip={GRAD_CLIP}",
            "optim.scheduler=constant",
            "checkpoint.enabled=false",
            f"logging.run_dir={w.run_dir}",
            "logging.progress=false",
            "logging.sample_every=0",
            "device=cpu",
            f"seed={SEED}",
            *w.opsd_set,
        ],
    )
    cfg = command_defaults(cfg)  # the `opsd` command's defaults (cpu.tune_malloc), as `opsd train` runs
    trainer = Trainer(cfg)
    engine = type(trainer.run.engine).__name__
    trainer.train()
    recs = [json.loads(x) for x in (Path(w.run_dir) / "metrics.jsonl").read_text().splitlines()]
    keys = ("tokens", "time_step", *(f"time_{p}" for p in PHASES))
    return [{k: r[k] for k in keys} for r in recs[1:]], {**_versions(), "engine": engine}


def run_trl(w: Work) -> tuple[list[dict], dict]:
    """TRL's SDFTTrainer with timers around its own methods (bench/_vs_trl_sdft.py); its computation
    is untouched."""
    from _vs_trl_sdft import StepEnd, TimedSDFT, sdft_config, sdft_examples
    from datasets import Dataset
    from peft import LoraConfig

    rows = [json.loads(x) for x in Path(w.rows_file).read_text().splitlines()]
    examples = sdft_examples(rows)
    args = sdft_config(w)
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    step_end = StepEnd()
    trainer = TimedSDFT(
        model=w.model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        peft_config=lora,
        callbacks=[step_end],
    )
    step_end.trainer = trainer
    mismatches = _compare_prompts(trainer, examples, rows)
    trainer.train()
    engine = "vLLM" if args.use_vllm else "HF generate"
    return trainer.bench_steps[1:], {**_versions(), "prompt_mismatches": mismatches, "engine": engine}


def _compare_prompts(trainer, examples: list[dict], rows: list[dict]) -> int | None:
    """How many student or teacher prompts TRL tokenizes differently from opsd (0 is the point)."""
    from opsd.data.prompts import student_prompt_ids, teacher_prompt_ids

    try:  # TRL's own (private) prompt path, exactly as its training step uses it
        prompts, contexts = [e["prompt"] for e in examples], [e["privileged_context"] for e in examples]
        trl_student = trainer._tokenize_prompts(prompts)
        trl_teacher = trainer._tokenize_prompts(
            [trainer.teacher_context_builder._compose_teacher_prompt(p, c) for p, c in zip(prompts, contexts)]
        )
    except AttributeError as err:  # a TRL version whose internals moved
        print(f"prompt check skipped: {err}", file=sys.stderr)
        return None
    tok, bad = trainer._tokenizer, 0
    for r, s, t in zip(rows, trl_student, trl_teacher):
        bad += student_prompt_ids(tok, r["problem"], max_len=MAX_PROMPT_LEN)[0] != list(s)
        bad += teacher_prompt_ids(
            tok, r["problem"], r["solution"], template=OPSD_TEACHER_TEMPLATE, max_len=MAX_PROMPT_LEN
        )[0] != list(t)
    return bad


def _versions() -> dict:
    import peft
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {
        "machine": _common.describe_machine(),  # torch's version and this child's thread count
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "trl": trl_version,
    }
