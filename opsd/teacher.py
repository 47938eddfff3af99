"""Where the teacher scores the student's response.

The teacher reads ``[teacher prompt (problem + reference solution) + response]`` in one
forward pass and hands back only its **final hidden states at the response positions**
(``[R, H]``) plus its lm_head weight. The loss turns them into logits a chunk at a time, so no
``[R, V]`` teacher logits ever exist (for Qwen3 that is 74x less memory than caching logits).

Modes: ``fixed`` (initial policy: LoRA adapter disabled, or a frozen copy), ``ema`` (moving
average of the student), ``live`` (current policy, no grad), ``external`` (another model with
the same tokenizer). None of them ever receives a gradient. The EMA weights are kept in float32
(or wider); a frozen copy's linear weights are kept in the compute dtype (``copy_dtype``), cast while
they are copied, and the rest as the student keeps them (:func:`frozen_copy_of`).

Under torchrun the student is FSDP-sharded, and so is a separate teacher network (the frozen
copy or the external model); forwards go through :func:`opsd.parallel.forward_hidden` so that
FSDP gathers the weights.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from opsd.devices import offloads_to_host
from opsd.errors import UserError
from opsd.models import base_model, check_plain_head, load_model, load_tokenizer
from opsd.parallel import forward_hidden, full_head_weight, is_sharded, reshard


class Teacher:
    """Scores responses with privileged context; holds whatever state its mode needs.

    Under torchrun (``sharded=True``) the order is fixed: this constructor takes the frozen copy from
    the still unsharded student; :func:`opsd.parallel.parallelize` then shards the separate teacher
    network (``self.model``) and the student; :meth:`start` takes the EMA snapshot last, of the
    sharded student, so that it is sharded like it. In one process :meth:`start` follows at once.
    """

    def __init__(
        self,
        mode: str,
        student: nn.Module,
        *,
        lora: bool,
        ema_decay: float = 0.999,
        external: nn.Module | None = None,
        frozen_copy: str = "device",
        copy_dtype: torch.dtype | None = None,
        sharded: bool = False,
    ) -> None:
        self.mode, self.student, self.lora, self.decay = mode, student, lora, ema_decay
        self.model: nn.Module | None = None  # a separate teacher network, when there is one
        self.offload = False  # one process: the frozen copy lives in host memory between micro-batches
        self.offload_shards = False  # torchrun on GPUs: FSDP keeps the frozen copy's shards in host memory
        self.ema: list[Tensor] = []
        if mode == "external":
            if external is None:
                raise ValueError("teacher mode 'external' needs the external model")
            self.model = external.requires_grad_(False).eval()
            check_plain_head(self.model)
        elif mode == "fixed" and not lora:
            # Never updated: it needs no float32 master copy. One process with frozen_copy=cpu makes it
            # in host memory directly, never on the accelerator.
            host = frozen_copy == "cpu" and not sharded
            self.model = frozen_copy_of(
                base_model(student), copy_dtype, torch.device("cpu") if host else None
            )
            if frozen_copy == "cpu" and sharded:
                self.offload_shards = offloads_to_host(self.model.device)  # FSDP's CPU offload: GPU runs
            elif host:
                self.offload = True
                self.model.to("cpu")  # the buffers (the parameters are there already)
                self._host = _pinned_host_copies(self.model)
        elif mode not in ("fixed", "live", "ema"):
            raise ValueError(f"unknown teacher mode {mode!r}: expected fixed, ema, live or external")
        if not sharded:
            self.start()

    def start(self) -> None:
        """Take the EMA snapshot of the student (sharded already, under torchrun); float32 or wider:
        at decay 0.999 a bf16 average would round most updates away."""
        if self.mode == "ema" and not self.ema:
            self.ema = [p.detach().to(_wide(p.dtype)).clone() for p in self._trainable()]

    @staticmethod
    def load_external(path: str, student_path: str, student_vocab: dict, **load_kwargs) -> nn.Module:
        """An external teacher model; it must share the student's vocabulary token for token."""
        if load_tokenizer(path).get_vocab() != student_vocab:
            raise UserError(
                f"teacher.path={path}: its tokenizer differs from the student's ({student_path}); "
                "an external teacher must share the student's vocabulary token for token"
            )
        return load_model(path, **load_kwargs)

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.student.parameters() if p.requires_grad]

    @contextmanager
    def _as_teacher(self, device: torch.device):
        """Make ``self.student`` (or the separate model) compute the teacher's function."""
        if self.model is not None:
            if self.offload:  # one host-to-device copy per micro-batch, from pinned memory; none back
                for t, host in self._host:
                    t.data = host.to(device, non_blocking=True)
            try:
                yield self.model
            finally:
                if self.offload:  # frozen: the host copy is still exact, the device copy is just dropped
                    for t, host in self._host:
                        t.data = host
        elif self.mode == "fixed":  # LoRA: the base model is the initial policy
            with self.student.disable_adapter():
                yield self.student
        elif self.mode == "ema":
            params, sharded = self._trainable(), is_sharded(self.student)
            # FSDP gathers from the sharded storage and ignores a ``.data`` swap: copy in place there.
            saved = [p.detach().clone() if sharded else p.data for p in params]
            _put(params, self.ema, in_place=sharded)
            try:
                yield self.student
            finally:
                reshard(self.student)  # FSDP: the gathered root holds EMA values; the student re-gathers
                _put(params, saved, in_place=sharded)
        else:  # live
            yield self.student

    @torch.no_grad()
    def score(
        self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, rows: list[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Teacher hidden states at the response positions ``[R, H]`` and its lm_head weight
        (``rows``: the rows packed into one forward, :func:`opsd.models.final_hidden`)."""
        with self._as_teacher(input_ids.device) as model:
            hidden = forward_hidden(model, input_ids, attention_mask, positions, rows)
            # Taken inside the context: the EMA swap or CPU offload is undone on exit, but this tensor
            # keeps pointing at the teacher's weights (no copy needed), except for a sharded EMA
            # teacher, whose gathered head is freed on exit.
            weight = full_head_weight(model).detach()
            if self.mode == "ema" and is_sharded(self.student):
                weight = weight.clone()
        return hidden, weight

    def release(self) -> None:
        """After the step's micro-batches: free a sharded teacher network's gathered root (it never
        runs a backward, which is when FSDP would free it)."""
        if self.model is not None:
            reshard(self.model)

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: move the EMA toward the student (other modes need nothing)."""
        if self.mode == "ema":
            for e, p in zip(self.ema, self._trainable()):
                e.lerp_(p.detach().to(e.dtype), 1 - self.decay)

    def tensors(self) -> dict[str, Tensor]:
        """The state a checkpoint must hold (the EMA weights, sharded like the student), by name."""
        return {f"teacher.ema.{i}": e for i, e in enumerate(self.ema)}


def frozen_copy_of(
    net: nn.Module, dtype: torch.dtype | None, device: torch.device | None = None
) -> nn.Module:
    """A frozen copy of ``net`` (no gradients, eval mode) whose linear layers' weights are made directly
    in ``dtype`` and every parameter on ``device`` (None: as they are), one parameter at a time.

    Only the matrices that autocast multiplies in the compute dtype are cast: the student's forwards
    (bf16 autocast over float32 masters) cast exactly those, and compute with the rest (the embedding,
    a head tied to it, the norms) in float32, its residual stream included. A copy that keeps the rest
    as the student does computes the student's function at step 0 bit for bit; a pure bf16 copy rounded
    its norms and its residual stream. Under torchrun FSDP2's policy casts every parameter of both.

    ``copy.deepcopy`` followed by ``.to(dtype)`` first cloned every parameter in its own dtype, on its
    own device: for bf16 compute over float32 masters on a GPU, a float32 copy of the whole model (6.9
    GB at Qwen3-1.7B) beside the masters, only to be cast and freed. Here each cast parameter is
    handed to ``deepcopy`` ready-made through its memo, so the peak beside ``net`` is the copy itself;
    tied weights stay tied (one memo entry per tensor). Buffers are deep-copied in their own dtype, as
    the student computes with them (a rotary ``inv_freq`` cast to bf16 would move every position's
    angle by up to 2^-9 of itself)."""
    embeddings = {id(m.weight) for m in net.modules() if isinstance(m, nn.Embedding)}
    linear = [m for m in net.modules() if isinstance(m, nn.Linear)]
    # autocast's matrices: linear weights and biases, less a head tied to the embedding
    matrices = {id(t) for m in linear for t in (m.weight, m.bias) if t is not None} - embeddings
    memo: dict[int, object] = {}
    for p in net.parameters():
        cast = dtype if dtype is not None and id(p) in matrices else p.dtype
        if cast != p.dtype or (device is not None and p.device != device):
            memo[id(p)] = nn.Parameter(
                p.detach().to(device=device or p.device, dtype=cast), requires_grad=False
            )
    return copy.deepcopy(net, memo).requires_grad_(False).eval()


def _put(params: list[nn.Parameter], values: list[Tensor], *, in_place: bool) -> None:
    for p, v in zip(params, values):
        if in_place:
            p.detach().copy_(v)
        else:
            p.data = v if v.dtype == p.dtype else v.to(p.dtype)


def _pinned_host_copies(model: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Each parameter and buffer with its CPU storage, page-locked where CUDA exists: a copy to the
    GPU from pageable memory is staged through a bounce buffer and cannot run asynchronously."""
    pin = torch.cuda.is_available()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        host = t.data.pin_memory() if pin else t.data
        t.data = host
        out.append((t, host))
    return out


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
