"""How the models are spread over torchrun's ranks: one call, :func:`parallelize`, from the trainer's
setup. The FSDP2 building blocks (:func:`opsd.distributed.shard_model`, the sharded forward, the
gathered head) live in :mod:`opsd.distributed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from opsd.distributed import shard_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from opsd.teacher import Teacher


def parallelize(
    student: nn.Module,
    teacher: Teacher,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """FSDP2 over ``mesh``, in place, in this order (as torchtitan's ``parallelize_llama`` applies
    ``fully_shard`` block by block, then to the root):

    1. the separate teacher network (the frozen copy of full fine-tuning, or an external model), if
       there is one: per decoder layer, then its root; on GPUs with ``teacher.frozen_copy: cpu`` its
       shards stay in pinned host memory and are gathered layer by layer;
    2. the student: per decoder layer, then the root, which keeps the embedding, final norm and
       lm_head gathered from its first forward to the end of backward (the fused loss multiplies by
       the head outside any module's forward).

    ``param_dtype`` is the compute dtype of the gathered weights (None: as stored), ``reduce_dtype``
    the dtype gradients are summed over ranks in. Call it after LoRA and activation checkpointing,
    after the teacher took its frozen copy and before its EMA snapshot (``teacher.start()``), and
    before the optimizer is built over the sharded parameters.
    """
    if teacher.model is not None:
        shard_model(teacher.model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                    cpu_offload=teacher.offload_shards)
    shard_model(student, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
