"""What a training run is built from, in the order the code needs it.

:func:`build` makes every part a :class:`opsd.trainer.Trainer` runs (a :class:`RunParts`), top to
bottom; the Trainer only runs them. :func:`prepare_model` applies every model transform in one
ordered function (dtype, gradient checkpointing, LoRA, the teacher's frozen copy, parallelism, the
CPU plan, compile), the way torchtitan's ``parallelize`` does; :func:`load_data` reads the training
and held-out rows (:func:`load_heldout`, which `opsd probe` reads too); :func:`fsdp_param_dtype` and
:func:`microbatch_tokens` size what the trainer runs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from opsd import checkpoint, cpu, distributed, models, parallel, precision
from opsd.anchor import SFTAnchor, teacher_answers
from opsd.config import Config, resolve_engine
from opsd.data import DataCursor, Example, PromptBuilder, RowKeys, load_examples
from opsd.data.controls import apply_solution_source, boxed_target, require_other_solution
from opsd.data.solutions import Solutions
from opsd.data.sources import take_rows
from opsd.devices import check_compiler, resolve_device, use_device
from opsd.errors import UserError
from opsd.eval.sets import HeldoutSet, load_sets
from opsd.grading import as_grade, resolve_grader
from opsd.loss import DistillSpec, LossStats
from opsd.metrics import MetricsWriter
from opsd.microbatch import forward_backward
from opsd.objectives import Objective, Scores, floor_end_tokens, make_distillation, make_objective
from opsd.optim import make_optimizer
from opsd.rollout.base import EngineRun, RolloutEngine, SamplingParams, end_token_ids
from opsd.rollout.make import make_engine
from opsd.rollout.queue import RolloutQueue, SolutionQueue
from opsd.rundir import GracefulStop, prepare_run_dir, record_config
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
        RowKeys(
            problem=d.problem_key,
            solution=d.solution_key if privileged else None,
            answer=d.answer_key,
            target=d.target_key,
        ),
        split=d.split,
        skip_bad_rows=d.skip_bad_rows,
        drop_empty_solution=d.drop_empty_solution,
        require_answer=needs_answers,
    )
    rows = take_rows(loaded.examples, d.rows, "data.rows", d.path)
    # The controls (teacher.solution_source other, wrong_answer): what the teacher reads instead; nothing
    # to replace where no solutions are loaded.
    source = cfg.teacher.solution_source if privileged else "own"
    if source == "other":
        require_other_solution(rows, d.path)
    examples, refused = apply_solution_source(rows, source)
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
    # Solutions only for the held-out divergence: accuracy never shows them to the student.
    return Data(examples, report, cursor, load_heldout(cfg, solutions=cfg.eval.divergence))


def load_heldout(cfg: Config, *, solutions: bool) -> list[Example]:
    """The held-out rows (``eval.path``, ``eval.rows``, the first ``eval.limit``), each with its answer
    and, where ``solutions``, its ``data.solution_key``; none without an ``eval.path``."""
    e, d = cfg.eval, cfg.data
    if not e.path:
        return []
    loaded = load_examples(
        e.path,
        RowKeys(problem=d.problem_key, solution=d.solution_key if solutions else None, answer=e.answer_key),
        split=e.split,
        require_answer=True,
    )
    return take_rows(loaded.examples, e.rows, "eval.rows", e.path)[: e.limit]


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
    run = EngineRun(
        seed=cfg.seed,
        max_prompt_len=cfg.data.max_prompt_len,
        # the held-out evaluation generates on the same engine, often longer than a rollout
        max_new_tokens=max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens if cfg.eval.path else 0),
        compute_dtype=prec.compute,
        autocast_dtype=amp,
        ranks=dist,
        run_dir=cfg.logging.run_dir,
        plan=plan,
    )
    return make_engine(cfg.rollout, model, tokenizer, run=run, kind=kind)


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


# --- the run, built --------------------------------------------------------------------------------


@dataclass
class ObjectiveLoss:
    """An objective's loss on one micro-batch with the student's full head and the loss products' dtype:
    the ``loss_fn`` the micro-batch loop calls (the training objective, or the held-out divergence)."""

    objective: Objective
    model: nn.Module
    matmul_dtype: torch.dtype | None

    def __call__(self, s_hidden: Tensor, t_hidden, t_head, mb, scores: Scores) -> tuple[Tensor, LossStats]:
        head = parallel.full_head_weight(self.model)
        return self.objective.loss(
            s_hidden, t_hidden, t_head, mb, scores, head=head, matmul_dtype=self.matmul_dtype
        )


@dataclass
class MicroBatchLoop:
    """The step's micro-batch loop (:func:`opsd.microbatch.forward_backward`) as built for this run: its
    model, the teacher where the objective reads one, the loss and the forwards' autocast, inside the
    CPU plan's :meth:`~opsd.cpu.CpuPlan.around_microbatches`."""

    model: nn.Module
    teacher: Teacher | None
    loss: ObjectiveLoss
    autocast: Callable[[], AbstractContextManager]
    plan: cpu.CpuPlan

    def __call__(
        self, batches: list, scores: Scores | None = None, *, timer=None, backward: bool = True
    ) -> tuple[Tensor, LossStats]:
        with self.plan.around_microbatches():
            return forward_backward(
                self.model,
                self.teacher,
                batches,
                self.loss,
                scores=scores or Scores(),
                autocast=self.autocast,
                timer=timer,
                backward=backward,
            )


@dataclass
class LoadedRun:
    """:func:`load_run`'s parts: the rows, the tokenizer, the prompt builders and the SFT anchor."""

    data: Data
    tokenizer: Any
    prompts: PromptBuilder
    eval_prompts: PromptBuilder
    pad_id: int
    anchor: SFTAnchor | None


@dataclass
class Progress:
    """The run's counters: optimizer steps taken, and how many of the last ones were skipped as
    non-finite in a row (``optim.max_bad_steps``). A checkpoint part like any other."""

    step: int = 0
    bad_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.bad_steps = int(state["bad_steps"])


@dataclass
class RunParts(LoadedRun):
    """Everything a :class:`~opsd.trainer.Trainer` runs: the loaded run (:class:`LoadedRun`'s rows,
    tokenizer, prompt builders and anchor) and what :func:`build` makes on it, in the order the parts
    need each other. The Trainer reads them here (``trainer.run``), never copies them; what a
    checkpoint holds of them is :meth:`checkpointed`."""

    dist: distributed.Dist
    precision: precision.Precision
    plan: cpu.CpuPlan
    engine_kind: str
    objective: Objective
    spec: DistillSpec
    model: nn.Module
    teacher: Teacher
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: RolloutEngine
    queue: RolloutQueue
    mb_tokens: int
    autocast: Callable[[], AbstractContextManager]
    forward_backward: MicroBatchLoop
    divergence_loss: ObjectiveLoss
    eval_grader: Callable[[str, str | None], Any]
    eval_sets: list[HeldoutSet]
    skip_end: bool
    check_lp: bool
    stop: GracefulStop
    progress: Progress

    def checkpointed(self) -> checkpoint.RunState:
        """What a checkpoint saves and a resume restores: the trainable weights, optimizer and teacher
        tensors (``dcp/``), the parts every rank shares (rank 0 writes them, ``state.pt``) and each
        rank's own (``rank_NNNNN.pt``). A new checkpointed part is one entry here."""
        return checkpoint.RunState(
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            tensors=self.teacher.tensors(),
            shared={"progress": self.progress, "scheduler": self.scheduler, "cursor": self.data.cursor},
            per_rank={"truncated": self.prompts, "pending": self.queue},
        )


def build(
    cfg: Config, dist: distributed.Dist | None = None, *, resume: bool = False, overwrite: bool = False
) -> RunParts:
    """The run's parts, in the order they need each other; a failure on any rank ends every rank.
    ``dist``: this process's place among torchrun's ranks; without it one process on ``cfg.device``."""
    dist = dist or distributed.Dist(device=use_device(resolve_device(cfg.device)))
    prec = _precision(cfg, dist)
    # rollout.engine resolved once (auto: vLLM where installed); every part below takes the kind.
    kind, chosen = resolve_engine(cfg.rollout.engine)
    # The CPU plan (empty on a GPU), then what is trained for: distillation, GRPO, both, or RLSD.
    sharded, compiled = dist.mesh is not None, cfg.model.compile
    plan = cpu.resolve_plan(
        cfg.cpu, dist.device, prec.compute, engine=kind, sharded=sharded, compiled=compiled
    )
    chunk, slab = plan.loss_chunking(cfg.loss.chunk_size)
    objective = make_objective(cfg, chunk, slab)
    # eval.divergence measures the distillation loss, whatever objective trains.
    divergence = make_distillation(cfg, chunk, slab)
    spec = cfg.loss.to_spec(cfg.rollout.temperature)
    # Run directory, data and tokenizer; then the model and its teacher, every transform in order.
    loaded = distributed.run_setup(partial(load_run, cfg, dist, objective, resume, overwrite), "setup")
    # Without a teacher term the teacher runs only for eval.divergence: the initial policy where it
    # costs nothing (LoRA, adapter off), the live one otherwise (no second copy of the weights).
    no_term = "fixed" if cfg.model.lora.enabled else "live"
    mode = cfg.teacher.mode if objective.uses_teacher else no_term
    vocab = loaded.tokenizer.get_vocab()
    model, teacher, plan = prepare_model(cfg, dist, prec, plan, teacher_mode=mode, vocab=vocab)
    if cfg.loss.end_token == "floor":  # the end tokens are known once the tokenizer and model are
        ends = tuple(end_token_ids(loaded.tokenizer, model, []))
        objective = floor_end_tokens(objective, ends)
        spec = replace(spec, end_ids=ends)
    if dist.rank:  # dropout and anything else random differs per rank; rank 0 draws as one process does
        torch.manual_seed(distributed.rank_seed(cfg.seed, dist.rank))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(params, cfg.optim)
    started = partial(make_rollout_engine, cfg, kind, model, loaded.tokenizer, prec, dist, plan)
    engine = distributed.run_setup(started, "rollout engine start")
    engine.sleep()  # the budget is measured without vLLM resident (rollout() wakes it)
    mb_tokens, why = microbatch_tokens(cfg, model, params, prec, dist.device, beside_vllm=kind == "vllm")
    if dist.rank == 0:
        print(f"rollout engine: {kind} ({chosen})", file=sys.stderr)
        print(
            describe_run(prec, objective, spec, plan, f"up to {mb_tokens} padded tokens ({why})"),
            file=sys.stderr,
        )
    autocast = make_autocast(cfg, prec, dist, model)
    loss_mm = precision.loss_matmul_dtype(prec, dist.device) if cfg.loss.products == "auto" else None
    loop = MicroBatchLoop(
        model,
        teacher if objective.uses_teacher else None,
        ObjectiveLoss(objective, model, loss_mm),
        autocast,
        plan,
    )
    grader = resolve_grader(cfg.eval.grader, "eval.grader")
    return RunParts(
        dist=dist,
        precision=prec,
        plan=plan,
        engine_kind=kind,
        objective=objective,
        spec=spec,
        **vars(loaded),  # the rows, the tokenizer, the prompt builders, the anchor
        model=model,
        teacher=teacher,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        queue=make_queue(cfg, engine, loaded, dist, plan),
        mb_tokens=mb_tokens,
        autocast=autocast,
        forward_backward=loop,
        divergence_loss=ObjectiveLoss(divergence, model, loss_mm),
        eval_grader=partial(_graded, grader),
        eval_sets=load_sets(cfg, [ex.answer for ex in loaded.data.examples]),
        skip_end=cfg.loss.end_token == "skip" and cfg.objective == "opsd",
        check_lp=cfg.rollout.checks_logprobs(kind),
        stop=GracefulStop(),
        progress=Progress(),
    )


def describe_run(
    prec: precision.Precision, objective: Objective, spec: DistillSpec, plan: cpu.CpuPlan, microbatches: str
) -> str:
    """The run's precision, loss (where a teacher term trains), CPU plan and micro-batches, a line each."""
    lines = [f"precision: {prec.describe()}"]
    if objective.uses_teacher:
        lines.append(f"loss: {spec.describe()}")
    lines += [f"cpu plan: {plan.describe()}", f"micro-batches: {microbatches}"]
    return "\n".join(lines)


def make_queue(
    cfg: Config, engine: RolloutEngine, loaded: LoadedRun, dist: distributed.Dist, plan: cpu.CpuPlan
) -> RolloutQueue:
    """What each step trains on: the drawn problems' rollouts, or with ``objective: sft`` their
    reference solutions (a GSM8K ``#### N`` ending in the student's answer format, ``\\boxed{N}``)."""
    d = loaded.data
    parts = (cfg, engine, d.cursor, loaded.prompts, d.examples, dist)
    if cfg.objective != "sft":
        return RolloutQueue(*parts, plan=plan)
    limit = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    answers = None
    if cfg.data.sft_targets == "teacher":  # context distillation: the initial model's answers, solution read
        greedy = SamplingParams.from_rollout(cfg.rollout, cfg.seed)
        greedy.temperature = 0.0
        path = Path(cfg.logging.run_dir) / "sft_targets.jsonl"
        # A builder of their own: eval_prompts caches the held-out rows' prompts by the same indices.
        teacher = PromptBuilder(loaded.tokenizer, cfg.data, privileged=True)
        answers = teacher_answers(engine, teacher, d.examples, greedy, path, dist.rank == 0)
    solutions = Solutions(
        loaded.tokenizer, d.examples, cfg.data, limit, target=boxed_target, token_targets=answers
    )
    return SolutionQueue(solutions, *parts, plan=plan)


def _precision(cfg: Config, dist: distributed.Dist) -> precision.Precision:
    """The start of a run: one seed on every rank (LoRA's initial weights must agree before sharding),
    ``model.compile`` refused where it cannot run before anything loads, and the precision:
    ``model.dtype`` the compute dtype, full fine-tuning in bf16 keeping float32 masters."""
    m = cfg.model
    torch.manual_seed(cfg.seed)
    if m.compile:
        if dist.mesh is not None:
            raise UserError("model.compile=true runs in one process, not under torchrun: set it false")
        check_compiler(dist.device)
    return precision.resolve(m.dtype, dist.device, full_finetune=not m.lora.enabled, pure_bf16=m.pure_bf16)


def _graded(grader: Callable, response: str, gold: str | None) -> Any:
    """``eval.grader``'s verdict on one held-out response, as a grade."""
    return as_grade(grader(response, gold))


def load_run(
    cfg: Config, dist: distributed.Dist, objective: Objective, resume: bool, overwrite: bool
) -> LoadedRun:
    """The run directory (rank 0 prepares it), the rows, the tokenizer and the prompt builders."""
    run_dir = Path(cfg.logging.run_dir)
    if dist.rank == 0:
        has_checkpoint = checkpoint.latest_checkpoint(run_dir) is not None
        prepare_run_dir(run_dir, resume=resume, overwrite=overwrite, has_checkpoint=has_checkpoint)
        checkpoint.clean_partial(run_dir)
    # Solutions where a teacher reads them, or the SFT anchor or objective trains on them.
    privileged = cfg.teacher.privileged and (objective.uses_teacher or cfg.loss.sft_coef > 0)
    privileged = privileged or cfg.objective == "sft"
    needs = objective.needs_answers
    data = load_data(cfg, privileged=privileged, needs_answers=needs, rank=dist.rank, world=dist.world_size)
    tokenizer = models.load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    prompts = PromptBuilder(tokenizer, cfg.data, privileged=cfg.teacher.privileged)
    eval_prompts = PromptBuilder(tokenizer, cfg.data, privileged=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    coef, limit = cfg.loss.sft_coef, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    anchor = SFTAnchor(coef, tokenizer, data.examples, cfg.data, limit) if coef > 0 else None
    return LoadedRun(data, tokenizer, prompts, eval_prompts, pad_id, anchor)


def make_autocast(
    cfg: Config, prec: precision.Precision, dist: distributed.Dist, model: nn.Module
) -> Callable[[], AbstractContextManager]:
    """The forwards' context: bf16 compute over float32 master weights in one process, and LoRA's
    float32 adapters computing in bf16 over a bf16 base; around the model forwards only, never the
    loss. Under torchrun FSDP2's mixed-precision policy casts instead (:func:`fsdp_param_dtype`)."""
    if dist.mesh is not None:
        return nullcontext
    adapters = model if cfg.model.lora.enabled else None
    return partial(precision.autocast, prec, dist.device, adapters)


def open_metrics(cfg: Config, parts: RunParts, *, resume: bool, after_step: int) -> MetricsWriter | None:
    """Rank 0 records the config, the CPU plan and the data report and opens the metrics sinks (after
    a resume, past ``after_step``); the other ranks get None. A failure on any rank ends every rank."""

    def opened() -> MetricsWriter | None:
        if parts.dist.rank:
            return None
        report = parts.data.report
        return open_run(cfg, Path(cfg.logging.run_dir), report, parts.plan, resume, after_step)

    return distributed.run_setup(opened, "run directory setup")
