"""What opsd knows about Hugging Face models and peft: loading, LoRA, the final-hidden forward, merging.

Every entry point takes "a model": a known short name (fetched into the opsd cache, see
:mod:`opsd.fetch`), a local directory, or a Hugging Face hub name. Hub access is optional; a
model that cannot be found fails fast with one line that says what to do instead.
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterator
from functools import partial

import torch
from torch import Tensor, nn

try:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
except ImportError as err:  # a torchvision built for another torch breaks transformers' model imports
    from opsd.companions import companion_error

    found = companion_error(err)
    if found is None:
        raise
    raise found from None

from opsd.cpu import is_packed, packed_hidden
from opsd.devices import activation_room, on_cuda
from opsd.errors import UserError
from opsd.fetch import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    KNOWN_MODELS,
    cached_model_path,
    hub_reachable,
    opsd_home,
)
from opsd.precision import DTYPES

__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "CHATML_TEMPLATE",
    "DTYPES",
    "apply_lora",
    "base_model",
    "check_plain_head",
    "enable_gradient_checkpointing",
    "final_hidden",
    "non_embedding_params",
    "head_weight",
    "load_model",
    "load_tokenizer",
    "lora_modules",
    "merged_state_dict",
    "merged_weight_names",
    "merged_weights",
    "fixed_weight_names",
    "microbatch_budget",
    "activation_bytes_per_token",
    "plus_deltas",
    "resolve_model_path",
]

# RMSNorms that compute ``weight * (x * rsqrt(mean(x^2) + eps))``: float64_throughout recomputes them.
PLAIN_RMSNORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")

# Heads that are not a plain ``hidden @ W.T``: the fused loss would silently compute the wrong logits.
_NONLINEAR_HEAD_ATTRS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
)


# --- finding and loading ----------------------------------------------------------------------


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or os.path.isabs(s) or s in (".", "..")


def _valid_hub_name(s: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(s)
    except Exception:
        return False
    return True


def resolve_model_path(name_or_path: str) -> str:
    """Known short name that is cached -> its dir; existing local dir -> itself; else unchanged (hub)."""
    if name_or_path in KNOWN_MODELS:
        cached = cached_model_path(name_or_path)
        return str(cached) if cached is not None else name_or_path
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return os.path.expanduser(name_or_path)
    return name_or_path


def _check_source(name_or_path: str, resolved: str, what: str) -> None:
    """Fail early, naming the path, for things that can never load (instead of a hub 404 trace)."""
    if name_or_path in KNOWN_MODELS and resolved == name_or_path:
        raise UserError(
            f"{what} {name_or_path!r} is not fetched yet (looked in {opsd_home() / 'models'}); "
            f"run `opsd fetch-model {name_or_path}`"
        )
    if not os.path.exists(resolved) and (_looks_like_path(name_or_path) or not _valid_hub_name(name_or_path)):
        raise UserError(f"{what} path {name_or_path!r} does not exist (working directory: {os.getcwd()})")
    if os.path.isfile(resolved):
        raise UserError(f"{what} path {resolved!r} is a file; expected a Hugging Face model directory")
    if (
        os.path.isdir(resolved)
        and what == "model"
        and not os.path.isfile(os.path.join(resolved, "config.json"))
    ):
        raise UserError(
            f"model directory {resolved!r} has no config.json (contents: {sorted(os.listdir(resolved))[:20]})"
        )


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _not_found(what: str, name_or_path: str, why: str) -> UserError:
    return UserError(
        f"{what} {name_or_path!r} is not a local directory (working directory: {os.getcwd()}) nor a fetched "
        f"short name ({', '.join(sorted(KNOWN_MODELS))}), and {why}; pass an existing directory, "
        "run `opsd fetch-model NAME`, or check the hub name"
    )


def _hub_snapshot(what: str, name_or_path: str) -> str:
    """The locally cached copy of a hub repo, for when the hub cannot be asked (offline or no answer).

    Loading from that directory keeps transformers off the network, where a missing name would
    otherwise wait for its retries.
    """
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, local_files_only=True)
    except Exception as err:
        raise _not_found(
            what,
            name_or_path,
            "the Hugging Face hub is offline or unreachable and it is not in the local hub cache",
        ) from err


def _from_pretrained(loader, what: str, name_or_path: str, resolved: str, **kwargs):
    """``loader.from_pretrained`` with every failure turned into one line naming the model."""
    local = os.path.isdir(resolved)
    if not local and (_hub_offline() or not hub_reachable()):
        resolved, local = _hub_snapshot(what, name_or_path), True
    try:
        return loader.from_pretrained(resolved, **kwargs)
    except (OSError, ValueError) as err:
        if "trust_remote_code" in str(err):
            raise UserError(
                f"{what} {name_or_path!r} needs custom code from its repository; opsd runs it only when "
                "the config sets model.trust_remote_code=true (do that only for a source you trust)"
            ) from err
        if local:
            raise UserError(
                f"could not load {what} {name_or_path!r} from {resolved!r}: {_one_line(err)}"
            ) from err
        raise _not_found(
            what, name_or_path, f"the Hugging Face hub did not provide it ({_one_line(err)})"
        ) from err


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a short name, directory or hub name; padding side is the engines' business."""
    resolved = resolve_model_path(name_or_path)
    _check_source(name_or_path, resolved, "tokenizer")
    tok = _from_pretrained(
        AutoTokenizer, "tokenizer", name_or_path, resolved, trust_remote_code=trust_remote_code
    )
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    device: str = "cpu",
    *,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a short name, directory or hub name onto one device."""
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} not supported; allowed: {sorted(DTYPES)}")
    resolved = resolve_model_path(name_or_path)
    _check_source(name_or_path, resolved, "model")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = _from_pretrained(AutoModelForCausalLM, "model", name_or_path, resolved, **kwargs)
    if torch_dtype == torch.float64:
        float64_throughout(model)
    return model.to(device)


def head_size(config) -> int:
    """An attention head's width: the config's ``head_dim`` where it sets one, else hidden size / heads."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit or int(config.hidden_size) // int(config.num_attention_heads))


def float64_throughout(model: nn.Module) -> None:
    """Make a float64 model compute in float64 everywhere, for reference numerics (the pinned
    regression test): transformers computes RoPE tables and RMSNorm statistics in float32 whatever
    the model's dtype, and float32 ``cos``, ``sin``, ``rsqrt`` and sums round differently on
    different instruction sets (AVX512, AVX2, scalar), so a float64 run would carry float32
    rounding that depends on the CPU. Forward hooks recompute default RoPE tables and the RMSNorms
    of Llama/Qwen/Mistral in float64; other RoPE types and norms keep transformers' own code.
    """
    for mod in model.modules():
        if type(mod).__name__ in PLAIN_RMSNORMS:
            mod.register_forward_hook(_float64_rmsnorm)
            continue
        cfg = getattr(mod, "config", None)
        if getattr(mod, "rope_type", None) != "default" or not hasattr(mod, "inv_freq") or cfg is None:
            continue
        base = cfg.rope_parameters["rope_theta"]
        dim = head_size(cfg)
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        mod.register_forward_hook(partial(_float64_rope, inv_freq=inv), with_kwargs=True)


def _float64_rmsnorm(mod: nn.Module, args: tuple, output: Tensor) -> Tensor:
    x = args[0]
    if x.dtype != torch.float64:
        return output
    return mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon))


def _float64_rope(
    mod: nn.Module, args: tuple, kwargs: dict, output: tuple, *, inv_freq: Tensor
) -> tuple[Tensor, Tensor]:
    named = dict(zip(("x", "position_ids"), args)) | kwargs
    x, position_ids = named["x"], named["position_ids"]
    freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * mod.attention_scaling).to(x.dtype), (emb.sin() * mod.attention_scaling).to(x.dtype)


# --- training setup ---------------------------------------------------------------------------


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward; non-reentrant, so frozen inputs and no_grad teachers work."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_lora(
    model: PreTrainedModel,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str] | str,
    gradient_checkpointing: bool,
) -> nn.Module:
    """Wrap ``model`` in a peft LoRA adapter (train mode); the base weights stay frozen.

    Gradient checkpointing itself is enabled on ``model`` by the caller (full fine-tuning needs it
    too); with frozen embeddings the checkpointed blocks need inputs that require grad.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    if gradient_checkpointing:
        model.enable_input_require_grads()
    peft_model = get_peft_model(model, config)
    portable_lora_init(peft_model)
    return peft_model.train()


@torch.no_grad()
def portable_lora_init(model: nn.Module) -> None:
    """Re-draw every ``lora_A`` from peft's own distribution (uniform on +-1/sqrt(fan_in), what its
    Kaiming-uniform init with a=sqrt(5) gives) from integers alone, so a seed gives bit-identical
    adapters on every CPU: ``uniform_`` rounds differently in vectorized and scalar kernels (1.5e-8
    between AVX512 and scalar code), which moved every later number. ``lora_B`` stays zero."""
    for _, mod in sorted(model.named_modules(), key=lambda kv: kv[0]):
        for name in sorted(getattr(mod, "lora_A", {}) or {}):
            w = mod.lora_A[name].weight
            k = torch.randint(0, 2**24, tuple(w.shape), dtype=torch.int64)
            u = (k.to(torch.float64) - 2**23 + 0.5) * 2.0**-23  # exact in float64
            w.copy_((u / w.shape[1] ** 0.5).to(w.dtype))


def compile_layers(*models: nn.Module | None) -> int:
    """``model.compile``: ``torch.compile`` each decoder layer in place, dynamic shapes (a micro-batch's
    rows and length change every step). Per layer, not the whole model: every layer runs one graph
    (their weights are its inputs), so it compiles in about a minute, and the masks and the index of
    the response positions stay eager. The teacher (adapter off) and the student (adapter on) get a
    graph each. Returns the layers compiled; a model without a ``layers`` list gets a UserError."""
    count = 0
    for model in models:
        if model is None:
            continue
        decoder = base_model(model).get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            name = type(base_model(model)).__name__
            raise UserError(f"model.compile=true: {name} has no decoder `layers` list; set it false")
        for layer in layers:
            layer.compile(dynamic=True)
        count += len(layers)
    return count


# --- the forward the loss needs ---------------------------------------------------------------


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_plain_head(model: nn.Module) -> None:
    """Refuse models whose logits are not ``hidden @ lm_head.weight.T``."""
    m = base_model(model)
    cfg = m.config
    for attr in _NONLINEAR_HEAD_ATTRS:
        val = getattr(cfg, attr, None)
        if val not in (None, 0, 0.0, 1, 1.0, False):
            raise UserError(
                f"{cfg.model_type}: config.{attr}={val} means the logits are not a plain linear head; "
                "opsd's fused-linear loss computes hidden @ lm_head.weight.T and does not support it"
            )
    head = m.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise UserError(
            f"{cfg.model_type}: the lm_head is {type(head).__name__}"
            f"{' with a bias' if isinstance(head, nn.Linear) else ''}, not a bias-free nn.Linear; "
            "opsd's fused-linear loss needs a plain linear head (do not put LoRA on lm_head)"
        )


def non_embedding_params(model: nn.Module) -> int:
    """Parameters a token's forward multiplies by (its products do ~2 FLOPs per parameter): all but
    the input embedding and the lm_head, counted once each (tied weights, LoRA's adapters included)."""
    base = base_model(model)
    embeddings = (base.get_input_embeddings(), base.get_output_embeddings())
    skip = {id(m.weight) for m in embeddings if m is not None}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def head_weight(model: nn.Module) -> Tensor:
    """The lm_head weight ``[V, H]`` the fused loss multiplies hidden states by."""
    return base_model(model).get_output_embeddings().weight


def final_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions: Tensor,
    rows: list[int] | None = None,
) -> Tensor:
    """Final (post-norm) hidden states at ``positions``: ``[R, H]``; the model never makes logits.

    ``rows`` (:class:`opsd.data.batching.MicroBatch`'s ``*_rows``, set only where the CPU plan packs
    rows and the model attends with :data:`opsd.cpu.packing.PACKED_SDPA`): each right-padded row's
    first ``rows[b]`` tokens run packed into one sequence without an attention mask
    (:func:`opsd.cpu.packing.packed_hidden`): the batched forward's hidden states, up to the products'
    rounding, without the padding's work."""
    decoder = base_model(model).get_decoder()
    positions = positions.to(input_ids.device)
    if rows is not None and is_packed(decoder):
        return packed_hidden(decoder, input_ids, positions, rows)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)


# --- merged weights ---------------------------------------------------------------------------


def _base_name(key: str) -> str:
    """peft parameter name -> the base model's Hugging Face name."""
    key = key.removeprefix("base_model.model.").replace(".base_layer", "")
    return key.replace(".modules_to_save.default", "")


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """HF name of each LoRA-wrapped base weight -> its (unmerged) LoRA module."""
    out = {}
    for name, mod in model.named_modules():
        if (
            hasattr(mod, "get_delta_weight")
            and hasattr(mod, "base_layer")
            and not getattr(mod, "merged", False)
        ):
            out[_base_name(f"{name}.base_layer.weight")] = mod
    return out


def _weight_keys(model: nn.Module) -> list[tuple[str, str]]:
    """(state-dict key, HF name) of every base-model tensor, in state-dict order."""
    return [(k, _base_name(k)) for k in model.state_dict() if "lora_" not in k and "original_module" not in k]


def merged_weight_names(model: nn.Module) -> list[str]:
    """The HF names :func:`merged_weights` yields, without computing any tensor."""
    return [name for _, name in _weight_keys(model)]


def fixed_weight_names(model: nn.Module) -> set[str]:
    """HF names of the tensors training never changes: frozen (no gradient) and not LoRA-wrapped,
    e.g. a LoRA run's embedding and norms. A weight sync that already sent them need not again."""
    lora, state = lora_modules(model), model.state_dict(keep_vars=True)
    return {name for key, name in _weight_keys(model) if name not in lora and not state[key].requires_grad}


def merged_weight_meta(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(HF name, dtype, full shape) of what :func:`merged_weights` yields, gathering nothing (a
    sharded tensor reports its global shape)."""
    state = model.state_dict()
    return [(name, state[key].dtype, tuple(state[key].shape)) for key, name in _weight_keys(model)]


@torch.no_grad()
def merged_weights(model: nn.Module, skip: Container[str] = ()) -> Iterator[tuple[str, Tensor]]:
    """The weights with the active LoRA deltas folded in (``W + scale * B @ A``), under HF names,
    one tensor at a time; the names in ``skip`` are left out (nothing is computed for them).

    Computed out of place, so the live weights are never touched: peft's merge_adapter() /
    unmerge_adapter() round trip adds and subtracts the delta in place, which in bf16 does not give
    back the base weights (the fixed teacher) bit for bit. Each merged matrix is made only when it is
    yielded, so a consumer that drops it before asking for the next (a weight sync into vLLM) never
    holds more than one; unchanged contiguous tensors are the live ones, not copies.
    """
    from torch.distributed.tensor import DTensor

    lora, state = lora_modules(model), model.state_dict()
    for key, name in _weight_keys(model):
        if name in skip:
            continue
        value, mod = state[key].detach(), lora.get(name)
        if mod is not None:
            local = not isinstance(value, DTensor)  # a shard's sum stays a DTensor, which the caller gathers
            out = torch.empty(value.shape, dtype=value.dtype, device=value.device) if local else None
            value = plus_deltas(value, mod, name, out=out)
        yield name, value.contiguous()  # a column-major frozen weight is copied


def plus_deltas(value: Tensor, mod: nn.Module, name: str, *, out: Tensor | None = None) -> Tensor:
    """``value`` plus each active LoRA adapter's ``scale * B @ A`` in adapter order; ``value`` is
    never touched. With ``out`` the sum is written there, in ``out``'s layout, and returned.

    Why ``out``: adding a column-major weight (opsd.cpu.layout.frozen_weights) to a row-major delta straight
    into a buffer of the layout wanted is 2-5x faster than adding and then laying the sum out with
    ``.contiguous()`` (timed at SmolLM2's shapes when this was written), and gives the same values.
    """
    result = None
    for adapter in mod.active_adapters:
        if adapter not in getattr(mod, "lora_A", {}):
            continue
        if getattr(mod, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(f"{name}: merging a DoRA adapter out of place is not supported")
        if result is None and out is not None and out.is_contiguous() and _plain_lora(mod, adapter, value):
            # get_delta_weight's (B @ A) * scale rounded to the weight's dtype, as its .to() rounds it,
            # written into `out` itself, plus the weight (a + b is b + a, exactly): one new matrix
            # instead of three (none with adapters in the weight's dtype), peft's values bit for bit.
            b = mod.lora_B[adapter].weight
            a = mod.lora_A[adapter].weight
            delta = torch.mm(b, a, out=out) if b.dtype == out.dtype else torch.mm(b, a)
            result = torch.mul(delta, mod.scaling[adapter], out=out).add_(value)
            continue
        delta = mod.get_delta_weight(adapter).detach().to(value.dtype)
        if result is None:
            result = value + delta if out is None else torch.add(value, delta, out=out)
        else:
            result = result + delta if out is None else result.add_(delta)  # (value + d1) + d2
    if result is None:
        return value if out is None else out.copy_(value)
    return result


def _plain_lora(mod: nn.Module, adapter: str, value: Tensor) -> bool:
    """Whether peft's ``get_delta_weight`` is plain ``(B @ A) * scale`` in the adapter's dtype here: a
    LoRA ``Linear`` that is not fan-in-fan-out and does not cast (it casts bf16/fp16 on a CPU), with
    adapters no narrower than ``value`` (float32 adapters on a bf16 base: LoRA's default here)."""
    from peft.tuners.lora.layer import Linear

    b = mod.lora_B[adapter].weight
    cast = not on_cuda([b]) and b.dtype in (torch.float16, torch.bfloat16)  # peft's own rule
    wide = b.dtype == value.dtype or b.dtype == torch.float32
    same = mod.lora_A[adapter].weight.dtype == b.dtype
    return type(mod) is Linear and not mod.fan_in_fan_out and wide and same and not cast


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """All of :func:`merged_weights` at once (checkpoint export); a plain model gives its state dict."""
    return dict(merged_weights(model))


def activation_bytes_per_token(config, dtype: torch.dtype, checkpointing: bool) -> int:
    """What a decoder's forward keeps for its backward, per token: about 8 hidden-size and 5
    intermediate-size vectors per layer (norms, q/k/v, attention output, residuals; gate, up, the
    activation and its product), or one hidden-size vector per layer with activation checkpointing
    (plus one layer recomputed at a time). An upper estimate for Llama/Qwen-style models."""
    h, layers = int(config.hidden_size), int(config.num_hidden_layers)
    inter = int(getattr(config, "intermediate_size", 4 * h) or 4 * h)
    width = torch.finfo(dtype).bits // 8
    per_layer = h if checkpointing else 8 * h + 5 * inter
    return (layers * per_layer + (8 * h + 5 * inter if checkpointing else 0)) * width


def microbatch_budget(
    setting: int | str,
    config,
    dtype: torch.dtype,
    device: torch.device,
    checkpointing: bool,
    reserve: int = 0,
    *,
    beside_vllm: bool = False,
) -> tuple[int, str]:
    """``optim.max_tokens_per_microbatch: auto``: as many tokens as keep the student's saved activations
    within the device's room less ``reserve`` bytes (what the step will take that is not allocated
    yet: AdamW's state; :func:`opsd.devices.activation_room`). Between 256 and 16,384 tokens. Measure
    it with any vLLM engine asleep. Returns the budget and the reason (a notice)."""
    if setting != "auto":
        return int(setting), "set in the config"
    per_token = activation_bytes_per_token(config, dtype, checkpointing)
    room, where = activation_room(device, reserve, beside_vllm=beside_vllm)
    tokens = max(256, min(16384, room // per_token))
    return tokens, f"~{per_token / 2**20:.2f} MiB of activations per token, {where}"
