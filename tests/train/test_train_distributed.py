"""`opsd train` on 2 gloo ranks (CPU): FSDP2 through the trainer, resume across world sizes, stop
signals, setup errors, and a real torchrun launch.

opsd.distributed's own tests check FSDP arithmetic case by case (LoRA, full fine-tuning, HSDP,
uneven micro-batches); these check that the trainer wires it up. Each spawn pays for two fresh
interpreters importing torch and transformers, so one spawn runs several trainings.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from helpers import FULL_FT, TESTS, ScriptedEngine, build_assets, make_cfg, spawn

from opsd import Trainer
from opsd.checkpoint import list_checkpoints
from opsd.config import RolloutConfig
from opsd.distributed import torchrun_command
from opsd.errors import UserError

# Sampled rollouts, LoRA dropout and an EMA teacher: a resume must restore each rank's RNG state,
# and the EMA weights (sharded, in the checkpoint's dcp/) exactly.
SAMPLED = {
    "teacher.mode": "ema",
    "teacher.ema_decay": 0.7,
    "model.lora.dropout": 0.1,
    "optim.max_steps": 4,
    "optim.scheduler": "cosine",
    "checkpoint.save_merged": "true",
}
# Greedy rollouts and no dropout: nothing depends on how the batch is split over ranks, so 2 ranks and
# 1 rank compute the same numbers. Full fine-tuning with a fixed teacher (a sharded frozen copy), several
# micro-batches per rank, and sharded evaluation of 3 problems (rank 1 gets 1 of them).
# optim.eps=1e-3 keeps AdamW from blowing float noise in near-zero gradients up to full-size steps.
GREEDY = {
    "model.lora.enabled": "false",
    "rollout.temperature": 0,
    "optim.max_steps": 4,
    "optim.eps": 1e-3,
    "optim.max_tokens_per_microbatch": 40,
    "eval.path": None,
    "eval.every": 2,
    "eval.limit": 3,
    "eval.max_new_tokens": 4,
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("assets"))


KEYS = ("loss", "divergence", "grad_norm", "resp_len_mean", "tokens", "real_token_frac_teacher")


def _greedy(paths: dict) -> dict:
    return {**GREEDY, "eval.path": paths["data"]}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# Runs at another world size pack other micro-batches, so their matrix products sum in another order
# and the logits differ by float32 rounding (a K-term dot product by at most K*u*sum|a_i b_i|, u = 2^-24).
# The loss is a mean over tokens (a sum over ranks of float32 partial sums) of per-token divergences
# D = sum_v P(v) (log P(v) - log S(v)), ~1e-4 nats, each a P-weighted mean of differences of log-probs
# near -ln V = -6.2. D is at its minimum in the student logits (dD/dz_s = S - P), so the logits' own
# drift dz moves it by only |S - P|_1 max|dz| <= sqrt(2D) max|dz| (Pinsker). What moves it is the
# rounding of the log-probs themselves, which float32 forms (a log-sum-exp, a subtraction) to within
# ~2u|log p| of the values, afresh whenever the logits differ: two runs disagree by <= 4u|log p| per
# log-prob (measured: one ulp, 1.3u ln V). Summed over the terms, |dD| <= 4u sum_v P (|log P| + |log S|)
# = 4u (H(P) + H(P) + D), from the logged teacher entropy, and the token mean adds the rounding of a sum
# of T terms, T u D. The loss's relative error is then its terms' size over the loss, 8u H/D ~ 3e-2 at
# step 1 (an AVX2-only EPYC: 3.3e-8 absolute, 3.4e-4 relative).
# At later steps the weights also differ (AdamW turns rounding in near-zero gradients into updates:
# |d theta| ~ 3e-7 after 4 steps), moving the loss by ~grad_norm * |d theta| = 1e-9, far below that.
U32 = torch.finfo(torch.float32).eps / 2


def _loss_atol(rec: dict) -> float:
    """The bound above on how far another world size's loss (or divergence) falls from ``rec``'s."""
    return 4 * U32 * (2 * rec["entropy_teacher"] + rec["loss"]) + rec["tokens"] * U32 * rec["loss"]


def _grad_rtol(rec: dict) -> float:
    """The same rounding in the gradient at the logits, w (S - P) per token: its entries move by
    <= 4u |log p| (S + P), ~8u H/V, against |S - P| ~ sqrt(2D/V) (D ~ V |S - P|^2 / 2 for P near
    uniform, as the tiny model's is): relative 8u H / sqrt(2D), ~2e-4 at step 1. The products that
    carry it back to the weights apply one linear map to both."""
    return 8 * U32 * rec["entropy_teacher"] / math.sqrt(2 * max(rec["loss"], U32))


def _same(got: list[dict], want: list[dict], rel: float, keys=KEYS, rounding: bool = False) -> None:
    """``got`` == ``want`` record by record, ``rel`` relative; with ``rounding`` the loss and the
    divergence to :func:`_loss_atol` of ``want``'s record (another world size), else to 1e-9."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in (k for k in keys if k in b):
            floor = _loss_atol(b) if rounding and k in ("loss", "divergence") else 1e-9
            assert a[k] == pytest.approx(b[k], rel=rel, abs=floor), (a["step"], k, a[k], b[k], floor)


def _runs_worker(d, paths: dict, root: str) -> None:
    root_p = Path(root)
    runs = [
        ("sampled-full", SAMPLED, None, False),
        ("sampled-part", SAMPLED, 2, False),
        ("sampled-part", SAMPLED, None, True),
        ("greedy-full", _greedy(paths), None, False),
        ("greedy-part", _greedy(paths), 2, False),
    ]
    for name, over, until, resume in runs:
        if resume:
            torch.manual_seed(1234 + d.rank)  # whatever this process drew: the checkpoint's RNG state wins
        Trainer(make_cfg(paths, root_p / name, **over), resume=resume, dist=d).train(until_step=until)


@pytest.mark.slow
def test_two_ranks_match_one_and_resume_across_world_sizes(assets, tmp_path):
    """2 ranks == 1 rank on the union batch (full fine-tuning, greedy rollouts, sharded eval), and the
    exported weights agree; 2 ranks -> stop -> resume with 2 ranks is exact (sampled rollouts, LoRA
    dropout, EMA teacher); 2 ranks -> stop -> resume with 1 rank matches the uninterrupted 2-rank run.

    Where the arithmetic differs: another world size packs the micro-batches differently, so hidden
    states differ by float rounding, and the loss, a ~1e-4 mean of differences of ~6-nat float32
    log-probs, by up to _loss_atol (~3e-6 absolute; the gradient norm by _grad_rtol, ~2e-4 relative,
    at step 1). AdamW then turns the rounding in near-zero gradients into small weight differences,
    so later steps agree to 1e-3 relative (measured: the gradient norm to <= 5e-7).
    Sampled rollouts and dropout draw from per-rank generators: after a world-size change they
    draw other numbers, so a sampled run resumed at another world size continues correctly but not
    bit for bit like the uninterrupted one.
    """
    spawn(_runs_worker, assets, str(tmp_path))
    sampled = _metrics(tmp_path / "sampled-full")
    assert [r["step"] for r in sampled] == [1, 2, 3, 4]
    _same(_metrics(tmp_path / "sampled-part"), sampled, rel=1e-6)
    _check_lora_export(list_checkpoints(tmp_path / "sampled-full")[-1], assets["model"])

    greedy = _metrics(tmp_path / "greedy-full")
    one = Trainer(make_cfg(assets, tmp_path / "greedy-one", **_greedy(assets))).train()
    _same(greedy[:1], one[:1], rel=_grad_rtol(one[0]), rounding=True)
    keys = KEYS + ("eval/avg@1", "eval/resp_len_mean", "eval/no_answer_frac")
    _same(greedy, one, rel=1e-3, keys=keys, rounding=True)
    assert all("eval/avg@1" in r for r in greedy[1::2])
    want = _safetensors(tmp_path / "greedy-one")
    for k, v in _safetensors(tmp_path / "greedy-full").items():  # rank 0's export from gathered weights
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=1e-6, msg=k)

    resumed = Trainer(make_cfg(assets, tmp_path / "greedy-part", **_greedy(assets)), resume=True)
    assert resumed.step_num == 2
    _same(resumed.train(), greedy[2:], rel=1e-3, rounding=True)


def _check_lora_export(ckpt: Path, base: str) -> None:
    """Rank 0 wrote the adapter and the merged model from gathered weights: they agree with each other."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), ckpt / "model")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-4)
        with adapted.disable_adapter():  # the adapter trained: it changes the logits
            assert not torch.allclose(merged(ids).logits, adapted(ids).logits)


def _safetensors(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(list_checkpoints(run)[-1] / "model" / "model.safetensors")


def _sigterm_worker(d, paths: dict, root: str) -> None:
    tr = Trainer(make_cfg(paths, Path(root) / "run", **{"optim.max_steps": 5, "checkpoint.every": 0}), dist=d)
    real_step, real_rollout = tr.step, tr.rollout

    def rollout(prompts):  # rank 1 has no samples in step 1: it pads with zero-weight micro-batches
        comps = real_rollout(prompts)
        return (
            [replace(c, token_ids=[], logprobs=[]) for c in comps] if d.rank and tr.step_num == 0 else comps
        )

    def step():
        rec = real_step()
        if d.rank == 1 and tr.step_num == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return rec

    tr.rollout, tr.step = rollout, step
    hist = tr.train()
    Path(root, f"rank{d.rank}.json").write_text(json.dumps({"hist": hist, "stopped": tr.stopped}))


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_all_after_the_same_step(assets, tmp_path):
    spawn(_sigterm_worker, assets, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert [h["step"] for h in r["hist"]] == [1, 2] and r["stopped"]
    # the logged numbers are global: the same on both ranks, although rank 1 had no samples in step 1
    assert ranks[0]["hist"] == [
        {**h, **{k: v for k, v in g.items() if k.startswith(("time_", "tokens_per_s", "peak_"))}}
        for h, g in zip(ranks[1]["hist"], ranks[0]["hist"])
    ]
    assert ranks[0]["hist"][0]["resp_len_mean"] > 0 and ranks[0]["hist"][0]["tokens"] > 0
    run = tmp_path / "run"
    assert [c.name for c in list_checkpoints(run)] == ["step_000002"]
    ckpt = list_checkpoints(run)[0]
    assert {"dcp", "model", "state.pt", "rank_00000.pt", "rank_00001.pt"} <= {p.name for p in ckpt.iterdir()}
    assert [r["step"] for r in _metrics(run)] == [1, 2]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def _clean_exit(res: subprocess.CompletedProcess, run: str) -> None:
    """A finished two-rank run: exit 0, no traceback and no abort (1 in 20 aborted at exit before ranks
    ended through opsd.distributed.exit_rank; bench/torchrun_exits.py runs it 20 times)."""
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "run directory:" in out, (run, res.returncode, out[-3000:])
    assert not any(m in out for m in ("Traceback", "terminate called", "SIGABRT")), (run, out[-3000:])


@pytest.mark.slow
def test_torchrun_trains_then_a_rank0_run_dir_error_ends_every_rank(assets, tmp_path):
    """`torchrun --standalone --nproc-per-node 2 -m opsd train` for 3 steps; the same command again
    finds the run directory on rank 0, and both ranks exit with that message at once; then the same
    run with --overwrite twice more: three finished two-rank runs, each exiting cleanly."""
    cfg = make_cfg(
        assets, tmp_path / "run", **{"optim.max_steps": 3, "device": "cpu", "logging.sample_every": 0}
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    cmd = torchrun_command(2, "-m", "opsd", "train", "--config", str(path))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    _clean_exit(res, "first")
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [1, 2, 3]
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["step_000002", "step_000003"]

    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode != 0 and time.monotonic() - start < 60, res.stderr[-3000:]
    assert res.stderr.count("already exists") >= 2, res.stderr[-3000:]  # rank 0's own line and rank 1's
    assert "rank 0 failed during setup" in res.stderr

    for attempt in ("second", "third"):
        res = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=600, env=env)
        _clean_exit(res, attempt)
        assert [r["step"] for r in _metrics(tmp_path / "run")] == [1, 2, 3]


def test_prompts_per_step_is_the_global_batch():
    assert RolloutConfig(prompts_per_step=8).prompts_per_rank(4) == 2
    with pytest.raises(
        UserError, match=r"prompts_per_step=6 is the global batch .* 4 ranks.*prompts_per_step=8"
    ):
        RolloutConfig(prompts_per_step=6).prompts_per_rank(4)


def _bf16_worker(d, paths: dict, root: str) -> None:
    """Full fine-tuning in bf16 compute over float32 masters (FSDP2's param_dtype), and LoRA over a
    bf16 base, on this rank; rank 0 writes what it saw."""
    from torch.distributed.tensor import DTensor

    import opsd.setup
    from opsd.checkpoint import gather_full_state_dict
    from opsd.setup import fsdp_param_dtype

    opsd.setup.make_engine = ScriptedEngine  # the same tokens on both ranks' runs, many embedding rows
    full = Trainer(make_cfg(paths, Path(root) / "full", **{**FULL_FT, "model.dtype": "bfloat16"}), dist=d)
    before = {k: v.clone() for k, v in gather_full_state_dict(full.run.model).items()}
    local = {
        type(p).__name__: str(p.to_local().dtype if isinstance(p, DTensor) else p.dtype)
        for p in full.run.model.parameters()
    }
    full.train()
    after = gather_full_state_dict(full.run.model)
    lora = Trainer(
        make_cfg(
            paths,
            Path(root) / "lora",
            **{"model.dtype": "bfloat16", "optim.max_steps": 1, "rollout.max_new_tokens": 4},
        ),
        dist=d,
    )
    lora.train()
    adapters = {str(p.to_local().dtype) for k, p in lora.run.model.named_parameters() if "lora_" in k}
    if d.rank == 0:
        changed = sum(int((after[k] != before[k]).sum()) for k in before)
        total = sum(v.numel() for v in before.values())
        report = {
            "moved": changed / total,
            "local": local,
            "adapters": sorted(adapters),
            "param_dtype": str(fsdp_param_dtype(full.cfg, full.run.precision)),
        }
        (Path(root) / "bf16.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_two_ranks_bf16_full_finetuning_keeps_float32_masters(assets, tmp_path):
    """Under torchrun, model.dtype=bfloat16 is FSDP2's compute dtype over float32 sharded masters:
    10 steps at lr 5e-6 move at least 80% of the weights (as one process does), and LoRA adapters
    stay float32 over a bf16 base."""
    spawn(_bf16_worker, assets, str(tmp_path))
    report = json.loads((tmp_path / "bf16.json").read_text())
    assert report["moved"] >= 0.8, report
    assert set(report["local"].values()) == {"torch.float32"}, report
    assert report["param_dtype"] == "torch.bfloat16" and report["adapters"] == ["torch.float32"], report


def _generation_worker(d, root: str) -> None:
    """Rank r generates for its own prompts through the sharded model; counts FSDP's all-gathers."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

    from opsd.parallel import shard_model
    from opsd.rollout import HFEngine, SamplingParams
    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = shard_model(build_tiny_model(tok, hidden_size=32, seed=0), d.mesh, param_dtype=None)
    prompts = [tok(f"What is {d.rank} + {i}?").input_ids for i in range(2 + d.rank)]  # uneven on purpose
    gathers = []
    real = group_mod.foreach_all_gather  # FSDP2's one all-gather of a unit's parameters

    def counting(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    group_mod.foreach_all_gather = counting
    try:
        out = HFEngine(model, tok).generate(
            prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
        )
    finally:
        group_mod.foreach_all_gather = real
    layers = len(model.model.layers)
    record = {
        "tokens": [c.token_ids for c in out],
        "logprobs": [c.logprobs for c in out],
        "gathers": len(gathers),
        "units": layers + 1,
        "prompts": prompts,
    }
    (Path(root) / f"gen{d.rank}.json").write_text(json.dumps(record))


def test_sharded_generation_gathers_once_and_equals_unsharded(tmp_path, tiny_tokenizer):
    """The HF engine on an FSDP-sharded model all-gathers each unit once per generate call (not once
    per decoded token), ranks with different numbers of prompts finish on their own, and the tokens and
    log-probs are those of the unsharded model (the log-probs to float32 rounding: the gathered weights
    are the same float32 values, the order of a product's sums need not be)."""
    from opsd.rollout import HFEngine, SamplingParams
    from opsd.tiny import build_tiny_model

    spawn(_generation_worker, str(tmp_path))
    model = build_tiny_model(tiny_tokenizer, hidden_size=32, seed=0)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"gen{rank}.json").read_text())
        assert got["gathers"] == got["units"], got["gathers"]  # 8 new tokens: 8x as many before
        want = HFEngine(model, tiny_tokenizer).generate(
            got["prompts"], 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
        )
        assert got["tokens"] == [c.token_ids for c in want]
        # The gathered weights are bit-equal, but a rank's products may sum in another order (its own
        # thread count, the gathered buffer's alignment): on an AMD EPYC one log-prob of ~-6.19 moved by
        # one float32 ulp (4.8e-7). A few roundings of logits of size ~1 carried through a log-softmax
        # over 512 entries stay within 16 units of float32 roundoff (2^-24) of the log-prob (~1-10),
        # absolute below 1; the tokens, drawn from those log-probs, stay exact.
        for g, w in zip(got["logprobs"], [c.logprobs for c in want], strict=True):
            assert g == pytest.approx(w, rel=16 * 2**-24, abs=16 * 2**-24)
