"""The process group at the edges of training: torchrun's environment, the device, the mesh,
collectives, rank agreement, and how a rank ends.

On one process without torchrun's environment nothing here creates a process group, and every
collective helper returns its input, so a plain ``opsd train`` runs exactly as it would without it.
Under ``torchrun`` the process group holds a gloo backend for CPU tensors and NCCL for CUDA tensors,
so control values (counts, flags, errors) travel on the CPU and never wait on a GPU stream.
FSDP2 lives in :mod:`opsd.parallel`, distributed checkpoints in :mod:`opsd.checkpoint`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from opsd.devices import collective_device, process_group_args, resolve_device, use_device
from opsd.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


T = TypeVar("T")

_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


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


def initialized() -> bool:
    """Whether a process group is up: without torchrun a run is one process and has none."""
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if initialized() else (0, 1)


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


def init_distributed(device: str, *, replicate: int = 1, timeout_s: float | None = None) -> Dist:
    """Read torchrun's environment, pick this rank's device and create the process group and mesh.

    Without torchrun's variables nothing is initialized: rank 0 of 1, ``device`` resolved as a single
    process always did ("auto" -> cuda if available, else cpu), ``mesh`` None. Under torchrun the
    device is ``cuda:LOCAL_RANK`` (or the CPU), the backend ``cpu:gloo,cuda:nccl`` (gloo on a CPU
    run), and ``mesh`` the FSDP mesh of :func:`build_mesh`. Call once, before any rollout engine starts.
    """
    env = _torchrun_env()
    if env is None:
        return Dist(device=use_device(resolve_device(device)))
    dev = resolve_device(device, local_rank=env["LOCAL_RANK"])
    if not initialized():
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(**process_group_args(dev), **kwargs)
    d = Dist(
        rank=env["RANK"],
        world_size=env["WORLD_SIZE"],
        local_rank=env["LOCAL_RANK"],
        local_world_size=env["LOCAL_WORLD_SIZE"],
        device=dev,
    )
    return replace(d, mesh=build_mesh(d, replicate=replicate))


def shutdown() -> None:
    """Destroy the process group if there is one (safe to call always, e.g. in a ``finally``)."""
    if initialized():
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


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """The argv that launches ``args`` on ``nproc`` local ranks with this interpreter's torchrun:
    ``python -m torch.distributed.run --standalone --nproc-per-node N *args`` (a script and its
    arguments, or ``-m module ...``). ``--standalone`` picks a free rendezvous port itself."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *args,
    ]


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
    if not initialized():
        return t
    devices = _backend_devices()
    if t.device.type in devices:
        dist.all_reduce(t, op=op)
        return t
    moved = t.to(collective_device(devices))
    dist.all_reduce(moved, op=op)
    return t.copy_(moved)


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over ranks in place and return it; moves it to a device the backend takes and back."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def agree_count(n: int) -> int:
    """The largest ``n`` over ranks: every rank runs that many micro-batches (FSDP's collectives must
    match)."""
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
    if initialized():
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
