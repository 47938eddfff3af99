"""HFEngine on tiny random models: determinism, log-prob correctness, stopping, padding, LoRA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from opsd.rollout import Completion, HFEngine, SamplingParams, make_engine

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
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_top_p_keeps_sampled_tokens_inside_nucleus(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    out = engine.generate(prompts, 2, SamplingParams(top_p=1e-6, max_new_tokens=6, seed=0))
    greedy = _greedy(engine, prompts, max_new_tokens=6)
    # a vanishing nucleus keeps only the argmax token: greedy decoding with log-prob 0
    for c in out:
        assert c.token_ids == greedy[c.prompt_index].token_ids
        assert all(abs(lp) < 1e-5 for lp in c.logprobs)


def test_greedy_logprobs_are_untempered(tiny_model, tiny_tokenizer, prompts):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    for c in _greedy(engine, prompts):
        ref = _teacher_forced_logprobs(tiny_model, prompts[c.prompt_index], c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_batched_equals_per_prompt_under_greedy(tiny_model, tiny_tokenizer, prompts):
    """Left padding must not leak into attention or positions."""
    batched = _greedy(HFEngine(tiny_model, tiny_tokenizer, batch_size=8), prompts)
    single = _greedy(HFEngine(tiny_model, tiny_tokenizer, batch_size=1), prompts)
    assert len({len(p) for p in prompts}) > 1  # the test needs padding to happen
    for b, s in zip(batched, single):
        assert b.prompt_index == s.prompt_index
        assert b.token_ids == s.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)


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
    assert stopped.logprobs == pytest.approx(free.logprobs[: pos + 1], abs=1e-5)


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
    engine.sync_weights(tiny_model)
    after = _greedy(engine, prompts)
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
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_peft_merged_state_dict_matches_merge_and_unload(tiny_model, tiny_tokenizer):
    """What VLLMEngine.sync_weights ships for LoRA: base names, deltas folded in, model untouched."""
    peft = pytest.importorskip("peft")
    from opsd.rollout import peft_merged_state_dict

    names = set(tiny_model.state_dict())
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(tiny_model, cfg)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    merged = peft_merged_state_dict(lora)
    assert set(merged) == names
    assert all(torch.equal(v, before[k]) for k, v in lora.state_dict().items())  # out of place
    reference = lora.merge_and_unload().state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )


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


def test_make_engine(tiny_model, tiny_tokenizer):
    engine = make_engine("hf", tiny_model, tiny_tokenizer, batch_size=4)
    assert isinstance(engine, HFEngine) and engine.batch_size == 4
    engine.sleep()
    engine.wake()
    with pytest.raises(ValueError, match="allowed"):
        make_engine("tgi", tiny_model, tiny_tokenizer)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_missing_is_a_clear_error(tiny_model, tiny_tokenizer):
    with pytest.raises(ImportError, match=r"pip install opsd\[vllm\]"):
        make_engine("vllm", tiny_model, tiny_tokenizer)


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


def _vllm_ready() -> bool:
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.mark.vllm
@pytest.mark.gpu
@pytest.mark.smollm2
@pytest.mark.skipif(not _vllm_ready(), reason="needs vLLM and a CUDA GPU")
def test_vllm_engine_matches_hf_and_syncs(smollm2_path):
    from opsd.models import load_model, load_tokenizer
    from opsd.rollout import VLLMEngine

    tok = load_tokenizer(str(smollm2_path))
    model = load_model(str(smollm2_path), device="cuda")
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)).input_ids
    engine = VLLMEngine(model, tok, model_path=str(smollm2_path), gpu_memory_utilization=0.2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    v = engine.generate([prompt], 1, greedy)[0]
    # vLLM runs bf16: its greedy tokens must be (near-)argmax under the fp32 HF model
    ref = _teacher_forced_logprobs(model.cpu(), prompt, v.token_ids, 1.0)
    with torch.no_grad():
        ids = torch.tensor([prompt + v.token_ids])
        best = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1).max(-1).values
    assert bool((ref > best - 0.5).all()), (ref, best)
    model.cuda()
    sampled = engine.generate([prompt, prompt], 3, SamplingParams(max_new_tokens=8, seed=0))
    assert [c.prompt_index for c in sampled] == [0, 0, 0, 1, 1, 1]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in sampled)
    again = engine.generate([prompt, prompt], 3, SamplingParams(max_new_tokens=8, seed=0))
    assert [c.token_ids for c in again] == [c.token_ids for c in sampled]
    engine.sleep()
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # tied to the embeddings: a drastic, visible change
    engine.sync_weights(model)  # wakes, loads the new weights, resets the prefix cache
    after = engine.generate([prompt], 1, greedy)[0]
    assert after.token_ids != v.token_ids
