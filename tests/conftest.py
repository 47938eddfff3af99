"""Shared fixtures: an offline tiny tokenizer/model, and the real SmolLM2 when it has been fetched."""

from __future__ import annotations

import os
from pathlib import Path

# Before torch starts OpenMP: on a busy 2-core CI box, spin-waiting threads (the default) make
# small forwards several times slower, and the tests spawn worker processes of their own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from opsd.fetch import cached_model_path
from opsd.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE with a ChatML template; eos <|im_end|>, pad <|endoftext|>. Do not mutate."""
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh 2-layer random Llama per test (tests may train or wrap it)."""
    return build_tiny_model(tiny_tokenizer, seed=0)


def smollm2_dir() -> Path | None:
    """The fetched SmolLM2-135M-Instruct directory, or None (for skipif at collection time)."""
    return cached_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Use with @pytest.mark.smollm2; skips cleanly when the model has not been fetched."""
    path = smollm2_dir()
    if path is None:
        pytest.skip("SmolLM2 not fetched; run `opsd fetch-model smollm2-135m-instruct`")
    return path


@pytest.fixture(autouse=True)
def _cpu_bf16_probe_off(monkeypatch):
    """`model.dtype=auto` resolves to float32 on every CPU unless a test asks otherwise: the CPU probe
    differs between machines (AMX, AVX512-BF16, neither), and a test's numbers must not. Tests pin
    their dtype as well; this is the safety net, and spawned processes inherit it."""
    monkeypatch.setenv("OPSD_CPU_BF16", "0")


@pytest.fixture(params=["0", "1"], ids=["cpu_bf16_off", "cpu_bf16_on"])
def cpu_bf16(request, monkeypatch) -> bool:
    """Run a dtype-sensitive test under both answers of the CPU probe, on every machine: a CPU with
    bf16 units and one without each take both paths (emulated bf16 is slow: keep such tests small)."""
    monkeypatch.setenv("OPSD_CPU_BF16", request.param)
    return request.param == "1"


@pytest.fixture(autouse=True)
def _no_leaked_torchrun_env(monkeypatch):
    """A test that builds an in-process vLLM engine (fake or real) may leave torchrun's variables
    set; `opsd train` would then see a half-set torchrun environment."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
