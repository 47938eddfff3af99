"""Data parallelism at the edges of training: torchrun, FSDP2, rank agreement, distributed checkpoints.

On one process without torchrun's environment nothing here creates a process group, and every
collective helper returns its input, so a plain ``opsd train`` runs exactly as it would without it. Under ``torchrun`` the process group
holds a gloo backend for CPU tensors and NCCL for CUDA tensors, so control values (counts, flags,
errors) travel on the CPU and never wait on a GPU stream.

The student is sharded with FSDP2 (``fully_shard``) per decoder layer and at the root; the root
unit keeps the embedding, final norm and lm_head. The fused loss multiplies hidden states by the
head weight outside any module's forward, so :func:`forward_hidden` runs the forward through the
root's FSDP hooks and :func:`full_head_weight` hands back the root's unsharded head; its gradient
lands in that unsharded parameter and FSDP reduce-scatters it into the sharded one after backward.
Gradients are *summed* over ranks (not averaged): opsd's loss weights are normalized by global
token or sequence counts, so the sum is the gradient of one big batch.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from opsd.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from opsd.data.batching import MicroBatch

T = TypeVar("T")

_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
_HIDDEN_METHOD = "opsd_final_hidden"  # set on a sharded root by shard_model, run under FSDP's hooks


class PeerError(RuntimeError):
    """Another rank failed; raised on the ranks that did not, with that rank's message."""


# --- process group and device -----------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``mesh`` is None on one process without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory, logs and exports."""
        return self.rank == 0


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if _initialized() else (0, 1)


def _torchrun_env() -> dict[str, int] | None:
    present = [k for k in _TORCHRUN_ENV if k in os.environ]
    if not present:
        return None
    if len(present) != len(_TORCHRUN_ENV):
        missing = sorted(set(_TORCHRUN_ENV) - set(present))
        raise UserError(
            f"torchrun environment is incomplete: {present} set but {missing} missing; launch with torchrun"
        )
    try:
        return {k: int(os.environ[k]) for k in _TORCHRUN_ENV}
    except ValueError:
        values = [f"{k}={os.environ[k]}" for k in _TORCHRUN_ENV]
        raise UserError(f"torchrun environment is not integers: {values}") from None


def _resolve_device(device: str, local_rank: int, launched: bool) -> torch.device:
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise UserError(f"device={device!r}: expected auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but CUDA is not available on this machine; use device: cpu")
    if not launched:
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(device)
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device.startswith("cuda:"):
        raise UserError(
            f"device={device!r} pins every rank to one GPU; under torchrun use device: cuda or auto "
            "(rank r uses cuda:LOCAL_RANK)"
        )
    if local_rank >= torch.cuda.device_count():
        raise UserError(
            f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
            "set --nproc-per-node to at most the GPU count"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device: str, *, replicate: int = 1, timeout_s: float | None = None) -> Dist:
    """Read torchrun's environment, pick this rank's device and create the process group and mesh.

    Without torchrun's variables nothing is initialized: rank 0 of 1, ``device`` resolved as a single
    process always did ("auto" -> cuda if available, else cpu), ``mesh`` None. Under torchrun the
    device is ``cuda:LOCAL_RANK`` (or the CPU), the backend ``cpu:gloo,cuda:nccl`` (gloo on a CPU
    run), and ``mesh`` the FSDP mesh of :func:`build_mesh`. Call once, before any rollout engine starts.
    """
    env = _torchrun_env()
    if env is None:
        return Dist(device=use_device(_resolve_device(device, 0, launched=False)))
    dev = _resolve_device(device, env["LOCAL_RANK"], launched=True)
    if not _initialized():
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=dev, **kwargs)
        else:
            dist.init_process_group(backend="gloo", **kwargs)
    d = Dist(
        rank=env["RANK"],
        world_size=env["WORLD_SIZE"],
        local_rank=env["LOCAL_RANK"],
        local_world_size=env["LOCAL_WORLD_SIZE"],
        device=dev,
    )
    return replace(d, mesh=build_mesh(d, replicate=replicate))


def use_device(dev: torch.device) -> torch.device:
    """Make ``cuda:N`` the current CUDA device of this process; returns ``dev``. Without it, one
    process on cuda:1 keeps cuda:0 as current: step timers, the CUDA RNG state in checkpoints and
    vLLM's engine would go to cuda:0."""
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def shutdown() -> None:
    """Destroy the process group if there is one (safe to call always, e.g. in a ``finally``)."""
    if _initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank whose work is done without Python's interpreter finalization.

    Why: a gloo worker thread marks a collective complete and only afterwards drops its last
    reference to the work, whose tensors are Python objects; freeing them takes the GIL. If the
    main thread has meanwhile returned and started finalizing (the FSDP mesh and DTensor's caches
    keep the process group alive, so ``destroy_process_group`` does not join those threads), the
    worker's GIL request ends the thread inside a C++ destructor, and the process aborts with
    "terminate called without an active exception" (SIGABRT) after a successful run: seen in about
    1 of 20 two-rank runs on a busy 2-core machine; the core dump shows ``take_gil`` ->
    ``PyThread_exit_thread`` from ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork``.
    Every collective has completed when this is called and everything opsd writes is closed, so the
    rank flushes its streams and leaves with ``os._exit``; no finalization, no race.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def launched_by_torchrun() -> bool:
    """torchrun's variables are set (complete or not: an incomplete set is a user error elsewhere)."""
    return any(k in os.environ for k in _TORCHRUN_ENV)


def build_mesh(d: Dist, *, replicate: int = 1) -> DeviceMesh:
    """The data-parallel mesh: 1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` for HSDP.

    HSDP shards within a group of ``world_size / replicate`` ranks (usually one node) and replicates
    across groups, so parameter all-gathers stay on the fast intra-node links.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if replicate < 1 or d.world_size % replicate:
        raise UserError(
            f"parallel.replicate={replicate} must be >= 1 and divide the world size {d.world_size}"
        )
    if replicate == 1:
        return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        d.device.type, (replicate, d.world_size // replicate), mesh_dim_names=("replicate", "shard")
    )


def rank_seed(seed: int, rank: int) -> int:
    """A per-rank seed for rollouts and dropout; rank 0 keeps ``seed`` so one process is unchanged."""
    return (seed + rank * 0x9E3779B97F4A7C15) % 2**63


# --- rank agreement -----------------------------------------------------------------------------


def _backend_devices() -> set[str]:
    """Device types the default group's backend(s) accept, e.g. {"cpu", "cuda"} for cpu:gloo,cuda:nccl."""
    backend = str(dist.get_backend())
    if ":" in backend:
        return {part.split(":")[0] for part in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu"}}.get(backend, {"cpu", "cuda"})


def _all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
    if not _initialized():
        return t
    devices = _backend_devices()
    if t.device.type in devices:
        dist.all_reduce(t, op=op)
        return t
    moved = t.to(torch.device("cuda", torch.cuda.current_device()) if "cuda" in devices else "cpu")
    dist.all_reduce(moved, op=op)
    return t.copy_(moved)


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over ranks in place and return it; moves it to a device the backend takes and back."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def agree_count(n: int) -> int:
    """The largest ``n`` over ranks: every rank runs that many micro-batches (FSDP's collectives must match)."""
    return int(_all_reduce(torch.tensor([n], dtype=torch.int64), dist.ReduceOp.MAX).item())


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any (a stop signal seen by one rank stops all)."""
    return bool(_all_reduce(torch.tensor([int(flag)], dtype=torch.int64), dist.ReduceOp.MAX).item())


def first_error(err: BaseException | str | None) -> tuple[int, str, bool] | None:
    """Collective: each rank passes its error (or None); every rank gets ``(rank, message, is_user_error)``
    of the lowest failing rank, or None when all succeeded."""
    mine = None
    if isinstance(err, UserError):
        mine = (str(err), True)
    elif isinstance(err, BaseException):
        mine = (f"{type(err).__name__}: {err}", False)
    elif err is not None:
        mine = (err, False)
    gathered = [mine]
    if _initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    return next(((r, *g) for r, g in enumerate(gathered) if g is not None), None)


def check_ok(err: BaseException | str | None, what: str = "setup") -> None:
    """Collective: raise on every rank if any rank failed ``what``.

    The failing rank re-raises its own exception (original traceback and type); the others raise
    :class:`UserError` (if it was one, so the CLI prints one line and exits 2) or :class:`PeerError`,
    naming the failing rank and its message. Call it at the same point on every rank.
    """
    found = first_error(err)
    if found is None:
        return
    if isinstance(err, BaseException):
        raise err
    rank, msg, user = found
    text = f"rank {rank} failed during {what}: {msg}"
    raise UserError(text) if user else PeerError(text)


def run_setup(fn: Callable[[], T], what: str = "setup") -> T:
    """Run one setup phase on every rank and agree on its outcome (see :func:`check_ok`).

    Without it, an exception on rank 0 (say, an existing run directory) leaves the other ranks
    blocked in their next collective until the process-group timeout.
    """
    try:
        result, err = fn(), None
    except Exception as e:  # noqa: BLE001 -- every failure must reach the other ranks
        result, err = None, e
    check_ok(err, what)
    return result  # type: ignore[return-value]


# --- FSDP2 ----------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Llama/Qwen-style model (under a peft wrapper too)."""
    from opsd.models import base_model

    base = base_model(model)
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None and hasattr(base, "get_decoder"):
        layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UserError(
            f"{type(base).__name__}: no decoder layers at .model.layers; FSDP sharding needs them"
        )
    return layers


def _hidden_method(self: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
    from opsd.models import final_hidden

    return final_hidden(self, input_ids, attention_mask, positions)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2-shard ``model`` in place: each decoder layer, then the root; returns it.

    Apply LoRA (and gradient checkpointing) before, build the optimizer after (over the sharded
    parameters). ``param_dtype`` is the compute dtype of the all-gathered weights (None: as stored),
    ``reduce_dtype`` the dtype gradients are summed in. The root unit (embedding, norm, lm_head) stays
    unsharded from its forward until backward ends, which is what lets the fused loss use the head.
    A frozen model (a full-fine-tuning teacher copy) can be sharded the same way; call
    :func:`reshard` on it after the micro-batch's loss, since it never runs a backward.
    ``cpu_offload`` keeps sharded parameters, gradients and optimizer state in (pinned) CPU memory.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise UserError(
            f"torch {torch.__version__} lacks FSDPModule.set_force_sum_reduction_for_comms, which opsd's "
            "torchrun path needs (plain SUM gradient reductions); install a newer torch (2.13 is tested)"
        )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum over ranks: the loss weights are already global
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    setattr(model, _HIDDEN_METHOD, types.MethodType(_hidden_method, model))
    register_fsdp_forward_method(model, _HIDDEN_METHOD)
    if hasattr(model, "generate"):  # peft's generate calls the inner model, past the root's hooks
        register_fsdp_forward_method(model, "generate")
    _first_forward(model, mesh)
    return model


def _first_forward(model: nn.Module, mesh: DeviceMesh) -> None:
    """Run FSDP's lazy initialization now, with the trainable set as configured.

    FSDP fixes each unit's gradient dtype at the first root forward, from which parameters require
    grad at that moment. The first forward of a step is the LoRA teacher's, under peft's
    ``disable_adapter()``, which switches requires_grad off: FSDP would then hand bf16 gradients to
    fp32 adapter weights. A two-token forward here avoids that.
    """
    cuda = mesh.device_type == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
    ids = torch.zeros((1, 2), dtype=torch.long, device=dev)
    with torch.no_grad(), torch.random.fork_rng(devices=[dev] if cuda else []):  # dropout draws nothing
        forward_hidden(model, ids, torch.ones_like(ids), torch.zeros(1, dtype=torch.long, device=dev))
    model.reshard()


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def forward_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
    """Final hidden states ``[R, H]`` at ``positions``: ``final_hidden``, through FSDP's root hooks when sharded.

    Use it for every forward of a model that may be sharded (student, adapter-disabled teacher,
    frozen copy); calling the decoder directly would skip the root's all-gather.
    """
    method = getattr(model, _HIDDEN_METHOD, None) if is_sharded(model) else None
    if method is not None:
        return method(input_ids, attention_mask, positions)
    from opsd.models import final_hidden

    return final_hidden(model, input_ids, attention_mask, positions)


def full_head_weight(model: nn.Module) -> Tensor:
    """The full lm_head weight ``[V, H]`` for the fused loss; call it after this micro-batch's forward.

    Unsharded models: ``head_weight(model)``. Sharded ones: the root's unsharded parameter (unsharding
    the root if it is not), a leaf whose ``.grad`` FSDP reduce-scatters into the sharded head (tied
    or not) after backward. Never keep it across micro-batches: FSDP frees its storage at reshard.
    """
    from torch.distributed.tensor import DTensor

    from opsd.models import head_weight

    w = head_weight(model)
    if isinstance(w, DTensor):
        if not is_sharded(model):
            raise UserError(
                "the lm_head weight is sharded but the model root is not an FSDP module; "
                "shard the model with opsd.distributed.shard_model"
            )
        model.unshard()
        w = head_weight(model)
    return w


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP unit of ``model`` unsharded once, for a stretch of no-grad forwards (generation,
    evaluation), then resharded: one all-gather per unit instead of one per unit per decoded token.

    Layers reshard after each forward for training; under ``generate`` that re-gathered the whole
    model at every token (about 3.4 GB per token at Qwen3-1.7B) and kept the ranks in lockstep.
    With the weights gathered, each rank generates on its own: no collective until the reshard.
    TRL's ZeRO-3 generation gathers the same way, once around ``generate``. The cost is the full
    model's weights on every rank for the duration. A no-op on an unsharded model.
    """
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(model):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            if m is not model:  # the root keeps its unsharded head through the step (shard_model)
                m.set_reshard_after_forward(True, recurse=False)


def reshard(model: nn.Module) -> None:
    """Free a sharded model's unsharded root (for a frozen teacher after its micro-batch); no-op otherwise."""
    if is_sharded(model):
        model.reshard()


def local_numel(t: Tensor) -> int:
    """Elements this rank holds: a sharded parameter's shard, or the whole tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def clip_grad_norm(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """Clip (sharded) gradients to a global norm; returns that norm as a plain tensor, equal on all ranks."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def zero_weight_microbatch(pad_id: int, device: torch.device | str) -> MicroBatch:
    """A two-token micro-batch whose one response token weighs 0: runs the collectives, adds nothing."""
    from opsd.data.batching import MicroBatch

    dev = torch.device(device)
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    return MicroBatch(
        student_ids=ids,
        student_mask=mask,
        student_pos=pos,
        teacher_ids=ids,
        teacher_mask=mask,
        teacher_pos=pos,
        targets=torch.full((1,), pad_id, dtype=torch.long, device=dev),
        weights=torch.zeros(1, dtype=torch.float32, device=dev),
        rollout_logprobs=None,
        response_lens=[1],
        sample_indices=[],
        student_real_tokens=0,
        student_padded_tokens=2,
        teacher_real_tokens=0,
        teacher_padded_tokens=2,
    )


def pad_microbatches(mbs: list[MicroBatch], pad_id: int, device: torch.device | str) -> list[MicroBatch]:
    """This rank's micro-batches plus zero-weight ones, up to the largest count on any rank."""
    n = agree_count(len(mbs))
    return mbs + [zero_weight_microbatch(pad_id, device) for _ in range(n - len(mbs))]


# --- distributed checkpoints ----------------------------------------------------------------------

_DCP_DIR = "dcp"
_SHARED = "state.pt"  # also what opsd.checkpoint.list_checkpoints looks for
_META = "distributed.json"
TMP_PREFIX = ".tmp-"  # a directory being written; opsd.checkpoint.clean_partial removes leftovers


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load; that is the intended use here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _check_plain(obj: Any, what: str) -> bytes:
    """Serialize ``obj`` and prove it loads with ``weights_only=True`` (so resume can load it)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as err:
        raise TypeError(f"{what} must hold only tensors and plain data to be loadable safely: {err}") from err
    return buf.getvalue()


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Model (trainable parameters only) and optimizer state keyed by parameter name, sharded as live."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    return {"model": model_sd, "optim": optim_sd}


def save_distributed(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra_state_per_rank: dict,
    shared_state: dict,
    *,
    tensors: dict[str, Tensor] | None = None,
    export: Callable[[Path], None] | None = None,
    collective_export: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: write a checkpoint to ``ckpt_dir`` atomically; every rank calls it, rank 0 commits.

    * ``dcp/``: trainable parameters and optimizer state (torch.distributed.checkpoint, one file per
      rank plus metadata; loads at any world size), and ``tensors`` (e.g. the EMA teacher).
    * ``rank_NNNNN.pt``: each rank's ``extra_state_per_rank`` (its RNG state, ...).
    * ``state.pt``: rank 0's ``shared_state`` (step, scheduler, data cursor, ...).
    * whatever ``export(tmp_dir)`` writes on rank 0 (the Hugging Face adapter / merged model, from a
      :func:`gather_full_state_dict` every rank called before), and whatever
      ``collective_export(tmp_dir)`` writes, which every rank calls (it streams gathered tensors to
      rank 0; it must run its collectives to the end on every rank and raise only after them).

    Everything goes to ``.tmp-<name>`` beside ``ckpt_dir``; after all ranks finished, rank 0 renames
    it into place. A kill at any point leaves either the previous checkpoints or the complete new one
    (plus a ``.tmp-*`` that ``opsd.checkpoint.clean_partial`` removes). Extra and shared state must be
    plain data (weights_only-loadable). A failure on any rank raises on all ranks, and the temporary
    directory is removed. Works without a process group (one process).
    """
    import torch.distributed.checkpoint as dcp

    final = Path(ckpt_dir)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}"
    rank, world = rank_world()

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    run_setup(prepare, f"checkpoint save to {final}")
    try:
        state = _state_dicts(model, optimizer)
        if tensors:
            state["tensors"] = dict(tensors)
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp / _DCP_DIR, no_dist=not _initialized())

        def write_own() -> None:
            (tmp / _rank_file(rank)).write_bytes(_check_plain(extra_state_per_rank, "extra_state_per_rank"))
            if rank == 0:
                (tmp / _SHARED).write_bytes(_check_plain(shared_state, "shared_state"))
                (tmp / _META).write_text(json.dumps({"world_size": world}))
                if export is not None:
                    export(tmp)

        run_setup(write_own, f"checkpoint save to {final}")
        if collective_export is not None:
            run_setup(lambda: collective_export(tmp), f"checkpoint export to {final}")

        def commit() -> None:
            if rank != 0:
                return
            if final.exists():  # re-saving a step: the old copy stays until the new one is in place
                old = final.parent / f"{TMP_PREFIX}old-{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)

        run_setup(commit, f"checkpoint commit of {final}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


@dataclass
class Loaded:
    """What :func:`load_distributed` hands back besides the in-place loads."""

    shared_state: dict
    rank_state: dict | None  # this rank's extra state; None if the checkpoint had fewer ranks
    saved_world_size: int


def load_distributed(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    tensors: dict[str, Tensor] | None = None,
) -> Loaded:
    """Collective: load a :func:`save_distributed` checkpoint in place, at any world size.

    Model, optimizer and ``tensors`` are resharded to the current layout (2 ranks -> 1, 1 -> 2, ...).
    Per-rank state only maps back at the same world size or for ranks that existed: a new rank gets
    ``rank_state=None`` and should seed itself from :func:`rank_seed`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    ckpt = Path(ckpt_dir)
    if not (ckpt / _DCP_DIR).is_dir() or not (ckpt / _SHARED).is_file():
        raise UserError(f"{ckpt}: not a distributed checkpoint (no {_DCP_DIR}/ or {_SHARED})")
    rank, _ = rank_world()
    state = _state_dicts(model, optimizer)
    if tensors:
        state["tensors"] = dict(tensors)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=ckpt / _DCP_DIR, no_dist=not _initialized())
    # strict=False: frozen weights are not in the checkpoint (they come from the model source); a
    # missing trainable tensor already failed in dcp.load, which loads every key it is asked for.
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"], options=opts)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
        )
    if tensors:
        for name, t in tensors.items():
            if state["tensors"][name] is not t:
                t.copy_(state["tensors"][name])
    rank_path = ckpt / _rank_file(rank)
    return Loaded(
        shared_state=torch.load(ckpt / _SHARED, weights_only=True),
        rank_state=torch.load(rank_path, weights_only=True) if rank_path.is_file() else None,
        saved_world_size=json.loads((ckpt / _META).read_text())["world_size"]
        if (ckpt / _META).is_file()
        else 1,
    )


def gather_full_state_dict(
    model: nn.Module, *, trainable_only: bool = False, all_ranks: bool = False
) -> dict[str, Tensor]:
    """Collective: full (unsharded) weights under the model's own parameter names, for an HF export.

    Rank 0 gets CPU tensors and the other ranks ``{}``; with ``all_ranks`` every rank gets them on its
    device (a per-rank rollout engine needs them). The live weights are never modified; on one
    process without sharding the tensors are the live ones (detached), so do not change them in place.
    """
    if not is_sharded(model):
        return {
            k: v.detach()
            for k, v in model.state_dict().items()
            if not trainable_only or k in _trainable_names(model)
        }
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(
        full_state_dict=True, cpu_offload=not all_ranks, ignore_frozen_params=trainable_only
    )
    return get_model_state_dict(model, options=opts)


def _trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Collective: ``(name, full tensor)`` one at a time on every rank, for streaming weight sync.

    Peak memory is one full tensor, not the whole model. Every rank must drain the iterator.
    """
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        yield name, t.full_tensor() if isinstance(t, DTensor) else t.detach()
