"""`model.compile`: the decoder layers run compiled for the teacher and student passes, the numbers are
the eager run's, generation stays eager, and the settings it cannot serve are one-line errors.

One compiled run of the tiny model: inductor builds its C++ kernels at the first step (tens of
seconds on 2 cores)."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import build_assets, make_cfg

from opsd import Trainer, models
from opsd.devices import check_compiler
from opsd.errors import UserError
from opsd.models import PLAIN_RMSNORMS


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return build_assets(tmp_path_factory.mktemp("compile"))


def _has_cxx() -> bool:
    """The trainer's own compiler check (opsd.devices.check_compiler), as a skip condition."""
    try:
        check_compiler(torch.device("cpu"))
    except UserError:
        return False
    return True


HAS_CXX = _has_cxx()
# ATEN_CPU_CAPABILITY lowers ATen's kernels to reproduce another CPU's rounding; inductor's compiled
# layers under it computed wrong numbers on an AVX512 machine (NaN, or a loss 60x the eager one,
# before and after opsd's CPU room moved), a torch matter outside opsd: compiled runs are checked on
# the machine's own kernels.
LOWERED_KERNELS = bool(__import__("os").environ.get("ATEN_CPU_CAPABILITY"))


@pytest.mark.skipif(not HAS_CXX, reason="inductor needs a C++ compiler on the CPU")
@pytest.mark.skipif(
    LOWERED_KERNELS, reason="ATEN_CPU_CAPABILITY set: inductor's code for it is checked natively"
)
def test_compiled_layers_train_like_eager_ones(assets, tmp_path, monkeypatch):
    """Step 1 of a compiled run against an eager one: the same rollouts (generation is eager and the
    weights are the initial ones in both), so the loss and gradient norm differ only by the compiled
    kernels' float32 rounding. Error model: inductor fuses elementwise work and may sum the norms'
    and softmax's reductions in another order, a few float32 roundings (2^-24 relative) per
    operator; over the tiny model's 2 layers, forward and backward, that is below 1e-5 relative of
    the gradient norm, and 1e-4 is held. The loss is a divergence near zero (~1e-4), a sum of
    p log(p / s) terms whose log-probabilities carry those roundings: its absolute error is about
    2^-24 times the entropy (a few nats) per token, so 1e-6 absolute is added to its bound (a
    gradient-checkpointed run of this test's setting differed by 5e-9)."""
    generate_stances = []
    from opsd import rollout

    real_generate = rollout.HFEngine._generate_batch

    def spy(self, *args, **kwargs):
        generate_stances.append(torch._dynamo.eval_frame._stance.stance)  # torch has no public getter
        return real_generate(self, *args, **kwargs)

    over = {"optim.max_steps": 1, "rollout.max_new_tokens": 4, "checkpoint.enabled": "false"}
    eager = Trainer(make_cfg(assets, tmp_path / "eager", **over)).train()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(rollout.HFEngine, "_generate_batch", spy)
    tr = Trainer(make_cfg(assets, tmp_path / "compiled", **{**over, "model.compile": "true"}))
    layers = models.base_model(tr.run.model).get_decoder().layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert models.base_model(tr.run.model).config._attn_implementation == "sdpa"  # compiled rows stay batched
    norms = [m for m in tr.run.model.modules() if type(m).__name__ in PLAIN_RMSNORMS]
    assert norms and not any("forward" in m.__dict__ for m in norms)  # inductor fuses transformers' own
    compiled = tr.train()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # something did compile
    assert generate_stances and set(generate_stances) == {"force_eager"}  # decoding runs eager
    for key, floor in (("loss", 1e-6), ("grad_norm", 0.0)):
        a, b = eager[0][key], compiled[0][key]
        assert abs(a - b) <= 1e-4 * abs(a) + floor, (key, a, b)


def test_uncompiled_decoding_leaves_the_compiler_stance_alone(tiny_model, tiny_tokenizer, monkeypatch):
    """The stance is process-wide (and its restore is not safe across threads): only a model with
    compiled layers has its decoding forced eager (the case above)."""
    from opsd.rollout import HFEngine, SamplingParams

    def refuse(*args, **kwargs):
        raise AssertionError("set_stance called for a model with nothing compiled")

    monkeypatch.setattr(torch.compiler, "set_stance", refuse)
    prompts = [tiny_tokenizer.encode("What is 1 + 2?"), tiny_tokenizer.encode("Name a colour.")]
    comps = HFEngine(tiny_model, tiny_tokenizer).generate(
        prompts, 1, SamplingParams(max_new_tokens=3, seed=0)
    )
    assert len(comps) == 2


@pytest.mark.skipif(not HAS_CXX, reason="inductor needs a C++ compiler on the CPU")
def test_compiled_lora_layers_share_their_code():
    """Every decoder layer runs the same code, peft's LoRA layers included: dynamo compiles it for the
    first layer (whose input needs no gradient) and once more for the others, whatever their number
    or the sequence length. A per-module forward that dynamo guards by identity (a
    ``functools.partial``) would recompile it layer after layer until dynamo's recompile limit sent
    the remaining layers back to eager."""
    from torch._dynamo.utils import counters

    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    layers = torch._dynamo.config.recompile_limit + 2
    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=layers)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = models.apply_lora(
        model, r=4, alpha=8, dropout=0.0, target_modules=targets, gradient_checkpointing=False
    )
    assert models.compile_layers(lora) == layers
    torch._dynamo.reset()
    counters.clear()
    for length in (7, 12):
        ids = torch.randint(5, 100, (1, length), generator=torch.Generator().manual_seed(length))
        lora(input_ids=ids, use_cache=False).logits.square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 2


def test_a_model_without_a_layer_list_is_one_line():
    class Decoder(torch.nn.Module):
        pass

    class Model(torch.nn.Module):
        def get_decoder(self):
            return Decoder()

    with pytest.raises(UserError, match="no decoder `layers` list"):
        models.compile_layers(Model())


def test_no_compiler_is_one_line(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="needs a C\\+\\+ compiler"):
        check_compiler(torch.device("cpu"))
    check_compiler(torch.device("meta"))  # not a CPU: nothing to build here
