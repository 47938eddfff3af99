"""rollout.engine=vllm_server against a fake server that speaks the same HTTP as `vllm serve` (the
endpoints opsd calls, with vLLM 0.32's request and response fields) and generates with the HF
engine on its own copy of the model, reloading it from the synced directory as vLLM's
``reload_weights(weights_path=...)`` does. No vLLM needed; tests/test_vllm.py runs the real one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers import build_assets, make_cfg
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from opsd import Trainer
from opsd.errors import TrainingError, UserError
from opsd.rollout import HFEngine, SamplingParams


class FakeServer:
    """One `vllm serve` stand-in on 127.0.0.1; ``calls`` records every request path in order."""

    def __init__(self, model_dir: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.engine = HFEngine(self.model, self.tok)
        self.calls: list[str] = []
        self.fail_next: str | None = None  # a path that answers HTTP 500 once
        self.dtype: str | None = None  # what /server_info reports (vLLM's dev mode), None: no answer
        # One request at a time: the HF engine seeds through a global RNG scope (vLLM has a generator
        # per request), so concurrent requests would draw from each other's streams.
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                server.calls.append(self.path)
                if self.path.startswith("/server_info"):
                    if server.dtype is None:
                        return self._reply(404, {"detail": "Not Found"})
                    config = {"model_config": {"dtype": f"torch.{server.dtype}"}}
                    return self._reply(200, {"vllm_config": config})
                self._reply(200, {"data": [{"id": "tiny"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                path = self.path.split("?")[0]
                server.calls.append(path)
                if server.fail_next == path:
                    server.fail_next = None
                    return self._reply(500, {"error": "engine dead"})
                with server.lock:
                    answer = server.answer(path, body)
                self._reply(200, answer)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict) -> dict:
        if path == "/v1/completions":
            params = SamplingParams(
                temperature=body["temperature"],
                top_p=body["top_p"],
                top_k=max(0, body["top_k"]),
                max_new_tokens=body["max_tokens"],
                min_new_tokens=body["min_tokens"],
                stop_strings=body["stop"],
                seed=body["seed"],
            )
            comps = self.engine.generate([body["prompt"]], body["n"], params)
            choices = [
                {
                    "index": j,
                    "token_ids": c.token_ids,
                    "logprobs": {"token_logprobs": c.logprobs},
                    "finish_reason": c.finish_reason,
                }
                for j, c in enumerate(comps)
            ]
            return {"choices": choices}
        if path == "/collective_rpc":
            assert body["method"] == "reload_weights"
            weights = {}
            for f in Path(body["kwargs"]["weights_path"]).glob("*.safetensors"):
                weights |= load_file(str(f))
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            return {"results": [None]}
        return {}

    def close(self) -> None:
        self.http.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("server"))


@pytest.fixture
def server(assets):
    s = FakeServer(assets["model"])
    yield s
    s.close()


def _cfg(assets, tmp_path, servers: list[str], **over):
    return make_cfg(
        assets,
        tmp_path / "run",
        **{
            "rollout.engine": "vllm_server",
            "rollout.servers": json.dumps(servers),
            "rollout.sync_dir": str(tmp_path / "weights"),
            "rollout.server_timeout_s": 30,
            **over,
        },
    )


def test_training_through_a_server_syncs_weights_after_every_step(assets, tmp_path, server):
    """Three steps: each rollout's log-probs agree with the trainer's (the logprob_gap check, on by
    default for a server; both sides float32 on the same CPU, so the gap is float32 rounding of the
    same forward: below 1e-4), each step ends with pause -> reload -> reset cache -> resume and a
    probe, and only the newest weights directory is kept."""
    tr = Trainer(_cfg(assets, tmp_path, [server.url], **{"optim.max_steps": 3}))
    server.calls.clear()
    history = tr.train()
    assert all(rec["logprob_gap"] < 1e-4 for rec in history)
    syncs = [i for i, c in enumerate(server.calls) if c == "/collective_rpc"]
    assert len(syncs) == 3
    for i in syncs:
        assert server.calls[i - 1 : i + 3] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["step-000003"]
    assert tr.engine.last_probe_gap < 1e-4


def test_two_servers_share_the_prompts(assets, tmp_path, server):
    other = FakeServer(assets["model"])
    try:
        tr = Trainer(_cfg(assets, tmp_path, [server.url, other.url], **{"optim.max_steps": 1}))
        server.calls.clear()
        other.calls.clear()
        tr.train()
        for s in (server, other):
            assert s.calls.count("/v1/completions") >= 1  # a rollout request (and the probe) each
            assert s.calls.count("/collective_rpc") == 1
    finally:
        other.close()


def test_a_server_down_at_start_is_one_line(assets, tmp_path):
    with pytest.raises(UserError, match="did not answer /v1/models"):
        Trainer(_cfg(assets, tmp_path, ["http://127.0.0.1:9"]))


def test_a_server_failing_mid_run_names_it_and_the_last_checkpoint(assets, tmp_path, server):
    tr = Trainer(_cfg(assets, tmp_path, [server.url], **{"optim.max_steps": 3}))
    tr.train(until_step=1)  # checkpoint.every=1: step 1 is saved
    server.fail_next = "/v1/completions"
    with pytest.raises(TrainingError, match=rf"{server.url}.*HTTP 500.*step_000001.*--resume"):
        tr.train()
    # The server is back: --resume continues from the checkpoint and loses nothing.
    again = Trainer(_cfg(assets, tmp_path, [server.url], **{"optim.max_steps": 3}), resume=True)
    assert again.step_num == 1
    assert [rec["step"] for rec in again.train()] == [2, 3]


def test_a_server_that_keeps_old_weights_stops_the_run(assets, tmp_path, server):
    """If the reload does nothing, the probe sees the old weights and the run stops with one line."""
    tr = Trainer(_cfg(assets, tmp_path, [server.url], **{"optim.max_steps": 1}))
    server.answer_rpc = server.answer
    server.answer = lambda path, body: {} if path == "/collective_rpc" else server.answer_rpc(path, body)
    with pytest.raises(TrainingError, match="did not take the new weights"):
        tr.train()


def test_nccl_is_refused_where_it_cannot_work(assets, tmp_path, server):
    with pytest.raises(UserError, match="weight_sync=nccl needs CUDA"):
        Trainer(_cfg(assets, tmp_path, [server.url], **{"rollout.weight_sync": "nccl"}))


def _serve(*argv: str):
    import argparse

    from opsd.vllm_server import add_serve_arguments, serve_command

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return serve_command(p.parse_args(list(argv)))


def test_serve_command_has_the_flags_opsd_needs(tmp_path):
    cmd, _ = _serve(str(tmp_path), "--port", "8123", "--vllm-args=--max-model-len 64")
    joined = " ".join(cmd)
    assert "--host 127.0.0.1" in joined and "--port 8123" in joined
    assert "--logprobs-mode processed_logprobs" in joined and "--enforce-eager" in joined
    assert cmd[-2:] == ["--max-model-len", "64"]


def test_serve_sizes_the_cpu_kv_cache_from_length_and_sequences(assets):
    """On a CPU `opsd serve` asks for a KV cache of --max-num-seqs sequences of --max-model-len tokens
    (the colocated engine's cpu_kv_cache_bytes), not vLLM's 92% of the RAM; what --vllm-args sets
    stands, and its --max-model-len / --max-num-seqs size the cache."""
    from transformers import AutoConfig

    from opsd.rollout import cpu_kv_cache_bytes

    config = AutoConfig.from_pretrained(assets["model"])

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1] if name in cmd else None

    cmd, notes = _serve(assets["model"], "--dtype", "float32")  # no --max-model-len: min(model's, 4096)
    assert flag(cmd, "--max-model-len") == "2048" and flag(cmd, "--max-num-seqs") == "16"
    assert flag(cmd, "--kv-cache-memory-bytes") == str(cpu_kv_cache_bytes(config, "float32", 16, 2048))
    assert any("KV cache for 16 sequences of 2048 tokens" in n for n in notes)

    cmd, _ = _serve(assets["model"], "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "4")
    assert flag(cmd, "--kv-cache-memory-bytes") == str(cpu_kv_cache_bytes(config, "bfloat16", 4, 512))
    assert cmd.count("--max-model-len") == 1 and flag(cmd, "--max-num-seqs") == "4"

    cmd, _ = _serve(assets["model"], "--dtype", "float32", "--vllm-args=--max-model-len=256 --max-num-seqs 2")
    assert flag(cmd, "--kv-cache-memory-bytes") == str(cpu_kv_cache_bytes(config, "float32", 2, 256))
    assert cmd.count("--max-num-seqs") == 1 and cmd.count("--max-model-len=256") == 1

    for mine in ("--kv-cache-memory-bytes 1000000", "--gpu-memory-utilization 0.2"):
        cmd, notes = _serve(assets["model"], f"--vllm-args={mine}")
        assert cmd.count("--kv-cache-memory-bytes") == mine.count("kv-cache") and len(notes) == 1


def test_serve_dtype_follows_opsd_auto(assets, cpu_bf16):
    """--dtype auto (the default): bfloat16 where the machine has bf16 units, float32 elsewhere."""
    cmd, notes = _serve(assets["model"])
    want = "bfloat16" if cpu_bf16 else "float32"
    assert cmd[cmd.index("--dtype") + 1] == want
    assert notes[0].startswith(f"vLLM dtype: {want} (--dtype auto: ")
    cmd, notes = _serve(assets["model"], "--dtype", "float16")
    assert cmd[cmd.index("--dtype") + 1] == "float16" and notes[0] == "vLLM dtype: float16 (--dtype)"


def test_a_half_precision_server_widens_the_sync_tolerance(assets, tmp_path, server):
    """A float32 trainer against a bf16 server (`opsd serve --dtype auto` on a machine with bf16
    units): /server_info says bfloat16, so the probe tolerates bf16 rounding (0.1, not 1e-3)."""
    tr = Trainer(_cfg(assets, tmp_path, [server.url], **{"optim.max_steps": 1}))
    assert tr.engine.server_dtypes == [None] and tr.engine.sync_tolerance == 1e-3
    tr.close()
    server.dtype = "bfloat16"
    tr = Trainer(_cfg(assets, tmp_path / "bf16", [server.url], **{"optim.max_steps": 1}))
    assert tr.engine.server_dtypes == ["bfloat16"] and tr.engine.sync_tolerance == 0.1
    tr.close()


def test_overlap_requests_the_next_rollouts_before_training(assets, tmp_path, server):
    """rollout.overlap=1: step 1's rollouts are sampled on the spot (lag 0); step 2's are requested
    before step 1 trains, so the server serves them before its first weight reload (lag 1)."""
    tr = Trainer(_cfg(assets, tmp_path, [server.url], **{"rollout.overlap": 1, "optim.max_steps": 3}))
    server.calls.clear()
    history = tr.train()
    assert [rec["policy_lag"] for rec in history] == [0.0, 1.0, 1.0]
    first_sync = server.calls.index("/collective_rpc")
    rollouts = [i for i, c in enumerate(server.calls) if c == "/v1/completions"]
    # Two prompts a step: steps 1 and 2 were both requested before the first reload (probes aside).
    assert sum(i < first_sync for i in rollouts) >= 4
    assert tr.pending is None  # nothing is requested past optim.max_steps


def test_overlap_resumes_exactly_with_the_batch_in_flight(assets, tmp_path, server):
    """The batch requested ahead is in the checkpoint: a run stopped after step 2 and resumed matches
    an uninterrupted one (same data, same responses, same losses)."""
    over = {"rollout.overlap": 1, "optim.max_steps": 4}
    straight = Trainer(_cfg(assets, tmp_path / "a", [server.url], **over)).train()
    first = Trainer(_cfg(assets, tmp_path / "b", [server.url], **over))
    first.train(until_step=2)
    assert first.pending is not None
    again = Trainer(_cfg(assets, tmp_path / "b", [server.url], **over), resume=True)
    assert again.pending is not None and again.pending.completions is not None
    resumed = again.train()
    keys = ("loss", "divergence", "resp_len_mean", "policy_lag")
    assert [[r[k] for k in keys] for r in straight[2:]] == [[r[k] for k in keys] for r in resumed]


def test_overlap_needs_a_server_engine(assets, tmp_path):
    with pytest.raises(UserError, match="overlap=1 needs rollout.engine=vllm_server"):
        make_cfg(assets, tmp_path / "r", **{"rollout.overlap": 1})


def _fleet_worker(d, paths: dict, root: str, url: str) -> None:
    """One of two gloo ranks training through the same server: each rank sends its own prompts, only
    rank 0 writes and reloads the weights, and every rank waits for the sync (and its probe)."""
    tr = Trainer(_cfg(paths, Path(root), [url], **{"optim.max_steps": 2}), dist=d)
    history = tr.train()
    tr.close()
    assert [rec["step"] for rec in history] == [1, 2]
    assert all(rec["logprob_gap"] < 1e-4 for rec in history)


@pytest.mark.slow
def test_two_ranks_share_a_server_and_wait_for_each_sync(assets, tmp_path, server):
    from helpers import spawn

    server.calls.clear()
    spawn(_fleet_worker, assets, str(tmp_path), server.url)
    assert server.calls.count("/collective_rpc") == 2  # rank 0 alone reloads, once a step
    assert server.calls.count("/pause") == server.calls.count("/resume") == 2
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["step-000002"]
