"""Tiny offline tokenizer and models: tests, benchmarks and the demo run without any download."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from opsd.fetch import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE


def _default_tiny_corpus() -> list[str]:
    """Deterministic text rich in digits, arithmetic and math words, so merges are useful for demos."""
    words = (
        "the answer is step let we find compute sum product difference total number each so then "
        "therefore because first second next finally solve equation value of and a to in is are "
        "Please reason step by step, and put your final answer within \\boxed{}. Reference solution "
        "Problem: Solution: Answer: user assistant system"
    ).split()
    texts = [" ".join(words), "0123456789 " * 4, "+ - * / = ( ) { } [ ] \\boxed{42} #### 7"]
    for a in range(0, 100, 7):
        for b in range(1, 60, 11):
            texts.append(
                f"What is {a} + {b}? We compute {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."
            )
            texts.append(f"{a} * {b} = {a * b}, {a} - {b} = {a - b}")
    texts.append("".join(chr(c) for c in range(32, 127)))
    return texts


def build_tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE offline; byte fallback means any ASCII/UTF-8 text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    min_size = 256 + len(CHATML_SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} too small; must be >= {min_size} (256 bytes + special tokens)"
        )
    corpus = list(texts) if texts else _default_tiny_corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    arch: str = "llama",
) -> PreTrainedModel:
    """A randomly initialised causal LM sized for CPU tests; seeding never disturbs the global RNG."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    archs = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in archs:
        raise ValueError(f"arch {arch!r} not supported; allowed: {sorted(archs)}")
    if hidden_size % 4 != 0 or hidden_size <= 0:
        raise ValueError(f"hidden_size={hidden_size} must be a positive multiple of 4 (4 attention heads)")
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    config_cls, model_cls = archs[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    portable_init(model, std=config.initializer_range, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


@torch.no_grad()
def portable_init(model: torch.nn.Module, *, std: float, seed: int) -> None:
    """Re-draw every matrix (linear and embedding weights) uniformly with standard deviation ``std``,
    from integers alone, so the same seed gives bit-identical weights on every CPU.

    ``torch.normal`` goes through vectorized ``log``/``cos`` kernels whose float32 results differ
    by an ulp between AVX512, AVX2 and scalar code: the same seed gave other weights on other
    machines, and every number computed from them moved (2e-8 in the embeddings, 1e-7 in the loss).
    Integers from the Mersenne Twister are the same everywhere, and ``(k - 2^23 + 1/2) * 2^-23 * a``
    is exact in float64 before one correctly rounded cast. Norm weights (ones) and biases (zeros)
    keep their exact initial values.
    """
    gen = torch.Generator().manual_seed(seed)
    half_width = std * 3**0.5  # a uniform on [-a, a] has standard deviation a / sqrt(3)
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() < 2:
            continue
        k = torch.randint(0, 2**24, tuple(p.shape), generator=gen, dtype=torch.int64)
        u = (k.to(torch.float64) - 2**23 + 0.5) * 2.0**-23  # exact: 24-bit integers fit a float64
        p.copy_((u * half_width).to(p.dtype))
