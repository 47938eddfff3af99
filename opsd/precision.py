"""Which dtype computes and which one stores the weights: one resolver for train, eval and sft.

``model.dtype`` is the **compute** dtype of the model's forwards. ``auto`` picks bfloat16 where the
device has bf16 matrix units (every CUDA GPU that supports bf16; a CPU with AMX-BF16 or
AVX512-BF16, :mod:`opsd.cpu.bf16`) and float32 elsewhere (:func:`opsd.devices.has_bf16_units`).

The **storage** dtype follows from it:

* full fine-tuning in bf16 keeps float32 master weights and float32 AdamW state, and computes in
  bf16: in one process through ``torch.autocast`` around the model forwards (never around the loss,
  which stays float32); under torchrun through FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``.
  Without a master copy AdamW's small updates round away: in 10 steps at lr 5e-6, 5% of the tiny
  model's weights moved at all, against 94% with masters (tests/train/test_precision.py).
  ``model.pure_bf16: true`` opts into bf16 storage.
* LoRA stores the frozen base in the compute dtype (no second copy) and the adapters in float32.
* evaluation and generation store the weights in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from opsd.devices import has_bf16_units
from opsd.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
HALF = (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compute_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """``model.dtype`` -> the compute dtype and the reason (a one-line notice)."""
    if setting != "auto":
        if setting not in DTYPES:
            raise UserError(f"model.dtype={setting!r} not supported; allowed: auto, {', '.join(DTYPES)}")
        return DTYPES[setting], "set in the config"
    has, why = has_bf16_units(device)
    return (torch.bfloat16 if has else torch.float32), why


@dataclass(frozen=True)
class Precision:
    """``compute``: the dtype of the model's forwards; ``storage``: the dtype the weights are loaded
    and kept in (for full fine-tuning, the master weights AdamW updates)."""

    compute: torch.dtype
    storage: torch.dtype
    why: str

    @property
    def mixed(self) -> bool:
        """Weights stored wider than they compute (bf16 compute over float32 master weights)."""
        return self.compute != self.storage

    def describe(self) -> str:
        if self.mixed:
            return (
                f"compute {dtype_name(self.compute)} over {dtype_name(self.storage)} master weights "
                f"({self.why})"
            )
        return f"{dtype_name(self.compute)} ({self.why})"


def resolve(setting: str, device: torch.device, *, full_finetune: bool, pure_bf16: bool = False) -> Precision:
    """The one dtype resolver of `opsd train`, `opsd eval` and `opsd sft`.

    ``full_finetune``: every weight is trained, so a half-precision compute dtype gets float32
    master weights unless ``pure_bf16``. LoRA and evaluation store the weights as they compute.
    """
    compute, why = compute_dtype(setting, device)
    storage = torch.float32 if compute in HALF and full_finetune and not pure_bf16 else compute
    return Precision(compute=compute, storage=storage, why=why)


def autocast(
    precision: Precision, device: torch.device, adapters: torch.nn.Module | None = None
) -> AbstractContextManager:
    """Around one process's model forwards: bf16 compute over float32 weights. A no-op otherwise
    (and under FSDP2, whose mixed-precision policy casts the gathered weights instead).

    ``adapters``: a LoRA model, whose float32 adapters sit on a base stored in the half-precision
    compute dtype. Their products then run in that dtype too: under autocast, with peft's cast of each
    layer's input to the adapter's float32 turned off. That cast, the float32 products and the float32
    sum and cast back after them took ~13% of a bf16 student pass of SmolLM2-135M on a 2-core AMX CPU
    (docs/results.md). The adapters and their gradients stay float32, as AdamW needs."""
    if precision.mixed:
        return torch.autocast(device.type, dtype=precision.compute)
    if adapters is not None and precision.compute in HALF:
        return _half_adapters(precision.compute, device, adapters)
    return nullcontext()


@contextmanager
def _half_adapters(dtype: torch.dtype, device: torch.device, model: torch.nn.Module) -> Iterator[None]:
    from peft.helpers import disable_input_dtype_casting

    with torch.autocast(device.type, dtype=dtype), disable_input_dtype_casting(model):
        yield


def loss_matmul_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The fused loss's matrix products: bf16 inputs accumulated into float32 logits (two bf16
    products each, ~2^-17 relative: :func:`opsd.loss.fused.logits_bf16`) if and only if the model
    computes in bf16 and the device multiplies bf16 natively; float32 products otherwise. On a GPU
    without TF32 three float32 products at Qwen3's vocabulary cost about as much as the whole bf16
    model compute of a step. Everything after the logits stays float32."""
    if precision.compute != torch.bfloat16:
        return None
    has, _ = has_bf16_units(device)
    return torch.bfloat16 if has else None
