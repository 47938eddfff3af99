"""opsd.distributed on CPU gloo ranks the tests spawn themselves: starting and ending a run.

A setup error on rank 0 ends every rank with its message, a partial torchrun environment is a user
error, vLLM's tensor-parallel group runs the union with one seed, and a gloo worker freeing tensors at
finalization exits cleanly with ``exit_rank``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import TESTS, FakeLLM, spawn

from opsd import distributed as D
from opsd.errors import UserError
from opsd.tiny import build_tiny_model, build_tiny_tokenizer

# --- setup errors and rank agreement ----------------------------------------------------------------


def _agreement_worker(d: D.Dist, out: str) -> None:
    assert d.world_size == 2 and d.device == torch.device("cpu") and d.mesh is not None
    assert D.agree_count(3 if d.rank == 0 else 1) == 3
    assert D.any_rank(d.rank == 1) is True and D.any_rank(False) is False
    assert D.all_reduce_sum(torch.tensor([1.0 + d.rank], dtype=torch.float64)).item() == 3.0
    assert len({D.rank_seed(5, 0), D.rank_seed(5, 1)}) == 2 and D.rank_seed(5, 0) == 5
    assert D.run_setup(lambda: d.rank, "a good phase") == d.rank

    def setup() -> None:
        if d.rank == 0:
            raise UserError("run directory runs/x already exists: pass --resume or --overwrite")
        time.sleep(0.5)

    start = time.monotonic()
    try:
        D.run_setup(setup, "run directory setup")
    except Exception as err:  # noqa: BLE001 -- the test records what each rank raised
        Path(out, f"rank{d.rank}.txt").write_text(
            f"{type(err).__name__}|{err}|{time.monotonic() - start:.2f}"
        )


@pytest.mark.slow
def test_setup_error_on_rank0_ends_every_rank_with_its_message(tmp_path):
    spawn(_agreement_worker, str(tmp_path))
    for rank in (0, 1):
        kind, msg, secs = (tmp_path / f"rank{rank}.txt").read_text().split("|")
        assert kind == "UserError" and "runs/x already exists" in msg, (rank, kind, msg)
        # a time, not a rounding error: ~0.5 s (rank 1's sleep) when the error is shared at once, the process
        # group's timeout (30 min) when it is not; 10 s leaves room for a loaded 2-core machine
        assert float(secs) < 10
    assert "rank 0 failed during run directory setup" in (tmp_path / "rank1.txt").read_text()


def test_partial_torchrun_environment_is_a_user_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for k in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError, match="incomplete"):
        D.init_distributed("cpu")


# --- the vLLM engine's tensor-parallel group, against the fake vllm of tests/helpers.py -------------


def _tp_group_worker(d: D.Dist, tmp: str) -> None:
    """Two ranks form one tensor-parallel group: each engine runs the union of the group's prompts with
    the first rank's seed, and each rank gets back only its own completions, renumbered."""
    import sys
    from types import SimpleNamespace

    import torch.distributed as dist

    from opsd.config import RolloutConfig
    from opsd.rollout import SamplingParams
    from opsd.rollout.make import EngineRun, make_engine

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2)
    model.config._name_or_path = tmp
    log, llms = [], []

    def LLM(**kw):
        llms.append(FakeLLM(list(model.state_dict()), log, **kw))
        return llms[-1]

    platform = SimpleNamespace(is_sleep_mode_available=lambda: False, is_cpu=lambda: True)
    sys.modules.update(
        {
            "vllm": SimpleNamespace(
                __version__="0.32.0", LLM=LLM, SamplingParams=lambda **kw: SimpleNamespace(kwargs=kw)
            ),
            "vllm.platforms": SimpleNamespace(current_platform=platform),
            "vllm.distributed": SimpleNamespace(
                destroy_model_parallel=lambda: None, destroy_distributed_environment=lambda: None
            ),
        }
    )
    cfg = RolloutConfig(engine="vllm", tensor_parallel_size=2, max_new_tokens=5)
    eng = make_engine(cfg, model, tok, EngineRun(max_prompt_len=50))
    assert llms[0].kwargs["tensor_parallel_size"] == 2
    prompts = [[1, 2, 3], [4, 5]] if d.rank == 0 else [[6, 7, 8, 9]]
    out = eng.generate(prompts, 2, SamplingParams(max_new_tokens=5, seed=100 + d.rank))
    assert ("generate", 3) in log  # the union of the group's three prompts
    assert [c.prompt_index for c in out] == ([0, 0, 1, 1] if d.rank == 0 else [0, 0])
    union = [[o.token_ids for o in sorted(x.outputs, key=lambda o: o.index)] for x in llms[0].last_outs]
    both: list = [None, None]
    dist.all_gather_object(both, ([c.token_ids for c in out], union))
    assert both[0][1] == both[1][1]  # the same seed on both ranks: identical draws for the union
    assert both[1][0] == both[0][1][2] and both[0][0] == both[0][1][0] + both[0][1][1]
    try:  # ranks of one group asking for different settings is an error on every rank
        eng.generate(prompts, 1 + d.rank, SamplingParams(max_new_tokens=5))
        raise AssertionError("mismatched n was accepted")
    except RuntimeError as e:
        assert "different sampling settings" in str(e)
    eng.close()


@pytest.mark.slow
def test_vllm_tensor_parallel_group_runs_the_union_with_one_seed(tmp_path):
    spawn(_tp_group_worker, str(tmp_path))


# --- clean exits ------------------------------------------------------------------------------------

_LATE_WORK = """
import gc, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from opsd import distributed as D


class SlowFinalizer:
    # Garbage when the interpreter starts finalizing: its collection there sleeps with the GIL
    # released, holding this rank in finalization while the late rank arrives.
    def __del__(self):
        time.sleep(6)


dist.init_process_group("gloo")
MESH = init_device_mesh("cpu", (2,))  # like FSDP's mesh in DTensor's caches: the group outlives destroy
if dist.get_rank() == 1:
    time.sleep(3)  # rank 0's gloo worker still holds the gather's Python tensors when rank 0 returns
out = [torch.zeros(4) for _ in range(2)]
work = dist.all_gather(out, torch.ones(4), async_op=True)
# What the worker does with a finished gather's Python tensors, take the GIL, made certain: a
# completion callback runs on the gloo worker thread when the late rank arrives.
DONE = work.get_future().then(lambda f: len(f.value()))
del out, work
D.shutdown()
gc.set_threshold(0)  # no automatic collection: the cycle below is collected by finalization itself
cycle = SlowFinalizer()
cycle.self = cycle
del cycle
if sys.argv[1] == "exit_rank":
    D.exit_rank(0)
"""


def _torchrun(script, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = D.torchrun_command(2, str(script), *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_a_gloo_worker_freeing_python_tensors_at_finalization_aborts_and_exit_rank_avoids_it(tmp_path):
    """The root cause of the intermittent SIGABRT after successful two-rank runs, made deterministic:
    a gloo worker thread drops the last reference to a collective's Python tensors while the main
    thread finalizes the interpreter; taking the GIL then ends the thread inside a C++ destructor
    ("terminate called without an active exception"). In opsd the window is the instant between a
    worker completing a collective and releasing it. Here it is certain: rank 0 is held in
    finalization (a finalizer sleeps) when rank 1 arrives, and the worker then takes the GIL for a
    completion callback. Ending the rank with exit_rank (no finalization) is clean."""
    script = tmp_path / "late_work.py"
    script.write_text(_LATE_WORK)
    plain = _torchrun(script, "return")
    assert plain.returncode != 0 and "terminate called without an active exception" in plain.stderr, (
        "the abort no longer reproduces with this torch: opsd.distributed.exit_rank may be unnecessary",
        plain.returncode,
        plain.stderr[-2000:],
    )
    clean = _torchrun(script, "exit_rank")
    assert clean.returncode == 0 and "Traceback" not in clean.stderr and "terminate" not in clean.stderr, (
        clean.stderr[-2000:]
    )
