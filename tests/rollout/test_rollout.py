"""HFEngine on tiny random models: determinism, log-prob correctness, stopping, padding, LoRA."""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import vllm_engine

from opsd.config import RolloutConfig
from opsd.cpu.buckets import bucket_width
from opsd.errors import UserError
from opsd.rollout import (
    Completion,
    HFEngine,
    RolloutEngine,
    SamplingParams,
    check_weight_coverage,
    weights_to_resend,
)
from opsd.rollout.base import EngineRun
from opsd.rollout.make import make_engine
from opsd.tiny import build_tiny_model

PROMPTS = ["What is 3 + 4?", "1", "Compute 12 * 7 and explain step by step.", "a b"]


@pytest.fixture
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p).input_ids for p in PROMPTS]


def _greedy(engine: HFEngine, prompts, max_new_tokens: int = 12, **kw) -> list[Completion]:
    return engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw))


def _teacher_forced_logprobs(model, prompt: list[int], resp: list[int], temperature: float, top_k: int = 0):
    ids = torch.tensor([prompt + resp])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(resp)[:, None]).squeeze(1)


def test_prompt_widths_in_buckets_change_no_token(tiny_model, tiny_tokenizer, prompts):
    """Where the CPU's bf16 attention keeps a kernel per length the engine left-pads prompts to a bucket
    width (the CPU plan's bucket_widths); the extra padding is masked, so the completions are the same.
    In float64 (u = 1.1e-16) the log-probs agree to 1e-9: only the order of a few sums over masked-out
    zeros and differently blocked products differs, far under that."""
    model = tiny_model.double()
    plain = HFEngine(model, tiny_tokenizer, batch_size=3)
    assert not plain.cpu_settings.bucket_widths  # float64 on a CPU
    wide = HFEngine(model, tiny_tokenizer, batch_size=3)
    wide.cpu_settings = replace(wide.cpu_settings, bucket_widths=True)
    longer = [(p * 16)[: 37 + 3 * i] for i, p in enumerate(prompts)]  # 37, 40, 43, ...
    first = max(len(p) for p in longer[:3])  # the engine's first batch: its three shortest prompts
    assert bucket_width(first) > first  # 43 -> 44: that batch is padded wider
    a, b = _greedy(plain, longer), _greedy(wide, longer)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-9)
    assert HFEngine(tiny_model.to(torch.bfloat16), tiny_tokenizer).cpu_settings.bucket_widths


def test_count_order_and_shapes(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_size=5)
    out = engine.generate(prompts, 3, SamplingParams(max_new_tokens=7, seed=0))
    assert len(out) == len(prompts) * 3
    assert [c.prompt_index for c in out] == [i for i in range(len(prompts)) for _ in range(3)]
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        assert len(c.token_ids) <= 7
        assert c.finish_reason in ("stop", "length")
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert all(0 <= t < len(tiny_tokenizer) for t in c.token_ids)


def test_seed_determinism_and_seeds_differ(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_size=3)
    params = SamplingParams(max_new_tokens=10, seed=123)
    a = engine.generate(prompts, 2, params)
    b = engine.generate(prompts, 2, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    c = engine.generate(prompts, 2, SamplingParams(max_new_tokens=10, seed=124))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # n samples of the same prompt are distinct draws, not copies
    assert a[0].token_ids != a[1].token_ids


def test_global_rng_untouched(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    engine.generate(prompts, 2, SamplingParams(max_new_tokens=5, seed=1))
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=5, seed=None))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 20)])
def test_logprobs_match_teacher_forced_forward(tiny_model, tiny_tokenizer, prompts, temperature, top_k):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_size=8)
    out = engine.generate(
        prompts, 2, SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=9, seed=3)
    )
    for c in out:
        ref = _teacher_forced_logprobs(tiny_model, prompts[c.prompt_index], c.token_ids, temperature, top_k)
        # fp32 (u32 = 6e-8), KV-cached decoding vs one full forward: logits |z| < 1 (H=64) move by a few
        # u32; log-softmax over V=512 (|lp| <= ~7) adds <= log2(V)*u32*7 = 4e-6. Measured 4.8e-7 (1 ulp).
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_top_p_keeps_sampled_tokens_inside_nucleus(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    out = engine.generate(prompts, 2, SamplingParams(top_p=1e-6, max_new_tokens=6, seed=0))
    greedy = _greedy(engine, prompts, max_new_tokens=6)
    # a vanishing nucleus keeps only the argmax token: greedy decoding with log-prob 0
    for c in out:
        assert c.token_ids == greedy[c.prompt_index].token_ids
        # exact: log_softmax of a row whose only finite entry is the kept token is 0 - log(1) = 0
        assert all(lp == 0.0 for lp in c.logprobs)


def test_greedy_logprobs_are_untempered(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    for c in _greedy(engine, prompts):
        ref = _teacher_forced_logprobs(tiny_model, prompts[c.prompt_index], c.token_ids, 1.0)
        # as in test_logprobs_match_teacher_forced_forward: measured 4.8e-7 against a 4e-6 worst case
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_batched_equals_per_prompt_under_greedy(tiny_model, tiny_tokenizer, prompts):
    """Left padding must not leak into attention or positions."""
    batched = _greedy(HFEngine(tiny_model, tiny_tokenizer, batch_size=8), prompts)
    single = _greedy(HFEngine(tiny_model, tiny_tokenizer, batch_size=1), prompts)
    assert len({len(p) for p in prompts}) > 1  # the test needs padding to happen
    for b, s in zip(batched, single):
        assert b.prompt_index == s.prompt_index
        assert b.token_ids == s.token_ids
        # fp32, padded batch vs batch of 1: the same sums in other matmul shapes, plus masked padding; as in
        # test_logprobs_match_teacher_forced_forward, <= 4e-6 at worst, measured 4.8e-7
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(s.logprobs), atol=1e-5, rtol=0)


def _first_new_token(tokens: list[int], start: int) -> tuple[int, int]:
    """(position, token) of the first token at index >= start not seen before it."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    pytest.skip("greedy continuation has no fresh token to stop on")


def test_stop_token_ids_stop_and_are_included(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    free = _greedy(engine, prompts[:1], max_new_tokens=12)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    pos, tok = _first_new_token(free.token_ids, 2)
    stopped = _greedy(engine, prompts[:1], max_new_tokens=12, stop_token_ids=[tok])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: pos + 1]
    assert stopped.token_ids[-1] == tok
    # exact: the same prompt alone in its batch, the same steps up to the stop (checked on seeds 1-5)
    assert stopped.logprobs == free.logprobs[: pos + 1]


def test_model_eos_stops(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    free = _greedy(engine, prompts[:1])[0]
    pos, tok = _first_new_token(free.token_ids, 3)
    # e.g. a chat model whose generation config lists an eos the tokenizer does not
    tiny_model.generation_config.eos_token_id = tok
    stopped = _greedy(engine, prompts[:1])[0]
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", free.token_ids[: pos + 1])


def test_stop_strings(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    free = _greedy(engine, prompts[:1], max_new_tokens=12)[0]
    # choose a stop string that is completed exactly by token k: the tail of token k's text
    for k in range(2, 12):
        text_k = tiny_tokenizer.decode(free.token_ids[: k + 1])
        prev = tiny_tokenizer.decode(free.token_ids[:k])
        if len(text_k) > len(prev) and text_k.startswith(prev):
            stop = text_k[len(prev) - 1 :] if prev else text_k
            if stop not in prev and stop.strip():
                break
    else:
        pytest.skip("no usable stop string in this continuation")
    stopped = _greedy(engine, prompts[:1], max_new_tokens=12, stop_strings=[stop])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]
    assert tiny_tokenizer.decode(stopped.token_ids).endswith(stop)


def test_rows_stop_independently_in_a_batch(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_size=8)
    free = _greedy(engine, prompts, max_new_tokens=10)
    pos, tok = _first_new_token(free[0].token_ids, 1)
    out = _greedy(engine, prompts, max_new_tokens=10, stop_token_ids=[tok])
    for f, o in zip(free, out):
        if tok in f.token_ids:
            cut = f.token_ids.index(tok) + 1
            assert (o.finish_reason, o.token_ids) == ("stop", f.token_ids[:cut])
        else:
            assert (o.finish_reason, o.token_ids) == ("length", f.token_ids)


def test_min_new_tokens_forces_length(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    free = _greedy(engine, prompts[:1], max_new_tokens=8)[0]
    tok = free.token_ids[0]
    out = _greedy(engine, prompts[:1], max_new_tokens=8, stop_token_ids=[tok], min_new_tokens=8)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and tok not in out.token_ids


def test_training_mode_restored(tiny_model, tiny_tokenizer, prompts):
    tiny_model.train()
    HFEngine(tiny_model, tiny_tokenizer).generate(prompts[:1], 1, SamplingParams(max_new_tokens=3, seed=0))
    assert tiny_model.training
    tiny_model.eval()
    HFEngine(tiny_model, tiny_tokenizer).generate(prompts[:1], 1, SamplingParams(max_new_tokens=3, seed=0))
    assert not tiny_model.training


def test_sees_trainer_updates_without_sync(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    before = _greedy(engine, prompts)
    with torch.no_grad():
        tiny_model.lm_head.weight.mul_(-1.0)  # an "optimizer step" that surely changes the argmax
    after = _greedy(engine, prompts)  # no sync_weights: the engine generates with the live parameters
    assert [c.token_ids for c in before] != [c.token_ids for c in after]


def test_peft_lora_model(tiny_model, tiny_tokenizer, prompts):
    peft = pytest.importorskip("peft")
    base_out = _greedy(HFEngine(tiny_model, tiny_tokenizer), prompts)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(tiny_model, cfg)
    engine = HFEngine(lora, tiny_tokenizer)
    out = _greedy(engine, prompts)  # LoRA B starts at zero: identical to the base model
    assert [c.token_ids for c in out] == [c.token_ids for c in base_out]
    sampled = engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=0))
    for c in sampled:
        ref = _teacher_forced_logprobs(lora, prompts[c.prompt_index], c.token_ids, 1.0)
        # as in test_logprobs_match_teacher_forced_forward (B = 0: measured exact here)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop_strings=[""]), "stop_strings"),
    ],
)
def test_bad_sampling_params(tiny_model, tiny_tokenizer, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HFEngine(tiny_model, tiny_tokenizer).generate(prompts, 1, SamplingParams(**kwargs))


def test_bad_prompts(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], 1, SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 10**6]], 1, SamplingParams())
    with pytest.raises(ValueError, match="n=0"):
        engine.generate([[1]], 0, SamplingParams())
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(tiny_model, tiny_tokenizer, batch_size=0)


def test_make_engine(tiny_model, tiny_tokenizer, prompts):
    engine = make_engine(RolloutConfig(engine="hf", batch_size=4), tiny_model, tiny_tokenizer)
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)
    assert engine.batch_size == 4 and engine.model is tiny_model
    before = _greedy(engine, prompts)
    engine.sleep()  # the HF engine shares the trainer's model: sleep and wake keep everything
    engine.wake()
    assert [c.token_ids for c in _greedy(engine, prompts)] == [c.token_ids for c in before]
    engine.close()
    with pytest.raises(UserError, match="allowed"):
        make_engine(RolloutConfig.model_construct(engine="tgi"), tiny_model, tiny_tokenizer)


def test_make_engine_builds_the_resolved_kind(tiny_model, tiny_tokenizer):
    """rollout.engine=auto is resolved once, by the trainer, and the kind passed in: the engine builder
    refuses to resolve it again, and refuses tensor parallelism where auto resolved to the HF engine."""
    auto = RolloutConfig(engine="auto", batch_size=4)
    engine = make_engine(auto, tiny_model, tiny_tokenizer, kind="hf")
    assert isinstance(engine, HFEngine)
    with pytest.raises(ValueError, match="resolve it first"):
        make_engine(auto, tiny_model, tiny_tokenizer)
    parallel = RolloutConfig(engine="auto", tensor_parallel_size=2)
    with pytest.raises(UserError, match="tensor_parallel_size > 1 needs rollout.engine=vllm"):
        make_engine(parallel, tiny_model, tiny_tokenizer, kind="hf")


@pytest.mark.smollm2
def test_smollm2_generates_from_chat_template(smollm2_path):
    from opsd.models import load_model, load_tokenizer

    tok = load_tokenizer(str(smollm2_path))
    model = load_model(str(smollm2_path))
    msgs = [{"role": "user", "content": "What is 2 + 3? Answer with a number."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = tok(ids, add_special_tokens=False).input_ids
    out = HFEngine(model, tok).generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=10))
    text = tok.decode(out[0].token_ids)
    assert "5" in text, text  # greedy SmolLM2 answers "2 + 3 = 5<|im_end|>"
    if out[0].finish_reason == "stop":
        assert out[0].token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


# ----------------------------------------------------------------------------------------------
# VLLMEngine against the small fake `vllm` of tests/helpers.py (installed by conftest's fake_vllm):
# call order and arguments. tests/rollout/test_vllm.py runs the same engine on the real vLLM (CPU build).


def test_vllm_context_holds_the_longest_generation_asked_of_it(fake_vllm, tiny_model, tiny_tokenizer):
    """The held-out evaluation generates on the rollout engine: a context sized for rollouts alone
    would refuse an evaluation prompt plus its longer answer."""
    from opsd.rollout.make import make_engine

    cfg = RolloutConfig(engine="vllm", batch_size=16, max_new_tokens=6)
    make_engine(cfg, tiny_model, tiny_tokenizer, EngineRun(seed=3, max_prompt_len=100, max_new_tokens=40))
    assert fake_vllm.llms[-1].kwargs["max_model_len"] == 140
    make_engine(cfg, tiny_model, tiny_tokenizer, EngineRun(seed=3, max_prompt_len=100))
    assert fake_vllm.llms[-1].kwargs["max_model_len"] == 106


def test_vllm_engine_arguments_and_start_order(fake_vllm, tiny_model, tiny_tokenizer):
    engine = vllm_engine(tiny_model, tiny_tokenizer)
    llm = fake_vllm.llms[0]
    assert isinstance(engine, RolloutEngine)
    kw = llm.kwargs
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["tensor_parallel_size"] == 1
    assert (kw["model"], kw["tokenizer"]) == (tiny_model.config._name_or_path,) * 2
    assert kw["dtype"] == "float32"  # "auto" follows the trainer's model
    assert (kw["max_model_len"], kw["max_num_seqs"], kw["seed"]) == (106, 16, 3)
    assert kw["enable_sleep_mode"] is True and kw["logprobs_mode"] == "processed_logprobs"
    # In-process engine core, on a CPU-capable default group created before vLLM could make one.
    assert llm.group_at_init == ("gloo", "0")
    # Start: build, read vLLM's parameter names, load the trainer's weights, drop cached prefixes.
    assert fake_vllm.log == [("LLM",), ("apply_model",), ("rpc", "reload_weights"), ("reset_prefix_cache",)]
    assert list(llm.loaded) == list(tiny_model.state_dict())
    for name, t in tiny_model.state_dict().items():
        assert torch.equal(llm.loaded[name], t)
    x = torch.ones(3, dtype=torch.float64)
    dist.all_reduce(x)  # what the trainer does with its CPU float64 counters
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_vllm_engine_config_overrides(fake_vllm, tiny_model, tiny_tokenizer):
    vllm_engine(
        tiny_model,
        tiny_tokenizer,
        vllm_dtype="bfloat16",
        max_model_len=64,
        vllm_sleep_level=0,
        vllm_kwargs={"enforce_eager": True},
    )
    kw = fake_vllm.llms[0].kwargs
    assert (kw["dtype"], kw["max_model_len"], kw["enable_sleep_mode"], kw["enforce_eager"]) == (
        "bfloat16",
        64,
        False,
        True,
    )


def test_vllm_generate_one_request_per_prompt_seeded_once(fake_vllm, tiny_model, tiny_tokenizer, prompts):
    engine = vllm_engine(tiny_model, tiny_tokenizer)
    llm = fake_vllm.llms[0]
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    params = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=6, stop_token_ids=[9], seed=11)
    a = engine.generate(prompts, 3, params)
    assert fake_vllm.log[-1] == ("generate", len(prompts))  # one request per prompt, n samples each
    sp = llm.last_params.kwargs
    assert "seed" not in sp  # no per-request seeds: vLLM samples the whole batch at once
    assert (sp["n"], sp["temperature"], sp["top_k"], sp["max_tokens"], sp["logprobs"]) == (3, 0.8, 5, 6, 0)
    assert set(sp["stop_token_ids"]) == {tiny_tokenizer.eos_token_id, 9}
    assert [c.prompt_index for c in a] == [i for i in range(len(prompts)) for _ in range(3)]
    assert all(c.logprobs == [-0.5] * len(c.token_ids) for c in a)
    assert a[0].token_ids != a[1].token_ids  # the n samples of a prompt are distinct draws
    assert [c.token_ids for c in engine.generate(prompts, 3, params)] == [c.token_ids for c in a]
    other = engine.generate(prompts, 3, replace(params, seed=12))
    assert [c.token_ids for c in other] != [c.token_ids for c in a]
    assert torch.equal(torch.get_rng_state(), states[0])  # the caller's RNG streams are untouched
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]


def test_vllm_sleep_level_2_always_reloads_at_wake(fake_vllm, tiny_model, tiny_tokenizer, prompts):
    engine = vllm_engine(tiny_model, tiny_tokenizer)  # level 2 is the default
    log = fake_vllm.log
    del log[:]
    engine.sleep()
    engine.wake()  # no sync_weights in between (a skipped step): the weights are reloaded anyway
    assert log == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights"),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]
    del log[:]
    engine.sleep()
    with torch.no_grad():
        tiny_model.lm_head.weight.add_(1.0)
    engine.sync_weights(tiny_model)  # asleep: nothing moves until wake
    assert log == [("sleep", 2)]
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=2, seed=0))  # wakes by itself
    assert log[1:4] == [("wake_up", ["weights"]), ("rpc", "reload_weights"), ("reset_prefix_cache",)]
    assert torch.equal(fake_vllm.llms[0].loaded["lm_head.weight"], tiny_model.lm_head.weight)


def test_vllm_sleep_level_1_reloads_only_after_a_sync(fake_vllm, tiny_model, tiny_tokenizer):
    engine = vllm_engine(tiny_model, tiny_tokenizer, vllm_sleep_level=1)
    log = fake_vllm.log
    del log[:]
    engine.sleep()
    engine.wake()
    assert log == [("sleep", 1), ("wake_up", None)]
    del log[:]
    engine.sleep()
    engine.sync_weights(tiny_model)
    engine.wake()
    assert [e[0] for e in log] == ["sleep", "wake_up", "rpc", "reset_prefix_cache", "wake_up"]


def test_vllm_awake_sync_loads_at_once_and_level_0_never_sleeps(fake_vllm, tiny_model, tiny_tokenizer):
    engine = vllm_engine(tiny_model, tiny_tokenizer, vllm_sleep_level=0)
    del fake_vllm.log[:]
    engine.sleep()
    engine.wake()
    engine.sync_weights(tiny_model)
    assert fake_vllm.log == [("rpc", "reload_weights"), ("reset_prefix_cache",)]


def test_vllm_lora_sync_sends_merged_base_weights(fake_vllm, tiny_model, tiny_tokenizer):
    peft = pytest.importorskip("peft")
    names = list(tiny_model.state_dict())
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(tiny_model, cfg)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    vllm_engine(lora, tiny_tokenizer)
    loaded = fake_vllm.llms[0].loaded
    assert list(loaded) == names
    for k, v in lora.merge_and_unload().state_dict().items():
        # exact: both add the same get_delta_weight() to the same base weight
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)


def test_vllm_lora_resync_sends_only_the_layers_training_changes(fake_vllm, tiny_model, tiny_tokenizer):
    """After a whole load, a sync of the same LoRA model resends only its adapted layers, whole: a q_proj
    adapter resends k_proj and v_proj (vLLM packs the three into qkv_proj and rebuilds it from all
    three); the embedding, norms and MLP are left as vLLM holds them. The values are still exactly the
    merged model's. Another model object, or a wake after a level-2 sleep, loads everything again."""
    peft = pytest.importorskip("peft")
    names = list(tiny_model.state_dict())
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(tiny_model, cfg)
    engine = vllm_engine(lora, tiny_tokenizer)
    llm = fake_vllm.llms[0]
    assert llm.syncs == [names]
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    engine.sync_weights(lora)
    attn = [n for n in names if any(f".{m}." in n for m in ("q_proj", "k_proj", "v_proj"))]
    assert llm.syncs[1] == attn and len(attn) == 3 * tiny_model.config.num_hidden_layers
    engine.sleep()  # level 2 discards vLLM's weights
    engine.wake()
    assert llm.syncs[2] == names
    engine.sync_weights(build_tiny_model(tiny_tokenizer, seed=1).requires_grad_(False))
    assert llm.syncs[3] == names  # not the model vLLM last loaded whole: everything
    engine.sync_weights(lora)
    assert llm.syncs[4] == names
    for k, v in lora.merge_and_unload().state_dict().items():
        torch.testing.assert_close(llm.loaded[k], v, rtol=0, atol=0)  # exact: the same additions


def test_weights_to_resend_keeps_adapted_layers_whole():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    layer = "model.layers.0"
    vllm_params = [
        "model.embed_tokens.weight",
        f"{layer}.self_attn.qkv_proj.weight",
        f"{layer}.self_attn.qkv_proj.bias",
        f"{layer}.self_attn.o_proj.weight",
        f"{layer}.mlp.gate_up_proj.weight",
        f"{layer}.input_layernorm.weight",
    ]
    qkv = ("q_proj", "k_proj", "v_proj")
    attn = [f"{layer}.self_attn.{m}.{leaf}" for leaf in ("weight", "bias") for m in qkv]
    mlp = [f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight"]
    names = ["model.embed_tokens.weight", *attn, f"{layer}.self_attn.o_proj.weight", *mlp]
    # lm_head: tied, so vLLM has no parameter of that name
    names += [f"{layer}.input_layernorm.weight", "lm_head.weight"]
    changed = {f"{layer}.self_attn.q_proj.weight", f"{layer}.mlp.up_proj.weight"}
    fixed = set(names) - changed
    assert weights_to_resend(names, fixed, vllm_params, packed) == attn + mlp
    assert weights_to_resend(names, set(), vllm_params, packed) == names
    assert weights_to_resend(names, set(names), vllm_params, packed) == []


def test_vllm_coverage_check_refuses_a_partial_sync(fake_vllm, monkeypatch, tiny_model, tiny_tokenizer):
    import opsd.rollout.vllm as rollout

    engine = vllm_engine(tiny_model, tiny_tokenizer)
    full = rollout.merged_weight_names
    gap = "model.layers.1.self_attn.k_proj.weight"
    monkeypatch.setattr(rollout, "merged_weight_names", lambda m: [k for k in full(m) if k != gap])
    del fake_vllm.log[:]
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight \(needs .*k_proj"):
        engine.sync_weights(tiny_model)
    assert fake_vllm.log == []  # refused before anything was written


def test_check_weight_coverage():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    vllm_params = ["model.layers.0.self_attn.qkv_proj.weight", "lm_head.weight"]
    hf = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "lm_head.weight",
        "extra.weight",
    ]
    check_weight_coverage(hf, vllm_params, packed)
    with pytest.raises(
        RuntimeError, match=r"1 of vLLM's parameters.*lm_head\.weight \(needs lm_head\.weight\)"
    ):
        check_weight_coverage(hf[:3], vllm_params, packed)


def test_vllm_close_frees_the_group_it_created(fake_vllm, tiny_model, tiny_tokenizer):
    engine = vllm_engine(tiny_model, tiny_tokenizer)
    del fake_vllm.log[:]
    engine.close()
    assert fake_vllm.log == [("shutdown",), ("destroy_model_parallel",), ("destroy_distributed_environment",)]
    assert not dist.is_initialized()
    engine.close()  # idempotent
    vllm_engine(tiny_model, tiny_tokenizer).close()  # e.g. `opsd eval` over several models


def test_vllm_tensor_parallel_needs_torchrun(fake_vllm, tiny_model, tiny_tokenizer):
    with pytest.raises(UserError, match="tensor_parallel_size=2 needs torchrun"):
        vllm_engine(tiny_model, tiny_tokenizer, tensor_parallel_size=2)


def test_vllm_missing_is_a_clear_error(monkeypatch, tiny_model, tiny_tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(UserError, match=r"pip install opsd\[vllm\]"):
        vllm_engine(tiny_model, tiny_tokenizer)


def test_cpu_kv_cache_holds_the_batch_at_full_length():
    """On a CPU vLLM would take a share of the RAM for its cache; the engine asks for what batch_size
    sequences of max_model_len tokens need: K and V per layer, KV head and head size, in whole blocks."""
    from transformers import LlamaConfig

    from opsd.cpu.kv import cpu_kv_cache_bytes

    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    # head size 64 / 4 = 16; per token 2 (K, V) x 2 layers x 2 KV heads x 16 x 4 bytes = 512;
    # 300 tokens -> 2 blocks of 256, plus one: 768 tokens per sequence, 3 sequences
    assert cpu_kv_cache_bytes(cfg, "float32", 3, 300) == 512 * 768 * 3
    assert cpu_kv_cache_bytes(cfg, "bfloat16", 3, 300) == 256 * 768 * 3
    cfg.head_dim = 32  # an explicit head size wins over hidden_size / heads
    assert cpu_kv_cache_bytes(cfg, "float32", 1, 256) == 1024 * 512
    assert cpu_kv_cache_bytes(cfg, "float32", 3, None) is None  # no length: vLLM sizes it itself
    assert cpu_kv_cache_bytes(None, "float32", 3, 300) is None
