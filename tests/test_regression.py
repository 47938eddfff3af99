"""Pinned numbers: 3 steps of `opsd train` on the tiny offline model, per teacher mode and loss mode.

The values were recorded before the architecture refactor (issue 9) on torch 2.13.0 (CPU) and must
not move: a refactor that changes one computed number fails here. Regenerate only for a deliberate
change of the algorithm, with `OPSD_PRINT_PINNED=1 pytest tests/test_regression.py -s`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_trainer import build_assets

from opsd import Trainer, load_config

CASES = {
    "fixed-lora": {},
    "fixed-full": {"model.lora.enabled": "false", "teacher.frozen_copy": "cpu"},
    "ema": {"teacher.mode": "ema", "teacher.ema_decay": 0.5},
    "live": {"teacher.mode": "live"},
    "external": {"teacher.mode": "external"},
    "jsd-entry-clip": {"loss.clip_mode": "entry", "loss.clip": 0.05, "loss.beta": 0.5},
    "jsd-token-clip-seq": {"loss.clip_mode": "token", "loss.clip": 0.05, "loss.reduction": "sequence"},
    "topk": {"loss.mode": "topk", "loss.topk": 5, "loss.beta": 1.0},
    "sampled": {"loss.mode": "sampled"},
}

# step -> (loss, divergence, grad_norm); filled from a run on the pre-refactor main
PINNED: dict[str, list[tuple[float, float, float]]] = {
    'fixed-lora': [(0.00019897967285942286, 0.0001989796874113381, 0.0033515021204948425), (7.296379772014916e-05, 7.296379772014916e-05, 0.0018873432418331504), (2.8662007025559433e-05, 2.866200520657003e-05, 0.0007157331565394998)],
    'fixed-full': [(0.00019897967285942286, 0.0001989796874113381, 0.011330456472933292), (0.004452791530638933, 0.004452791685859363, 0.06204315647482872), (0.01838187873363495, 0.018381877491871517, 0.2485777586698532)],
    'ema': [(0.00019897967285942286, 0.0001989796874113381, 0.0033515021204948425), (3.745383219211362e-05, 3.745383097945402e-05, 0.001040747738443315), (4.658452235162258e-05, 4.658451750098417e-05, 0.0015281711239367723)],
    'live': [(0.00019897967285942286, 0.0001989796874113381, 0.0033515021204948425), (4.7078774514375255e-05, 4.7078768451077245e-05, 0.001208815025165677), (3.426345210755244e-05, 3.426345210755244e-05, 0.0018027463229373097)],
    'external': [(0.012819187715649605, 0.01281918833653132, 0.0017987721366807818), (0.012409997172653675, 0.0124099962413311, 0.002435369184240699), (0.012157313525676727, 0.012157312283913294, 0.005961268674582243)],
    'jsd-entry-clip': [(4.9748523451853544e-05, 4.974851617589593e-05, 0.0008379598730243742), (1.8287593775312416e-05, 1.8287593168982614e-05, 0.00047309297951869667), (6.909497642482165e-06, 6.9094979456470656e-06, 0.00017096963711082935)],
    'jsd-token-clip-seq': [(0.00019897967285942286, 0.0001989796874113381, 0.0033515021204948425), (7.296379772014916e-05, 7.296379772014916e-05, 0.0018873432418331504), (2.8662007025559433e-05, 2.866200520657003e-05, 0.0007157331565394998)],
    'topk': [(0.00020186943584121764, 0.00020186942613994083, 0.004260832443833351), (0.00014932775229681283, 0.00014932775714745125, 0.003406154690310359), (4.918003105558455e-05, 4.918002620494614e-05, 0.001133448677137494)],
    'sampled': [(0.014327135868370533, -0.0022326906522115073, 0.005372866056859493), (0.03597713261842728, -0.00564350684483846, 0.004494942724704742), (-0.0017321943305432796, 0.0003037254015604655, 0.0020223893225193024)],
}

RTOL = 1e-6


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("pinned"))


@pytest.mark.parametrize("case", list(CASES))
def test_pinned_metrics(assets, tmp_path, case):
    torch.use_deterministic_algorithms(False)
    over = dict(CASES[case])
    if over.get("teacher.mode") == "external":
        over["teacher.path"] = assets["other"]
    args = [
        f"model.path={assets['model']}", f"data.path={assets['data']}", f"logging.run_dir={tmp_path / 'run'}",
        "seed=3", "model.lora.r=4", "model.lora.alpha=8", "rollout.prompts_per_step=2", "rollout.n=2",
        "rollout.max_new_tokens=6", "rollout.temperature=1.0", "optim.lr=0.01", "optim.max_steps=3",
        "checkpoint.every=0", "logging.progress=false", "logging.sample_every=0", "data.max_prompt_len=256",
        "loss.clip_mode=none", "model.dtype=float32", "optim.max_tokens_per_microbatch=8192",
    ] + [f"{k}={v}" for k, v in over.items()]
    Trainer(load_config(None, args)).train()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = [(r["loss"], r["divergence"], r["grad_norm"]) for r in recs]
    if os.environ.get("OPSD_PRINT_PINNED"):
        print(f"\n    {case!r}: {got!r},")
    assert len(got) == 3
    want = PINNED[case]
    for step, (g, w) in enumerate(zip(got, want), start=1):
        for name, a, b in zip(("loss", "divergence", "grad_norm"), g, w):
            assert a == pytest.approx(b, rel=RTOL, abs=1e-12), f"{case} step {step} {name}: {a!r} != pinned {b!r}"
