"""Where the teacher scores the student's response.

The teacher reads ``[teacher prompt (problem + reference solution) + response]`` in one
forward pass and hands back only its **final hidden states at the response positions**
(``[R, H]``) plus its lm_head weight. The loss turns them into logits a chunk at a time, so no
``[R, V]`` teacher logits ever exist (for Qwen3 that is 74x less memory than caching logits).

Modes: ``fixed`` (initial policy: LoRA adapter disabled, or a frozen copy), ``ema`` (moving
average of the student), ``live`` (current policy, no grad), ``external`` (another model with
the same tokenizer). None of them ever receives a gradient.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from opsd.models import base_model, check_plain_head, final_hidden, head_weight


class Teacher:
    """Scores responses with privileged context; holds whatever state its mode needs."""

    def __init__(
        self,
        mode: str,
        student: nn.Module,
        *,
        lora: bool,
        ema_decay: float = 0.999,
        external: nn.Module | None = None,
        frozen_copy: str = "device",
    ) -> None:
        self.mode, self.student, self.lora, self.decay = mode, student, lora, ema_decay
        self.model: nn.Module | None = None  # a separate teacher network, when there is one
        self.offload = False
        self.ema: list[Tensor] = []
        if mode == "external":
            if external is None:
                raise ValueError("teacher mode 'external' needs the external model")
            self.model = external.requires_grad_(False).eval()
            check_plain_head(self.model)
        elif mode == "fixed" and not lora:
            self.model = copy.deepcopy(base_model(student)).requires_grad_(False).eval()
            self.offload = frozen_copy == "cpu"
            if self.offload:
                self.model.to("cpu")
        elif mode == "ema":
            self.ema = [p.detach().clone() for p in self._trainable()]
        elif mode not in ("fixed", "live"):
            raise ValueError(f"unknown teacher mode {mode!r}: expected fixed, ema, live or external")

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.student.parameters() if p.requires_grad]

    @contextmanager
    def _as_teacher(self, device: torch.device):
        """Make ``self.student`` (or the separate model) compute the teacher's function."""
        if self.model is not None:
            if self.offload:
                self.model.to(device)
            try:
                yield self.model
            finally:
                if self.offload:
                    self.model.to("cpu")
        elif self.mode == "fixed":  # LoRA: the base model is the initial policy
            with self.student.disable_adapter():
                yield self.student
        elif self.mode == "ema":
            params = self._trainable()
            saved = [p.data for p in params]
            for p, e in zip(params, self.ema):
                p.data = e
            try:
                yield self.student
            finally:
                for p, s in zip(params, saved):
                    p.data = s
        else:  # live
            yield self.student

    @torch.no_grad()
    def score(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher hidden states at the response positions ``[R, H]`` and its lm_head weight."""
        with self._as_teacher(input_ids.device) as model:
            hidden = final_hidden(model, input_ids, attention_mask, positions)
            # ``.data`` taken inside the context: the EMA swap or CPU offload is undone on exit,
            # but this tensor keeps pointing at the teacher's weights (no copy needed).
            weight = head_weight(model).data
        return hidden, weight

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: move the EMA toward the student (other modes need nothing)."""
        if self.mode == "ema":
            for e, p in zip(self.ema, self._trainable()):
                e.lerp_(p.detach(), 1 - self.decay)

    def state_dict(self) -> dict:
        return {"ema": [e.cpu() for e in self.ema]} if self.mode == "ema" else {}

    def load_state_dict(self, state: dict) -> None:
        if self.mode == "ema":
            for e, s in zip(self.ema, state["ema"]):
                e.copy_(s)
