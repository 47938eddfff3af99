"""opsd.distributed on CPU: gloo process groups the tests spawn themselves, FSDP2 on a tiny model.

Each spawned test pays for two fresh interpreters importing torch and transformers, so one spawn
checks several things. Workers set torchrun's variables and go through ``init_distributed``. Here: two
ranks (and HSDP's two by two) step as one rank does on the union batch, the distributed checkpoint
reshards between one and two ranks, and one process without torchrun is unchanged.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import spawn

from opsd import checkpoint as C
from opsd import distributed as D
from opsd import parallel as P
from opsd.data import batching
from opsd.errors import UserError
from opsd.tiny import build_tiny_model, build_tiny_tokenizer

SPEC_KW = {"mode": "jsd", "beta": 0.5}
LR = 1e-2


# --- harness (the gloo ranks themselves: helpers.spawn) -----------------------------------------


@pytest.fixture
def no_torchrun(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


# --- a tiny model, data and one OPSD step (shared by the reference and the sharded run) ------------


def _model(variant: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``lora``: adapters on q/v with gradient checkpointing; ``full``: every weight, head tied to the
    embedding."""
    from opsd.models import apply_lora, enable_gradient_checkpointing

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=2, seed=seed).to(dtype)
    if variant == "full":
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
        return model.train()
    enable_gradient_checkpointing(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        return apply_lora(
            model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], gradient_checkpointing=True
        )


def _fresh(variant: str) -> torch.nn.Module:
    """A model whose trainable weights differ from ``_model(variant)``'s (a load must overwrite them);
    LoRA keeps the same frozen base, which checkpoints do not hold."""
    model = _model(variant, seed=0 if variant == "lora" else 9)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def _samples(step: int, rank: int, n: int) -> list:
    from opsd.data.batching import make_sample

    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for i in range(n):
        p, r = int(torch.randint(3, 7, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g))
        ids = torch.randint(5, 500, (p + 4 + r,), generator=g).tolist()
        out.append(make_sample(ids[:p], ids[p : p + 4], ids[p + 4 :], i, "stop"))
    return out


def _microbatches(samples: list, global_tokens: float, global_seqs: float) -> list:
    from opsd.data.batching import TokenWeights, make_microbatches

    weights = TokenWeights("token", global_tokens, global_seqs)
    return make_microbatches(samples, max_tokens=1, pad_id=0, weights=weights, device="cpu")


def _loss(sh, sw, th, tw, weights, targets):
    from opsd.loss import DistillSpec, fused_linear_distill

    return fused_linear_distill(sh, sw, th, tw, weights, targets, DistillSpec(**SPEC_KW))[0]


def _accumulate(model, teacher, mbs: list) -> None:
    """The trainer's micro-batch loop (opsd.microbatch.forward_backward) with the fixed teacher: LoRA's base
    with the adapter off (``teacher`` None), or the given frozen network."""
    from opsd.loss import LossStats
    from opsd.microbatch import forward_backward
    from opsd.teacher import Teacher

    fixed = (
        Teacher("fixed", model, lora=True)
        if teacher is None
        else Teacher("external", model, lora=False, external=teacher)
    )

    def loss_fn(s_hidden, t_hidden, t_head, mb, adv):
        return _loss(
            s_hidden, P.full_head_weight(model), t_hidden, t_head, mb.weights, mb.targets
        ), LossStats()

    forward_backward(model, fixed, mbs, loss_fn)


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _full_grads(model) -> dict:
    """Every trainable parameter's whole gradient (collective when sharded)."""
    from torch.distributed.tensor import DTensor

    return {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _step(model, teacher, opt, mbs: list, grads: list | None = None) -> float:
    """One optimizer step; returns the gradient norm (no clipping at these norms) and appends the
    gradients to ``grads`` if given."""
    _accumulate(model, teacher, mbs)
    if grads is not None:
        grads.append(_full_grads(model))
    norm = P.clip_grad_norm(_trainable(model), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


# per step: how many samples each rank draws (uneven counts, then a rank with none)
PLAN = [(2, 1), (2, 0)]
HSDP_PLAN = [(2, 1, 1, 0), (0, 2, 1, 1)]


def _rank_batches(step: int, rank: int, counts: tuple[int, ...]) -> list:
    """This rank's micro-batches for ``step``, weighted by the global (all-rank) token count."""
    mine = _samples(step, rank, counts[rank])
    totals = D.all_reduce_sum(
        torch.tensor([sum(s.response_len for s in mine), len(mine)], dtype=torch.float64)
    )
    return batching.pad_microbatches(_microbatches(mine, *totals.tolist()), pad_id=0, device="cpu")


def _union_batches(step: int, counts: tuple[int, ...]) -> list:
    union = [s for r, n in enumerate(counts) for s in _samples(step, r, n)]
    return _microbatches(union, sum(s.response_len for s in union), len(union))


def _run_equivalence(d: D.Dist, variant: str, plan: list[tuple[int, ...]]) -> None:
    model = _model(variant)
    teacher = None
    if variant == "full":
        teacher = copy.deepcopy(model).requires_grad_(False).eval()
        P.shard_model(teacher, d.mesh, param_dtype=None)
    P.shard_model(model, d.mesh, param_dtype=None)
    opt = _optimizer(model)
    norms, grads = [], []
    for step, counts in enumerate(plan):
        mbs = _rank_batches(step, d.rank, counts)
        assert len(mbs) == max(counts), "padding did not bring every rank to the same count"
        norms.append(_step(model, teacher, opt, mbs, grads))
    got = C.gather_full_state_dict(model)
    got_teacher = C.gather_full_state_dict(teacher) if teacher is not None else None
    if d.rank != 0:
        return
    ref = _model(variant)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_teacher = None
    if variant == "full":
        ref_teacher = copy.deepcopy(ref).requires_grad_(False).eval()
    ref_opt = _optimizer(ref)
    ref_grads: list = []
    ref_norms = [
        _step(ref, ref_teacher, ref_opt, _union_batches(step, counts), ref_grads)
        for step, counts in enumerate(plan)
    ]
    if variant == "full":  # the tied head's gradient (the loss's and the embedding's, summed over ranks)
        assert ref.lm_head.weight is ref.model.embed_tokens.weight and "model.embed_tokens.weight" in grads[0]
    # fp32 (u32 = 6e-8): the per-sample gradients are the same; ranks, micro-batches and replicas only sum
    # the <= 4 samples of a step in another order: <= 3*u32 of their summed size, ~2e-7 of max|g| with
    # some cancellation; measured 0 on 2 ranks, 1.2e-7 of max|g| on 2x2 (HSDP). 1e-6 leaves 8x.
    for step, (g, w) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == w.keys()
        for k in w:
            scale = float(w[k].abs().max())
            torch.testing.assert_close(
                g[k],
                w[k],
                rtol=1e-6,
                atol=1e-6 * scale,
                msg=lambda m, k=k, step=step: f"{variant} step {step} grad {k}: {m}",
            )
    want = ref.state_dict()
    assert got.keys() == want.keys()
    changed = 0
    # Parameters: AdamW scales each update to ~lr = 1e-2, so a 1e-6 relative gradient difference moves a
    # parameter by ~lr*1e-6 = 1e-8, and p + update rounds to ~u32*|p| (|p| <= 1.02): measured <= 1.9e-8
    # (HSDP); rtol 1e-6 and atol 1e-7 leave 6x.
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{variant} {k}: {m}"
        )
        changed += not torch.equal(want[k], initial[k])
    assert changed >= (2 if variant == "full" else 4), "the step changed too few tensors to test anything"
    # the norm is a sum of squares over sharded pieces: a few u32 relative from regrouping plus the
    # gradients' ~1e-7; measured <= 1.9e-7 relative (HSDP), 1e-7 (2 ranks, full)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
    if got_teacher is not None:  # the fixed teacher copy never moved
        for k, v in got_teacher.items():
            assert torch.equal(v, initial[k]), k


def _bf16_lora_step(d: D.Dist) -> None:
    """bf16 base weights, fp32 adapters (peft's default), bf16 compute, fp32 reduction: gradients reach
    the fp32 adapters although the first forward of the step is the adapter-disabled teacher's."""
    model = P.shard_model(_model("lora", dtype=torch.bfloat16), d.mesh, param_dtype=torch.bfloat16)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())
    before = {n: p.detach().full_tensor().clone() for n, p in lora.items()}
    _accumulate(model, None, _rank_batches(0, d.rank, PLAN[0]))
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora.values())
    norm = float(P.clip_grad_norm(_trainable(model), 1e-6))  # clipping the sharded gradients
    assert 1e-6 < norm < float("inf")
    # torch scales by max_norm / (norm + 1e-6), so the clipped norm falls 1e-6 * 1e-6 / norm short of 1e-6:
    # 7.7e-10 at this norm (1.3e-3; float32 rounding adds ~1e-13). 1e-8 (1%) holds for norms >= 1e-4.
    assert abs(float(P.clip_grad_norm(_trainable(model), float("inf"))) - 1e-6) < 1e-8
    _optimizer(model).step()
    assert any(not torch.equal(p.detach().full_tensor(), before[n]) for n, p in lora.items())
    # Sampling through the sharded model: ranks stop at different lengths, synced_gpus keeps the
    # all-gathers matched.
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=2 + 3 * d.rank,
            synced_gpus=True,
            pad_token_id=0,
        )
    assert out.shape[1] <= 4 + 2 + 3 * d.rank


def _equivalence_worker(d: D.Dist) -> None:
    for variant in ("lora", "full"):
        _run_equivalence(d, variant, PLAN)
    _bf16_lora_step(d)


def _hsdp_worker(d: D.Dist) -> None:
    assert d.mesh.mesh_dim_names == ("replicate", "shard") and d.mesh.shape == (2, 2)
    for variant in ("lora", "full"):
        _run_equivalence(d, variant, HSDP_PLAN)


@pytest.mark.slow
def test_two_rank_fsdp_steps_equal_one_rank_on_the_union_batch():
    """LoRA (+ gradient checkpointing) and full fine-tuning with a tied head and a sharded frozen teacher:
    two AdamW steps on 2 ranks, with uneven micro-batch counts and then a rank with no samples, give the
    parameters and gradient norms of 1 process on the union batches (fp32, 1e-6 relative). Then a bf16
    LoRA step runs and samples through the sharded model."""
    spawn(_equivalence_worker)


@pytest.mark.slow
def test_hsdp_two_by_two_steps_equal_one_rank_on_the_union_batch():
    """4 ranks as 2 replicas x 2 shards (HSDP): gradients are summed over both mesh dimensions."""
    spawn(_hsdp_worker, world=4, replicate=2)


# --- distributed checkpoints: 1 -> 2 -> 2 and 2 -> 1 ------------------------------------------------


def _full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if not P.is_sharded(model):
        return {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": get_state_dict(model, opt)[1],
        }
    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optim": o}


def _assert_same_state(got: dict, want: dict) -> None:
    # exact: loading copies the saved bits, whatever the sharding
    torch.testing.assert_close(got["model"], want["model"], rtol=0, atol=0)
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys() and want["optim"]["state"]
    torch.testing.assert_close(got["optim"]["state"], want["optim"]["state"], rtol=0, atol=0)


def _dcp_worker(d: D.Dist, root: str) -> None:
    from opsd.checkpoint import rng_state

    root_p = Path(root)
    for variant in ("lora", "full"):
        # 1 -> 2: a checkpoint written by one process without a process group loads on two ranks.
        model = _fresh(variant)
        P.shard_model(model, d.mesh, param_dtype=None)
        opt = _optimizer(model)
        loaded = C.load_distributed(root_p / variant / "one", model, opt)
        assert loaded.saved_world_size == 1 and loaded.shared_state["step"] == 1
        assert (loaded.rank_state or {}).get("rank") == (0 if d.rank == 0 else None)
        state = _full_state(model, opt)
        if d.rank == 0:
            _assert_same_state(state, torch.load(root_p / variant / "one.pt", weights_only=True))

        _step(
            model,
            None if variant == "lora" else _frozen_copy(d, variant),
            opt,
            _rank_batches(1, d.rank, PLAN[0]),
        )
        C.save_distributed(
            root_p / variant / "two",
            model,
            opt,
            {"rank": d.rank, "rng": rng_state()},
            {"step": 2, "cursor": {"epoch": 0, "pos": [1, 2]}},
        )
        state = _full_state(model, opt)
        if d.rank == 0:
            torch.save(state, root_p / variant / "two.pt")

        # 2 -> 2, into a fresh model and optimizer.
        model = _fresh(variant)
        P.shard_model(model, d.mesh, param_dtype=None)
        opt = _optimizer(model)
        loaded = C.load_distributed(root_p / variant / "two", model, opt)
        assert loaded.rank_state["rank"] == d.rank and loaded.saved_world_size == 2
        got = _full_state(model, opt)
        if d.rank == 0:
            _assert_same_state(got, state)

    # Full weights for an export (rank 0), for every rank, and streamed one tensor at a time.
    everywhere = C.gather_full_state_dict(model, all_ranks=True)
    streamed = dict(C.iter_full_tensors(model))
    # exact: the same shards gathered three ways
    torch.testing.assert_close(streamed, everywhere, rtol=0, atol=0)
    on_rank0 = C.gather_full_state_dict(model)
    if d.rank == 0:
        torch.testing.assert_close(on_rank0, {k: v.cpu() for k, v in everywhere.items()}, rtol=0, atol=0)
        assert "lm_head.weight" in on_rank0
    else:
        assert on_rank0 == {}

    # A failing export on rank 0 fails the save on every rank and leaves no checkpoint behind.
    def export(path: Path) -> None:
        raise OSError("disk full while exporting")

    with pytest.raises((OSError, D.PeerError), match="disk full while exporting"):
        C.save_distributed(root_p / "failed", model, opt, {}, {"step": 3}, export=export)
    assert not (root_p / "failed").exists()
    assert d.rank != 0 or not (root_p / ".tmp-failed").exists()  # rank 0 removes it as it raises


def _frozen_copy(d: D.Dist, variant: str):
    teacher = _model(variant).requires_grad_(False).eval()
    return P.shard_model(teacher, d.mesh, param_dtype=None)


@pytest.mark.slow
def test_distributed_checkpoint_reshards_between_one_and_two_ranks(tmp_path, no_torchrun):
    """DCP save by 1 process (no process group) -> load on 2 ranks -> step -> save on 2 -> load on 2 and
    on 1: identical parameters and AdamW state; per-rank state goes back to its rank; an export error
    on rank 0 fails the save everywhere and commits nothing."""
    from opsd.checkpoint import rng_state

    for variant in ("lora", "full"):
        model = _model(variant)
        opt = _optimizer(model)
        _step(
            model,
            None if variant == "lora" else _model(variant).requires_grad_(False),
            opt,
            _union_batches(0, PLAN[0]),
        )
        C.save_distributed(
            tmp_path / variant / "one", model, opt, {"rank": 0, "rng": rng_state()}, {"step": 1}
        )
        torch.save(_full_state(model, opt), tmp_path / variant / "one.pt")
        assert not any(p.name.startswith(".tmp-") for p in (tmp_path / variant).iterdir())

    spawn(_dcp_worker, str(tmp_path))

    for variant in ("lora", "full"):  # 2 -> 1
        model = _fresh(variant)
        opt = _optimizer(model)
        loaded = C.load_distributed(tmp_path / variant / "two", model, opt)
        assert loaded.rank_state["rank"] == 0 and loaded.shared_state["cursor"] == {"epoch": 0, "pos": [1, 2]}
        _assert_same_state(
            _full_state(model, opt), torch.load(tmp_path / variant / "two.pt", weights_only=True)
        )


def test_one_process_without_torchrun_is_unchanged(no_torchrun, tiny_tokenizer):
    d = D.init_distributed("cpu")
    assert (d.rank, d.world_size, d.is_main, d.mesh, d.device) == (0, 1, True, None, torch.device("cpu"))
    assert not torch.distributed.is_initialized()
    assert D.agree_count(4) == 4 and D.any_rank(True) and not D.any_rank(False)
    t = torch.tensor([2.0])
    assert D.all_reduce_sum(t) is t and t.item() == 2.0
    with pytest.raises(UserError, match="bad key"):
        D.run_setup(lambda: (_ for _ in ()).throw(UserError("bad key")))

    from opsd.models import final_hidden, head_weight

    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1)
    ids, mask, pos = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([1])
    assert torch.equal(P.forward_hidden(model, ids, mask, pos), final_hidden(model, ids, mask, pos))
    assert P.full_head_weight(model) is head_weight(model)


def test_checkpoint_extra_state_must_be_plain_data(tmp_path, no_torchrun, tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1)
    with pytest.raises(TypeError, match="shared_state must hold only tensors and plain data"):
        C.save_distributed(tmp_path / "step_000001", model, None, {}, {"bad": object()})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="not a distributed checkpoint"):
        C.load_distributed(tmp_path / "missing", model, None)
