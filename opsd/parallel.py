"""How the models are spread over torchrun's ranks: FSDP2, one call from the trainer's setup
(:func:`parallelize`), and the sharded forward, head and gradient clipping the step uses.

The student is sharded with FSDP2 (``fully_shard``) per decoder layer and at the root; the root
unit keeps the embedding, final norm and lm_head. The fused loss multiplies hidden states by the
head weight outside any module's forward, so :func:`forward_hidden` runs the forward through the
root's FSDP hooks and :func:`full_head_weight` hands back the root's unsharded head; its gradient
lands in that unsharded parameter and FSDP reduce-scatters it into the sharded one after backward.
Gradients are *summed* over ranks (not averaged): opsd's loss weights are normalized by global
token or sequence counts, so the sum is the gradient of one big batch.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from opsd.devices import mesh_device, rng_devices
from opsd.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def parallelize(
    student: nn.Module,
    teacher_model: nn.Module | None,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype = torch.float32,
    teacher_offload: bool = False,
) -> None:
    """FSDP2 over ``mesh``, in place, in this order (as torchtitan's ``parallelize_llama`` applies
    ``fully_shard`` block by block, then to the root):

    1. the separate teacher network (the frozen copy of full fine-tuning, or an external model), if
       there is one: per decoder layer, then its root; with ``teacher_offload`` (GPUs with
       ``teacher.frozen_copy: cpu``) its shards stay in pinned host memory, gathered layer by layer;
    2. the student: per decoder layer, then the root, which keeps the embedding, final norm and
       lm_head gathered from its first forward to the end of backward (the fused loss multiplies by
       the head outside any module's forward).

    ``param_dtype`` is the compute dtype of the gathered weights (None: as stored), ``reduce_dtype``
    the dtype gradients are summed over ranks in. Call it after LoRA and activation checkpointing,
    after the teacher took its frozen copy and before its EMA snapshot (``Teacher.start``), and
    before the optimizer is built over the sharded parameters.
    """
    if teacher_model is not None:
        shard_model(
            teacher_model,
            mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=teacher_offload,
        )
    shard_model(student, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)


_HIDDEN_METHOD = "opsd_final_hidden"  # set on a sharded root by shard_model, run under FSDP's hooks


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
    dev = mesh_device(mesh.device_type)
    ids = torch.zeros((1, 2), dtype=torch.long, device=dev)
    with torch.no_grad(), torch.random.fork_rng(devices=rng_devices(dev)):  # dropout draws nothing
        forward_hidden(model, ids, torch.ones_like(ids), torch.zeros(1, dtype=torch.long, device=dev))
    model.reshard()


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def forward_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions: Tensor,
    rows: list[int] | None = None,
) -> Tensor:
    """Final hidden states ``[R, H]`` at ``positions``: ``final_hidden``, through FSDP's root hooks when
    sharded (one batched forward there: rows run packed in one process only).

    Use it for every forward of a model that may be sharded (student, adapter-disabled teacher,
    frozen copy); calling the decoder directly would skip the root's all-gather.
    """
    method = getattr(model, _HIDDEN_METHOD, None) if is_sharded(model) else None
    if method is not None:
        if rows is not None:
            raise ValueError("a sharded model runs its rows in one batched forward: pass rows=None")
        return method(input_ids, attention_mask, positions)
    from opsd.models import final_hidden

    return final_hidden(model, input_ids, attention_mask, positions, rows)


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
                "shard the model with opsd.parallel.shard_model"
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
