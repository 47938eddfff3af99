"""Rollouts from a fleet of `vllm serve` processes (``rollout.engine: vllm_server``), and `opsd serve`.

The trainer talks to each server over HTTP, token ids in and out: prompt ``i`` goes to server
``i mod S`` as one ``/v1/completions`` request for its ``n`` samples, with a per-request seed derived
from the step's seed, so a resumed run samples what it would have. With ``--logprobs-mode
processed_logprobs`` (which `opsd serve` sets) the reported log-probs are those of the distribution
sampled from, after temperature: the trainer's ``logprob_gap`` check works as for the colocated engine.

Weight sync after every optimizer step, ``disk`` transport (the one built): every rank joins the
gather of the full tensors, rank 0 writes the merged weights (LoRA folded in out of place, one
tensor at a time) as safetensors into ``rollout.sync_dir/.step-N.tmp``, renames it to ``step-N``
(atomic: a server never reads a half-written directory), and for each server calls ``/pause`` ->
``/collective_rpc reload_weights(weights_path=...)`` -> ``/reset_prefix_cache`` -> ``/resume``.
Those are vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``). Then a probe: the server samples a
few tokens after a fixed prompt and the trainer scores them; their log-probs must agree within
``rollout.sync_tolerance``, or the run stops with one line (the server did not take the weights).
Every rank waits for the sync before its next rollout. docs/vllm.md says what was read in vLLM's
source and what each endpoint does and does not guard.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opsd.distributed import first_error, rank_world
from opsd.errors import UserError
from opsd.rollout.base import Completion, EngineError, SamplingParams, _check_prompts, _stop_ids

PROBE_TOKENS = 8


class ServerError(EngineError):
    """A rollout server was unreachable, timed out or answered with an error, mid-run: the trainer
    adds the last good checkpoint to the message; `opsd train --resume` continues once it is back."""


class VLLMServerEngine:
    """The RolloutEngine contract over HTTP to ``servers`` (base URLs such as http://127.0.0.1:8000)."""

    def __init__(
        self,
        model,
        tokenizer,
        servers: list[str],
        *,
        sync_dir: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        sync_tolerance: float | None = None,
        transport: str = "disk",
        compute_dtype: torch.dtype | None = None,
        nccl_endpoints: list[str] | None = None,
        server_world_size: int = 1,
    ) -> None:
        if transport == "nccl":
            check_nccl()
        elif transport != "disk":
            raise UserError(f"rollout.weight_sync={transport!r}: expected disk or nccl")
        if not servers:
            raise UserError("rollout.engine=vllm_server needs rollout.servers: [http://HOST:PORT, ...]")
        self.model = model
        self.tokenizer = tokenizer
        self.servers = [s.rstrip("/") for s in servers]
        self.sync_dir = Path(sync_dir)
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.rank, self.world = rank_world()
        self.syncs = 0
        self.transport = transport
        self._nccl: list[Any] | None = None  # vLLM's trainer-side NCCL engines, one per server, lazily
        self.nccl_endpoints = nccl_endpoints or [f"127.0.0.1:{29600 + i}" for i in range(len(servers))]
        self.server_world_size = server_world_size
        self._background = ThreadPoolExecutor(max_workers=1)  # submit(): one rollout batch ahead
        self.last_probe_gap: float | None = None
        # Down at start is a user error (one line naming the server); rank 0 asks each for its model.
        self.model_names = self._on_rank0(lambda: [self._model_name(s) for s in self.servers], user=True)
        # float32 (or wider) on both sides: both compute the same float32 logits, ~1e-6 apart; a bf16
        # trainer or server (`opsd serve --dtype auto` on a machine with bf16 units) rounds its logits
        # at 2^-8 relative, so ~0.1 is the level of noise.
        self.server_dtypes = self._on_rank0(lambda: [self._server_dtype(s) for s in self.servers])
        wide = compute_dtype in (None, torch.float32, torch.float64) and all(
            d in (None, "float32", "float64") for d in self.server_dtypes
        )
        self.sync_tolerance = sync_tolerance or (1e-3 if wide else 0.1)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.vocab_size = getattr(getattr(base, "config", None), "vocab_size", None)
        if self.rank == 0:
            self.sync_dir.mkdir(parents=True, exist_ok=True)
        # The servers must start on the trainer's weights (a resume syncs the checkpoint's anyway).
        try:
            self._probe(model)
        except ServerError:
            self.sync_weights(model)

    # -- HTTP ----------------------------------------------------------------------------------

    def _post(self, server: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(server + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        return self._send(req, server, path, timeout)

    def _get(self, server: str, path: str) -> Any:
        req = urllib.request.Request(server + path, method="GET")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        return self._send(req, server, path, None)

    def _send(self, req: urllib.request.Request, server: str, path: str, timeout: float | None) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                raw = resp.read()
            return json.loads(raw) if raw.strip() else None
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
            raise ServerError(
                f"rollout server {server} answered {path} with HTTP {e.code}: {detail}"
            ) from None
        except (
            urllib.error.URLError,
            TimeoutError,
            ConnectionError,
            OSError,
            http.client.HTTPException,
        ) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"rollout server {server} did not answer {path}: {reason}") from None
        except ValueError as e:  # not JSON: not a vLLM server
            raise ServerError(
                f"rollout server {server} answered {path} with something not JSON: {e}"
            ) from None

    def _model_name(self, server: str) -> str:
        try:
            listing = self._get(server, "/v1/models")
        except ServerError as e:
            raise UserError(f"{e}; start it with `opsd serve MODEL` or fix rollout.servers") from None
        try:
            return listing["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{server}/v1/models lists no model: is it `opsd serve`?") from None

    def _server_dtype(self, server: str) -> str | None:
        """The dtype the server computes in, from vLLM's dev-mode ``/server_info`` (`opsd serve` turns
        dev mode on); None where it does not say."""
        try:
            info = self._get(server, "/server_info?config_format=json")
            dtype = info["vllm_config"]["model_config"]["dtype"]
        except (ServerError, KeyError, TypeError):
            return None
        return str(dtype).removeprefix("torch.")

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """``len(prompts) * n`` completions, prompt-major; prompt ``i`` to server ``i mod S``."""
        params.validate()
        _check_prompts(prompts, n, self.vocab_size)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")

        def one(i: int) -> list[Completion]:
            server = (self.rank * len(prompts) + i) % len(self.servers)
            # One seed per request: a resumed run asks each server for what the original asked.
            return self._complete(server, i, prompts[i], n, params, (seed + 7919 * i) % 2**63)

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(prompts)))) as pool:
            groups = list(pool.map(one, range(len(prompts))))
        return [c for g in groups for c in g]

    def submit(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Future:
        """:meth:`generate` in the background (``rollout.overlap``): the servers sample while the
        trainer trains; :meth:`collect` waits for the result."""
        return self._background.submit(self.generate, prompts, n, params)

    def collect(self, handle: Future) -> list[Completion]:
        return handle.result()

    def _complete(
        self, s: int, i: int, prompt: list[int], n: int, params: SamplingParams, seed: int
    ) -> list[Completion]:
        """One ``/v1/completions`` request to server ``s`` for prompt ``i``'s ``n`` samples."""
        body = {
            "model": self.model_names[s],
            "prompt": list(prompt),
            "n": n,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": seed,
            "stop": list(params.stop_strings),
            "stop_token_ids": _stop_ids(self.tokenizer, self.model, list(params.stop_token_ids)),
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        out = self._post(self.servers[s], "/v1/completions", body)
        if not isinstance(out, dict) or not isinstance(out.get("choices"), list):
            raise ServerError(f"rollout server {self.servers[s]} answered /v1/completions without choices")
        return [self._completion(i, c, self.servers[s]) for c in sorted(out["choices"], key=_index)]

    @staticmethod
    def _completion(i: int, choice: dict, server: str) -> Completion:
        toks = list(choice.get("token_ids") or [])
        lps = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
        reason = choice.get("finish_reason")
        if len(lps) != len(toks) or reason not in ("stop", "length"):
            raise ServerError(
                f"rollout server {server} returned {len(lps)} log-probs for {len(toks)} tokens, "
                f"finish_reason {reason!r} (prompt {i}); is it `opsd serve` (vLLM 0.32, token ids on)?"
            )
        if any(x is None for x in lps):
            raise ServerError(f"rollout server {server} returned a missing log-prob (prompt {i})")
        return Completion(i, toks, [float(x) for x in lps], reason)

    # -- weights -------------------------------------------------------------------------------

    def sync_weights(self, model) -> None:
        """Collective: the merged weights to disk (rank 0 writes), every server reloads them, a probe
        checks that they did; every rank returns only when all of that is done."""
        from opsd.checkpoint import write_merged

        self.model = model
        self.syncs += 1
        if self.transport == "nccl":
            self._agree(lambda: self._send_nccl(model))
            self._probe(model)
            return
        final = self.sync_dir / f"step-{self.syncs:06d}"
        tmp = self.sync_dir / f".step-{self.syncs:06d}.tmp"
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)

        def write_and_reload() -> None:
            try:
                write_merged(model, self.tokenizer, tmp)  # collective: every rank gathers, rank 0 writes
            except OSError as e:
                raise ServerError(
                    f"writing the weights for the rollout servers to {tmp} failed: {e}"
                ) from None
            self._reload(tmp, final)

        self._agree(write_and_reload)
        self._probe(model)

    def _send_nccl(self, model) -> None:
        """NOT EXECUTED (no GPU here): vLLM 0.32's own trainer-side NCCL engine, one group per server
        (this trainer's rank 0 is NCCL rank 0, the server's workers follow), over the merged weights.
        Every rank iterates the source (FSDP gathers); only rank 0 broadcasts and drives the server."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        if self._nccl is None:
            self._nccl = []
            for server, endpoint in zip(self.servers, self.nccl_endpoints):
                host, _, port = endpoint.rpartition(":")
                info = NCCLTrainerInitInfo(
                    master_address=host,
                    master_port=int(port),
                    world_size=1 + self.server_world_size,
                    rank=self.rank,
                )
                client = HTTPVLLMWeightSyncClient(server, timeout=self.timeout_s)
                source = merged_weight_source(model)
                self._nccl.append(
                    NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
                )
        for engine in self._nccl:
            engine.source = merged_weight_source(model)
            engine.send_weights()
        if self.rank == 0:
            for server in self.servers:
                self._post(server, "/reset_prefix_cache")

    def _agree(self, fn) -> None:
        """Every rank runs ``fn`` and every rank raises if any failed (no rank left in a collective)."""
        try:
            fn()
            err = None
        except ServerError as e:
            err = e
        found = first_error(err)
        if found is not None:
            raise err if err is not None else ServerError(f"rank {found[0]}: {found[1]}")

    def _on_rank0(self, fn, user: bool = False) -> Any:
        """``fn()`` on rank 0 only (HTTP to the servers), its result or its failure sent to every rank."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box = [("ok", fn())]
            except (ServerError, UserError) as e:
                box = [("err", str(e))]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "err":
            raise UserError(value) if user else ServerError(value)
        return value

    def _reload(self, tmp: Path, final: Path) -> None:
        if self.rank != 0:
            return
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for server in self.servers:
            self._post(server, "/pause?mode=wait")
            try:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(final.resolve())}}
                self._post(server, "/collective_rpc", rpc)
                self._post(server, "/reset_prefix_cache")
            finally:  # a failed reload must not leave the server paused for the next run
                self._post(server, "/resume")
        for old in self.sync_dir.glob("step-*"):  # the servers read the newest; older ones can go
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def _probe(self, model) -> None:
        """Each server samples PROBE_TOKENS after a fixed prompt; the trainer's log-probs of those
        tokens must match the server's (float32 on both sides: ~1e-6; a server still on the old
        weights: the size of one update's change, orders above the tolerance)."""
        from opsd.loss import token_logprobs
        from opsd.parallel import forward_hidden, full_head_weight

        prompt = self.tokenizer("The weights were synchronised.", add_special_tokens=False).input_ids
        # Plain sampling at T=1 (no top-k/top-p, no masked stop tokens): the log-probs are comparable.
        params = SamplingParams(temperature=1.0, max_new_tokens=PROBE_TOKENS)

        def sample() -> list:
            done = [self._complete(s, 0, prompt, 1, params, 1234)[0] for s in range(len(self.servers))]
            return [(s, (c.token_ids, c.logprobs)) for s, c in enumerate(done)]

        probes = [self._on_rank0(sample)]
        device = next(model.parameters()).device
        training = model.training
        model.eval()  # no dropout: the server has none
        gaps = []
        for s, (toks, lps) in probes[0]:
            if not toks:  # a stop token first: nothing to compare on this server
                continue
            ids = torch.tensor([prompt + toks], device=device)
            mask = torch.ones_like(ids)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(toks) - 1, device=device)
            with torch.no_grad():
                hidden = forward_hidden(model, ids, mask, pos)
                mine = token_logprobs(hidden, full_head_weight(model), torch.tensor(toks, device=device))
            gaps.append((s, float((mine.cpu().double() - torch.tensor(lps).double()).abs().max())))
        model.train(training)
        worst = max(gaps, key=lambda g: g[1], default=(0, 0.0))
        self.last_probe_gap = worst[1]
        if worst[1] > self.sync_tolerance:
            raise ServerError(
                f"rollout server {self.servers[worst[0]]} did not take the new weights: after sync "
                f"{self.syncs} its log-probs differ from the trainer's by {worst[1]:.2e} "
                f"(rollout.sync_tolerance={self.sync_tolerance:g})"
            )

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)


def check_nccl() -> None:
    """The NCCL transport needs CUDA, NCCL and vLLM on the trainer's side: with no libnccl vLLM's
    communicator disables itself and a broadcast returns without sending (an update that reports
    success while the server keeps its weights), so refuse instead."""
    import importlib.util

    missing = [
        what
        for what, ok in (
            ("CUDA", torch.cuda.is_available()),
            ("NCCL", dist.is_available() and dist.is_nccl_available()),
            ("vLLM in the trainer's environment", importlib.util.find_spec("vllm") is not None),
        )
        if not ok
    ]
    if missing:
        raise UserError(
            f"rollout.weight_sync=nccl needs {', '.join(missing)} on this machine; use "
            "rollout.weight_sync=disk (any machine)"
        )


def merged_weight_source(model):
    """vLLM's ``WeightSource`` over the merged weights (LoRA folded in out of place, HF names, full
    tensors gathered one at a time): what the NCCL engine sends. Needs vLLM."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

    from opsd.models import merged_weight_meta, merged_weights

    class MergedSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(name, dtype, shape) for name, dtype, shape in merged_weight_meta(model)]

        def __iter__(self):
            for name, tensor in merged_weights(model):
                yield name, materialize_full_tensor(tensor)

    return MergedSource()


def _index(choice: dict) -> int:
    return int(choice.get("index", 0))


# ----------------------------------------------------------------------------------------------
# `opsd serve`


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
    """``--dtype auto``: opsd's own resolution (bfloat16 on a GPU with bf16 or a CPU with AMX/AVX512-BF16
    units, float32 elsewhere), which vLLM's CPU backend accepts, with the reason."""
    if setting != "auto":
        return setting, "--dtype"
    from opsd.devices import resolve_device
    from opsd.precision import compute_dtype, dtype_name

    dtype, why = compute_dtype("auto", resolve_device("auto"))
    return dtype_name(dtype), f"--dtype auto: {why}"


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
    from opsd.rollout import cpu_kv_cache_bytes

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
    p.add_argument("model", help="the model directory (the same the trainer starts from)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="bind address (the dev endpoints are unauthenticated)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="vLLM's dtype; auto (default): bfloat16 on a GPU or a CPU with bf16 units, else float32. "
        "The trainer's rollout.sync_tolerance follows what the server reports",
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


def run_serve(args: argparse.Namespace) -> int:
    if not Path(args.model).is_dir():
        raise UserError(f"{args.model}: no such model directory")
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
    return subprocess.call(cmd, env=env)
