#!/usr/bin/env bash
# The evidence run's --tiny dry run on the GPU machine's versions, on a CPU, before any change to the GPU
# path goes to a GPU: Python 3.12 (where pyenv or the PATH has it; else this machine's python3), torch
# 2.11.0, transformers 5.17.0, and of the rest only what the GPU machine's image holds; opsd's
# pure-Python dependencies (pydantic, math-verify and theirs) only from the wheels of fetch_wheels.sh,
# installed by evidence.sh's own wheel step, as on the GPU machine.
#
#     bash bench/gpu/pinned_dry_run.sh [--venv DIR] [--out DIR]
#
# --venv: where the virtual environment is built, outside the repository (default /tmp/opsd-pinned;
# kept and reused while its torch and transformers are the pinned ones). --out: the evidence run's
# output (default runs/pinned, ignored by git). Needs a package registry: torch 2.11.0 comes from
# PyTorch's CPU index where that is reachable, else from PyPI, whose Linux build is CUDA's and brings
# the nvidia libraries (~4.6 GB installed); it imports and computes on a CPU all the same. The exit
# status is evidence.sh's; docs/gpu.md records the last result.
set -euo pipefail

VENV=/tmp/opsd-pinned
OUT_DIR=runs/pinned
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    *) echo "usage: bash bench/gpu/pinned_dry_run.sh [--venv DIR] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
cd "$(dirname "$0")/../.."
TORCH=2.11.0
TRANSFORMERS=5.17.0
# The GPU machine's image holds these (docs/gpu.md); opsd, its tests and the evidence run import them.
IMAGE=(peft accelerate pyyaml tqdm safetensors tokenizers numpy psutil matplotlib pytest hypothesis)
# Absent from the image: opsd's wheels bring them. Removed if anything above pulled them in.
WHEELED=(pydantic pydantic-core annotated-types typing-inspection math-verify latex2sympy2_extended
  antlr4-python3-runtime)

base=""
for cand in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import venv' 2>/dev/null; then
    base=$(command -v "$cand")
    break
  fi
done
[ -n "$base" ] || { echo "no Python found" >&2; exit 2; }
echo "== base Python: $base ($("$base" -c 'import platform; print(platform.python_version())'))"

PY="$VENV/bin/python"
have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')" 2>/dev/null; }
if [ ! -x "$PY" ] || ! have torch "$TORCH" || ! have transformers "$TRANSFORMERS"; then
  rm -rf "$VENV"
  "$base" -m venv "$VENV"
  # The machine's pip constraints (if any) would cap what the image has; this venv pins its own.
  export PIP_CONSTRAINT=""
  "$PY" -m pip install -q --upgrade pip
  if ! "$PY" -m pip install -q --timeout 15 --retries 1 "torch==$TORCH" \
    --index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
    echo "== PyTorch's CPU index is not reachable: torch $TORCH from PyPI (the CUDA build)"
    "$PY" -m pip install -q "torch==$TORCH"
  fi
  "$PY" -m pip install -q "transformers==$TRANSFORMERS" "${IMAGE[@]}"
fi
"$PY" -m pip uninstall -q -y "${WHEELED[@]}" 2>/dev/null || true
if ! ls .whl/*.whl >/dev/null 2>&1; then
  bash bench/gpu/fetch_wheels.sh
fi
"$PY" - <<'EOF'
import importlib.metadata as md, platform
print("== pinned:", "python", platform.python_version(), *(f"{n} {md.version(n)}" for n in ("torch", "transformers", "peft")))
for name in ("pydantic", "math-verify"):
    try:
        md.version(name)
        raise SystemExit(f"{name} is installed: the dry run must take it from the wheels alone")
    except md.PackageNotFoundError:
        pass
EOF

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
rm -rf "$OUT_DIR"
PYTHON="$PY" OPSD_SITE="$site" bash bench/gpu/evidence.sh --tiny --out "$OUT_DIR"
