"""What a training run is built from, in the order the code needs it.

:func:`prepare_model` applies every model transform in one ordered function (dtype, gradient
checkpointing, LoRA, the teacher's frozen copy, parallelism, the CPU plan, compile), the way
torchtitan's ``parallelize`` does; :func:`load_data` reads the training and held-out rows;
:func:`fsdp_param_dtype` and :func:`microbatch_tokens` size what the trainer runs. ``opsd.trainer``
calls them from ``Trainer.setup``, top to bottom.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from opsd import cpu, distributed, models, parallel, precision
from opsd.config import Config
from opsd.data import DataCursor, Example, load_examples
from opsd.data.controls import apply_solution_source
from opsd.data.sources import take_rows
from opsd.errors import UserError
from opsd.metrics import MetricsWriter
from opsd.optim import make_optimizer
from opsd.rollout.make import make_engine
from opsd.rundir import record_config
from opsd.teacher import Teacher


@dataclass
class Data:
    """The training rows (each with its privileged information where a teacher reads it), what
    loading them skipped, the rank's resumable cursor over them, and the held-out rows."""

    examples: list[Example]
    report: dict[str, int]
    cursor: DataCursor
    eval_examples: list[Example]


def load_data(cfg: Config, *, privileged: bool, needs_answers: bool, rank: int, world: int) -> Data:
    """Rows validated at startup, so a bad file fails before any compute. Solutions only where a
    teacher reads them (``privileged``); answers where the objective grades against them."""
    d = cfg.data
    loaded = load_examples(
        d.path,
        problem_key=d.problem_key,
        solution_key=d.solution_key if privileged else None,
        answer_key=d.answer_key,
        split=d.split,
        skip_bad_rows=d.skip_bad_rows,
        drop_empty_solution=d.drop_empty_solution,
        require_answer=needs_answers,
    )
    rows = take_rows(loaded.examples, d.rows, "data.rows", d.path)
    # The controls (teacher.solution_source other, wrong_answer): what the teacher reads instead.
    examples, refused = apply_solution_source(rows, cfg.teacher.solution_source)
    if not examples:
        raise UserError(
            f"{d.path}: teacher.solution_source=wrong_answer refused all {refused} rows: no solution has a "
            "final answer to replace (`#### N` or \\boxed{N})"
        )
    if refused and rank == 0:
        print(
            f"data: teacher.solution_source=wrong_answer refused {refused} rows of {d.path} without a "
            "detectable final answer (data_report.json: wrong_answer_refused)",
            file=sys.stderr,
        )
    report = {
        "rows": len(rows),
        "skipped_bad": loaded.skipped_bad,
        "empty_solution": loaded.empty_solution,
        "dropped_empty": loaded.dropped_empty,
        "wrong_answer_refused": refused,
    }
    cursor = DataCursor(len(examples), seed=cfg.seed, rank=rank, world_size=world, shuffle=d.shuffle)
    e = cfg.eval
    held_out = []
    if e.path:
        held_out = load_examples(
            e.path,
            problem_key=d.problem_key,
            # Solutions only for the held-out divergence: accuracy never shows them to the student.
            solution_key=d.solution_key if e.divergence else None,
            answer_key=e.answer_key,
            require_answer=True,
        ).examples
        held_out = take_rows(held_out, e.rows, "eval.rows", e.path)[: e.limit]
    return Data(examples, report, cursor, held_out)


def prepare_model(
    cfg: Config,
    dist: distributed.Dist,
    prec: precision.Precision,
    plan: cpu.CpuPlan,
    *,
    teacher_mode: str,
    vocab: dict[str, int],
) -> tuple[nn.Module, Teacher, cpu.CpuPlan]:
    """The student, its teacher and the CPU plan as applied, every model transform here, in order:

    1. load in the storage dtype (float32 masters for mixed-precision full fine-tuning);
    2. gradient checkpointing; 3. LoRA (peft; the base frozen); 4. an external teacher, loaded;
    5. the teacher: a frozen copy of the initial weights in the compute dtype (full fine-tuning), or
       the student itself with the adapter off (LoRA), or an EMA snapshot;
    6. FSDP2 over the mesh under torchrun (the separate teacher network first);
    7. the CPU plan's transforms (frozen weights' layout, packed attention), one process only;
    8. ``model.compile``, after the weights' last change of layout, which compiled code assumes;
    9. the teacher's EMA snapshot, of the student as sharded."""
    m = cfg.model
    sharded = dist.mesh is not None
    # Steps 1-4 load; a failure on any rank ends every rank before the collectives of step 6.
    model, external = distributed.run_setup(
        lambda: _load_models(cfg, dist, prec, teacher_mode, vocab), "model load"
    )
    teacher = Teacher(
        teacher_mode,
        model,
        lora=m.lora.enabled,
        ema_decay=cfg.teacher.ema_decay,
        external=external,
        frozen_copy=cfg.teacher.frozen_copy,
        copy_dtype=prec.compute,
        sharded=sharded,
    )
    if sharded:
        parallel.parallelize(
            model,
            teacher.model,
            dist.mesh,
            param_dtype=fsdp_param_dtype(cfg, prec),
            reduce_dtype=models.DTYPES[cfg.parallel.reduce_dtype],
            teacher_offload=teacher.offload_shards,
        )
    plan = cpu.apply_plan(plan, model, teacher.model, params=models.non_embedding_params(model))
    if m.compile:
        n = models.compile_layers(model, teacher.model)
        if dist.rank == 0:
            print(f"model.compile: {n} decoder layers compile at the first step", file=sys.stderr)
    teacher.start()
    return model, teacher, plan


def _load_models(cfg: Config, dist: distributed.Dist, prec: precision.Precision, teacher_mode: str, vocab):
    """:func:`prepare_model`'s steps 1-4: the student (checkpointing, LoRA) and an external teacher."""
    m = cfg.model
    model = models.load_model(
        m.path,
        dtype=prec.storage,
        attn_implementation=m.attn_implementation,
        device=str(dist.device),
        trust_remote_code=m.trust_remote_code,
    )
    if m.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    if m.lora.enabled:
        model = models.apply_lora(
            model,
            r=m.lora.r,
            alpha=m.lora.alpha,
            dropout=m.lora.dropout,
            target_modules=m.lora.target_modules,
            gradient_checkpointing=m.gradient_checkpointing,
        )
    model.train()
    models.check_plain_head(model)
    external = None
    if teacher_mode == "external":
        external = Teacher.load_external(
            cfg.teacher.path,
            m.path,
            vocab,
            dtype=prec.compute,
            attn_implementation=m.attn_implementation,
            device=str(dist.device),
        )
    return model, external


def fsdp_param_dtype(cfg: Config, prec: precision.Precision) -> torch.dtype | None:
    """FSDP2's compute dtype: ``parallel.param_dtype``, or (auto) the compute dtype where it is narrower
    than float32: mixed-precision full fine-tuning's float32 masters, and LoRA's float32 adapters over
    a bf16 base (without it peft casts every projection's input up to float32 under the mesh, where
    one process's autocast does not run)."""
    par = cfg.parallel.param_dtype
    if par != "auto":
        return models.DTYPES[par]
    return prec.compute if prec.compute in (torch.bfloat16, torch.float16) else None


def microbatch_tokens(
    cfg: Config, model: nn.Module, params: list[nn.Parameter], prec, device, *, beside_vllm: bool
):
    """``optim.max_tokens_per_microbatch``, sized with room left for AdamW's two moments."""
    adam_bytes = 2 * 4 * sum(parallel.local_numel(p) for p in params)
    return models.microbatch_budget(
        cfg.optim.max_tokens_per_microbatch,
        models.base_model(model).config,
        prec.compute,
        device,
        cfg.model.gradient_checkpointing,
        reserve=adam_bytes,
        beside_vllm=beside_vllm,
    )


def make_optimizer_for(cfg: Config, params: list[nn.Parameter]):
    """AdamW over ``params`` and its schedule, from the ``optim`` section."""
    o = cfg.optim
    return make_optimizer(
        params,
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        warmup=o.warmup_steps,
        total=o.max_steps,
        schedule=o.scheduler,
        min_ratio=o.min_lr_ratio,
    )


def make_rollout_engine(
    cfg: Config, kind: str, model: nn.Module, tokenizer, prec, dist: distributed.Dist, plan: cpu.CpuPlan
):
    """The rollout engine of ``kind`` (``rollout.engine`` resolved) on the live model; the HF engine
    generates under autocast where the step's forwards do (one process: mixed precision, and LoRA's
    float32 adapters over a half-precision base, which training computes in the compute dtype; without
    autocast peft ran the rollout's adapter products in float32, another function than the one
    trained) and takes the CPU plan's decoding mechanisms."""
    half_adapters = cfg.model.lora.enabled and prec.compute in precision.HALF
    amp = prec.compute if (prec.mixed or half_adapters) and dist.mesh is None else None
    return make_engine(
        cfg.rollout,
        model,
        tokenizer,
        seed=cfg.seed,
        kind=kind,
        max_prompt_len=cfg.data.max_prompt_len,
        # the held-out evaluation generates on the same engine, often longer than a rollout
        max_new_tokens=max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens if cfg.eval.path else 0),
        compute_dtype=prec.compute,
        autocast_dtype=amp,
        ranks=dist,
        run_dir=cfg.logging.run_dir,
        plan=plan,
    )


def open_run(
    cfg: Config, run_dir: Path, data_report: dict, plan: cpu.CpuPlan, resume: bool, after_step: int
) -> MetricsWriter:
    """Rank 0's run directory: the config, the CPU plan and the data report recorded, the metrics sinks
    opened."""
    r = data_report
    record_config(run_dir, cfg.model_dump(mode="json"), resume=resume)
    (run_dir / "data_report.json").write_text(json.dumps({"source": cfg.data.path, **r}))
    (run_dir / "cpu_plan.json").write_text(json.dumps(plan.as_dict(), indent=1))
    print(
        f"data: {r['rows']} rows from {cfg.data.path} (skipped {r['skipped_bad']} bad, "
        f"{r['empty_solution']} with empty privileged info, dropped {r['dropped_empty']})",
        file=sys.stderr,
    )
    return MetricsWriter(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        config=cfg.model_dump(mode="json"),
        after_step=after_step,
    )
