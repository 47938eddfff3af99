"""HFEngine: batched transformers generation on the trainer's own model object.

It runs anywhere (CPU or GPU), and weight sync is free since the model is shared.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from opsd.cpu import CpuPlan, default_plan
from opsd.devices import rng_devices
from opsd.parallel import gathered
from opsd.rollout.base import Completion, SamplesOnSubmit, SamplingParams, check_prompts, end_token_ids


class _Warp(LogitsProcessor):
    """Applies temperature/top-k/top-p itself and returns normalised log-probs.

    Doing the warping here (and nothing in HF's own warpers) means the distribution that is sampled
    is exactly the one whose log-probs are recorded, without keeping a (steps x batch x vocab) score stack.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.warpers: list[LogitsProcessor] = []
        if params.temperature > 0:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float()
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.last = torch.log_softmax(scores, dim=-1)
        return self.last


class _Recorder(StoppingCriteria):
    """Runs after each sampled token: records its log-prob and where each row hit a stop condition."""

    def __init__(
        self,
        warp: _Warp,
        prompt_len: int,
        stop_ids: list[int],
        stop_strings: list[str],
        tokenizer,
        stop_text: Callable[[str], bool] | None = None,
    ) -> None:
        self.warp, self.prompt_len = warp, prompt_len
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
        self.stop_text = stop_text  # on the whole response's text, as a grader reads it
        # A stop string can only have been completed within its own length in tokens (+ slack for bytes).
        self.window = max((len(s.encode()) for s in stop_strings), default=0) + 2
        self.logprobs: list[torch.Tensor] = []
        self.end: torch.Tensor | None = None  # per row: response length incl. the stop token (-1: running)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        step = input_ids.shape[1] - self.prompt_len  # response tokens so far, including `new`
        new = input_ids[:, -1]
        # Stays on the model's device: no host sync per step unless stop strings need decoding.
        self.logprobs.append(self.warp.last.gather(1, new[:, None]).squeeze(1))
        if self.end is None:
            self.end = torch.full((input_ids.shape[0],), -1, dtype=torch.long, device=new.device)
            self.stop_ids = self.stop_ids.to(new.device)
        hit = torch.isin(new, self.stop_ids)
        if self.stop_strings:
            open_rows = (self.end < 0) & ~hit
            rows = open_rows.nonzero().flatten().tolist()
            if rows:
                lo = max(self.prompt_len, input_ids.shape[1] - self.window)
                texts = self.tokenizer.batch_decode(
                    input_ids[rows, lo:].cpu().tolist(), skip_special_tokens=False
                )
                for r, text in zip(rows, texts):
                    if any(s in text for s in self.stop_strings):
                        hit[r] = True
        if self.stop_text is not None:
            rows = ((self.end < 0) & ~hit).nonzero().flatten().tolist()
            if rows:
                responses = input_ids[rows, self.prompt_len :].cpu().tolist()
                for r, text in zip(rows, self.tokenizer.batch_decode(responses, skip_special_tokens=True)):
                    if self.stop_text(text):
                        hit[r] = True
        self.end = torch.where(hit & (self.end < 0), step, self.end)
        return self.end >= 0


class HFEngine(SamplesOnSubmit):
    """Batched transformers generation with left padding and KV cache, on the trainer's model object.

    On an FSDP-sharded model every rank calls ``generate`` together: the weights are gathered once
    for the whole call (:func:`opsd.parallel.gathered`), after which each rank decodes on its own.
    """

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 32,
        autocast_dtype: torch.dtype | None = None,
        *,
        plan: CpuPlan | None = None,
        fold_lora_bytes: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        # bf16 compute over float32 master weights (one process): generate under autocast, as the trainer's
        # forwards run, so the rollout samples from the distribution the trainer scores.
        self.autocast_dtype = autocast_dtype
        # The CPU plan's decoding mechanisms (the trainer's; outside a trainer, the default plan for this
        # device): prompt widths in buckets where the CPU's bf16 attention keeps a kernel per length, a
        # preallocated cache, LoRA folded into weight copies up to ``fold_lora_bytes``.
        first = next(model.parameters())
        plan = plan if plan is not None else default_plan(first.device, autocast_dtype or first.dtype)
        self.cpu_settings = plan.engine_settings(fold_lora_bytes=fold_lora_bytes)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        self.pad_token_id = int(pad)

    def sync_weights(self, model) -> None:
        """Shares the trainer's parameters; only swap the reference if handed a different object."""
        if model is not self.model:
            self.model = model

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        *,
        stop_text: Callable[[str], bool] | None = None,
    ) -> list[Completion]:
        """Returns len(prompts)*n completions, prompt-major; deterministic given params.seed.

        ``stop_text``: a row also stops once it holds for the response's text (decoded as a grader reads
        it, every step): ``finish_reason="stop"`` on the token that made it hold."""
        params.validate()
        check_prompts(prompts, n, getattr(getattr(self.model, "config", None), "vocab_size", None))
        items = [(i, j) for i in range(len(prompts)) for j in range(n)]
        # Similar lengths together means less padding; sorting is stable so order is deterministic.
        order = sorted(range(len(items)), key=lambda k: len(prompts[items[k][0]]))
        device = next(self.model.parameters()).device
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        stop_ids = end_token_ids(self.tokenizer, self.model, list(params.stop_token_ids))
        was_training = self.model.training
        self.model.eval()
        results: list[Completion | None] = [None] * len(items)
        try:
            amp = torch.autocast(
                device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
            )
            rng = torch.random.fork_rng(devices=rng_devices(device))
            # LoRA folded into copies of the weights while generating, where they fit in the budget
            # (on a CPU the activations', free during the rollout: peak RSS stays where training puts it).
            folded = self.cpu_settings.lora_folded(self.model)
            with rng, amp, eager_decoding(self.model), gathered(self.model), folded:
                torch.manual_seed(seed)
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    batch = [prompts[items[k][0]] for k in chunk]
                    comps = self._generate_batch(batch, params, stop_ids, device, stop_text)
                    for k, comp in zip(chunk, comps):
                        comp.prompt_index = items[k][0]
                        results[k] = comp
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]

    def _generate_batch(
        self,
        batch: list[list[int]],
        params: SamplingParams,
        stop_ids: list[int],
        device,
        stop_text: Callable[[str], bool] | None = None,
    ):
        width = self.cpu_settings.width(max(len(p) for p in batch))
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):  # left padding: the next token is at the same column for all rows
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        warp = _Warp(params)
        rec = _Recorder(warp, width, stop_ids, params.stop_strings, self.tokenizer, stop_text)
        sample = params.temperature > 0
        # Neutralise HF's own warpers and any model defaults (e.g. Qwen's top_k=20): _Warp does it.
        neutral = dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0) if sample else {}
        gen_config = GenerationConfig(
            do_sample=sample,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens or None,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            repetition_penalty=1.0,
            use_cache=True,
            return_dict_in_generate=False,
            **neutral,
        )
        # The CPU plan's preallocated cache, made here for this batch alone (docs/cpu.md, "Static KV cache").
        cache = self.cpu_settings.decode_cache(self.model, width + params.max_new_tokens)
        seqs = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([warp]),
            stopping_criteria=StoppingCriteriaList([rec]),
            synced_gpus=False,  # gathered(): no collective inside generate, ranks need not keep step
            **cache,
        )
        gen = seqs[:, width:].cpu()
        logprobs = torch.stack(rec.logprobs, dim=1).cpu() if rec.logprobs else torch.zeros(len(batch), 0)
        ends = rec.end.cpu() if rec.end is not None else torch.full((len(batch),), -1)
        out = []
        for r in range(len(batch)):
            stopped = int(ends[r]) >= 0
            keep = int(ends[r]) if stopped else min(gen.shape[1], params.max_new_tokens)
            out.append(
                Completion(
                    prompt_index=-1,
                    token_ids=gen[r, :keep].tolist(),
                    logprobs=logprobs[r, :keep].tolist(),
                    finish_reason="stop" if stopped else "length",
                )
            )
        return out


def eager_decoding(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Decoding runs eager where layers were compiled for training (``model.compile``): they would
    recompile at every new cache length. The compiler's stance is process-wide and its restore is not
    safe across threads (two decoding threads interleaved leave ``force_eager`` set), so a model with
    nothing compiled leaves it alone."""
    compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    if not compiled:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")
