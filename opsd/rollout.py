"""On-policy rollout engines: prompts as token ids in, sampled responses with log-probs out.

HFEngine runs anywhere (CPU or GPU) on the trainer's own model object, so weight sync is free.
VLLMEngine (optional `vllm` extra) runs a colocated vllm.LLM that sleeps while the trainer trains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's eos
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None  # None: fresh OS entropy; the global torch RNG is never touched either way
    min_new_tokens: int = 0  # stop tokens are masked out before this many tokens (benchmarks)

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens]")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")


@dataclass
class Completion:
    prompt_index: int  # index into the prompts list given to generate()
    token_ids: list[int]  # response tokens; includes the stop token when finish_reason == "stop"
    logprobs: list[float]  # sampling log-prob of each token (same length as token_ids)
    finish_reason: str  # "stop" | "length"


def _check_prompts(prompts: list[list[int]], n: int, vocab_size: int | None) -> None:
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}): min {min(p)}, max {max(p)}"
            )


def _stop_ids(tokenizer, model, extra: list[int]) -> list[int]:
    """eos from the tokenizer and the model's generation config (chat models often have several)."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in [tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos]), *extra]:
        if x is not None and int(x) not in ids:
            ids.append(int(x))
    return ids


class _Warp(LogitsProcessor):
    """Applies temperature/top-k/top-p itself and returns normalised log-probs.

    Doing the warping here (and nothing in HF's own warpers) means the distribution that is sampled
    is exactly the one whose log-probs we record, without keeping a (steps x batch x vocab) score stack.
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
        self, warp: _Warp, prompt_len: int, stop_ids: list[int], stop_strings: list[str], tokenizer
    ) -> None:
        self.warp, self.prompt_len = warp, prompt_len
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
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
        self.end = torch.where(hit & (self.end < 0), step, self.end)
        return self.end >= 0


class HFEngine:
    """Batched transformers generation with left padding and KV cache, on the trainer's model object."""

    def __init__(self, model, tokenizer, batch_size: int = 32) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
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

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """Returns len(prompts)*n completions, prompt-major; deterministic given params.seed."""
        params.validate()
        _check_prompts(prompts, n, getattr(getattr(self.model, "config", None), "vocab_size", None))
        items = [(i, j) for i in range(len(prompts)) for j in range(n)]
        # Similar lengths together means less padding; sorting is stable so order is deterministic.
        order = sorted(range(len(items)), key=lambda k: len(prompts[items[k][0]]))
        device = next(self.model.parameters()).device
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        stop_ids = _stop_ids(self.tokenizer, self.model, list(params.stop_token_ids))
        was_training = self.model.training
        self.model.eval()
        results: list[Completion | None] = [None] * len(items)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    batch = [prompts[items[k][0]] for k in chunk]
                    for k, comp in zip(chunk, self._generate_batch(batch, params, stop_ids, device)):
                        comp.prompt_index = items[k][0]
                        results[k] = comp
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]

    def _generate_batch(self, batch: list[list[int]], params: SamplingParams, stop_ids: list[int], device):
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):  # left padding: the next token is at the same column for all rows
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        warp = _Warp(params)
        rec = _Recorder(warp, width, stop_ids, params.stop_strings, self.tokenizer)
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
        seqs = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([warp]),
            stopping_criteria=StoppingCriteriaList([rec]),
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


def _base_name(key: str) -> str:
    """PEFT parameter name -> the base model's name (what vLLM's load_weights expects)."""
    key = key.removeprefix("base_model.model.").replace(".base_layer", "")
    return key.replace(".modules_to_save.default", "")


def peft_merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Full weights with the active LoRA deltas folded in, under the base model's names.

    Computed out of place: merge_adapter()/unmerge_adapter() round-trips would slowly corrupt
    bf16 base weights over thousands of syncs.
    """
    sd = {
        _base_name(k): v.detach()
        for k, v in model.state_dict().items()
        if "lora_" not in k and "original_module" not in k
    }
    for name, mod in model.named_modules():
        if not (hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer")) or getattr(
            mod, "merged", False
        ):
            continue
        key = _base_name(f"{name}.base_layer.weight")
        for adapter in mod.active_adapters:
            if adapter in getattr(mod, "lora_A", {}):
                sd[key] = sd[key] + mod.get_delta_weight(adapter).detach().to(sd[key].dtype)
    return sd


def _load_weights_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (collective_rpc); vLLM's loader handles TP sharding itself."""
    model = worker.model_runner.model
    model.load_weights(weights=((name, t.to(next(model.parameters()).device)) for name, t in weights))
    return len(weights)


class VLLMEngine:
    """A colocated vllm.LLM: generates while the trainer waits, sleeps (frees GPU memory) while it trains."""

    def __init__(
        self,
        model,
        tokenizer,
        model_path: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        seed: int = 0,
        batch_size: int | None = None,
        **llm_kwargs,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "the vLLM rollout engine needs vLLM and a CUDA GPU: `pip install opsd[vllm]` "
                "(or use the HF engine: rollout engine 'hf')"
            ) from err
        if not torch.cuda.is_available():
            raise RuntimeError("the vLLM rollout engine needs a CUDA GPU; use the HF engine on CPU")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level} must be 1 (offload weights) or 2 (discard them)")
        self.model, self.tokenizer = model, tokenizer
        self.sleep_level, self.asleep = sleep_level, False
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = model_path or getattr(base.config, "_name_or_path", None)
        if not path:
            raise ValueError(
                "VLLMEngine needs model_path: the model object does not record where it came from"
            )
        if tensor_parallel_size == 1:
            # Keep the engine core in this process so sync_weights can copy tensors directly.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
        kwargs = dict(
            model=path,
            tokenizer=path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled
            **llm_kwargs,
        )
        if batch_size is not None:  # vLLM schedules continuously; this caps concurrent sequences
            kwargs.setdefault("max_num_seqs", batch_size)
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError as err:
            if "logprobs_mode" not in str(err):
                raise
            kwargs.pop("logprobs_mode")  # vLLM < 0.10.2: raw log-probs (equal at temperature 1, top_p 1)
            self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.sync_weights(model)

    def _sampling_params(self, n: int, params: SamplingParams, seed: int | None):
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop_token_ids=list(params.stop_token_ids) or None,
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,  # just the sampled token's log-prob
        )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        params.validate()
        _check_prompts(prompts, n, None)
        if self.asleep:
            self.wake()
        # one request per prompt; distinct seeds so equal prompts still get different samples
        seeds = [None if params.seed is None else params.seed + i for i in range(len(prompts))]
        sps = [self._sampling_params(n, params, s) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        comps: list[Completion] = []
        for i, out in enumerate(outs):
            for o in sorted(out.outputs, key=lambda o: o.index):
                toks = list(o.token_ids)
                lps = [float(d[t].logprob) for d, t in zip(o.logprobs or [], toks)]
                if len(lps) != len(toks):
                    raise RuntimeError(
                        f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens (prompt {i})"
                    )
                comps.append(Completion(i, toks, lps, "stop" if o.finish_reason == "stop" else "length"))
        return comps

    def _direct_model(self):
        """The in-process vLLM model when the engine core runs here (TP=1), else None."""
        try:
            return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        except AttributeError:
            return None

    def sync_weights(self, model) -> None:
        """Copy the trainer's current weights in (LoRA: merged into the base weights)."""
        self.model = model
        is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
        state = peft_merged_state_dict(model) if is_peft else model.state_dict()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # KV cache stays freed until generate() needs it
        direct = self._direct_model()
        if direct is not None:
            direct.load_weights(weights=((k, v.detach()) for k, v in state.items()))
        else:
            cpu = [(k, v.detach().to("cpu")) for k, v in state.items()]
            self.llm.collective_rpc(_load_weights_on_worker, args=(cpu,))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def sleep(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def make_engine(kind: str, model, tokenizer, **kw) -> HFEngine | VLLMEngine:
    """`kind` comes from the run config: "hf" (any device) or "vllm" (CUDA, optional extra)."""
    if kind == "hf":
        return HFEngine(model, tokenizer, **kw)
    if kind == "vllm":
        return VLLMEngine(model, tokenizer, **kw)
    raise ValueError(f"rollout engine {kind!r} unknown; allowed: ['hf', 'vllm']")
