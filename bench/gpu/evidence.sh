#!/usr/bin/env bash
# The GPU evidence run: every GPU-only path of opsd, each check under its own timeout, on one machine
# with one CUDA GPU and no network (the workplace's H200 machine: Python 3.12, torch 2.11, no vLLM).
#
#     bash bench/gpu/evidence.sh [--tiny] [--out DIR]      # DIR defaults to $OUT, else runs/evidence
#
# --tiny: the same script on the CPU (no CUDA needed) at tiny shapes; tests/test_gpu_evidence.py runs
# it so that it cannot rot. Installs nothing from a registry: opsd runs from this tree
# (PYTHONPATH=$PWD) and, where its pure-Python dependencies are missing, from the wheels that
# bench/gpu/fetch_wheels.sh put in .whl/ (installed into /tmp/site).
#
# Written to DIR as it goes (at most 8 files, so that all of them come back from the machine):
#   env.log                   the machine, versions, the wheel install
#   1-pytest.log .. 4-qwen3.log   each check's output, streamed (PYTHONUNBUFFERED=1, tee)
#   summary.tsv               check, status (ok/fail/timeout/skipped), seconds, key figures: one line
#                             appended right after each check ends, so a run cut off later keeps it
#   evidence.jsonl            every measurement of checks 2-4, one JSON object per line, as measured
#
# Budgets, in seconds (the call's limit is 560 s; the checks' budgets add up to 480 s; the environment
# and the wheel install take < 15 s, and each overrun is cut 10 s after its budget at most):
#   1 pytest -m gpu tests/       90  collection ~15 s; bf16 loss products, host syncs, CUDA RNG < 5 s;
#                                    bf16 full fine-tuning, 3 tiny steps ~10 s; FSDP2 on NCCL, float32
#                                    and bf16, one spawned rank each ~2 x 20 s
#   2 the Trainer (tiny)         90  2 setups (LoRA, full) x 3 processes' worth of runs (4 steps; 2, a
#                                    checkpoint and a resumed 2) ~ 6 x 5 s + imports 10 s; a third run per
#                                    setup only if the resume is not bit-exact
#   3 torchrun FSDP2 (tiny)      80  2 launches (full, LoRA; bf16 policy) x (~15 s start + 2 steps + checkpoint)
#   4 Qwen3-1.7B shape          220  build 1.72e9 params on the GPU in bf16 ~5 s; save them, bf16
#                                    safetensors, 1.72e9 x 2 B = 3.4 GB ~10 s; per setup: the Trainer
#                                    loads ~10 s, 3 steps x (rollouts 8 prompts x 2 x 256 tokens ~10-20 s
#                                    + training ~2 s) ~60-80 s
# Disk (64 GiB): the Qwen3 model 3.4 GB (5%), tiny checkpoints < 20 MB; no Qwen3 checkpoint (its full
# fine-tuning checkpoint would be 1.72e9 x 16 B = 27.5 GB with AdamW's moments: checkpoint.enabled=false).
# GPU memory (139 GiB), check 4's full fine-tuning: float32 masters 6.9 GB + gradients 6.9 + AdamW 13.8
# + the frozen bf16 teacher 3.4 = 31 GB before activations (the micro-batch budget takes a quarter of
# what is free).
set -u -o pipefail

TINY=0
OUT_DIR="${OUT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    *) echo "usage: bash bench/gpu/evidence.sh [--tiny] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
cd "$(dirname "$0")/../.." || exit 2
OUT_DIR="${OUT_DIR:-runs/evidence}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT_DIR/summary.tsv"
ENV_LOG="$OUT_DIR/env.log"
TINY_FLAG=()
[ "$TINY" = 1 ] && TINY_FLAG=(--tiny)

{
  echo "== evidence run $(date -u +%FT%TZ), tiny=$TINY, out=$OUT_DIR"
  uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: none"
  df -h /tmp 2>&1 | tail -1
} 2>&1 | tee "$ENV_LOG"
# opsd's pure-Python dependencies, where this Python lacks them, from the wheels of fetch_wheels.sh.
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pydantic, math_verify" 2>/dev/null; then
  echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site" | tee -a "$ENV_LOG"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl 2>&1 | tee -a "$ENV_LOG" && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
"$PY" - 2>&1 <<'EOF' | tee -a "$ENV_LOG"
import importlib.metadata as md, platform, sys, torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"{p.multi_processor_count} SMs")
for name in ("transformers", "peft", "accelerate", "pydantic", "pydantic-core", "math-verify", "pyyaml",
             "tqdm", "safetensors", "tokenizers", "pytest", "hypothesis"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
import opsd.cli, opsd.trainer  # noqa: F401  what every check needs
print("opsd imports from", opsd.cli.__file__)
EOF

printf 'check\tstatus\tseconds\tfigures\n' >"$SUMMARY"
CURRENT=""
CURRENT_T0=0
elapsed() { echo $(($(date +%s) - CURRENT_T0)); }
on_signal() {  # the run itself is being stopped: say which check it cut off, then stop
  if [ -n "$CURRENT" ]; then
    printf '%s\tkilled\t%s\tthe whole run was stopped during this check\n' "$CURRENT" "$(elapsed)" >>"$SUMMARY"
  fi
  exit 143
}
trap on_signal TERM INT

# run_check NAME BUDGET_S COMMAND...: the command under `timeout`, its output streamed to NAME.log; one
# summary line when it ends. Exit status 77 means skipped; 124 or 137, cut off at its budget.
run_check() {
  local name=$1 budget=$2
  shift 2
  local log="$OUT_DIR/$name.log" rc status secs figures
  CURRENT=$name
  CURRENT_T0=$(date +%s)
  echo "== $name (budget $budget s): $*" | tee "$log"
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  secs=$(elapsed)
  case $rc in
    0) status=ok ;;
    77) status=skipped ;;
    124 | 137) status=timeout ;;
    *) status="fail($rc)" ;;
  esac
  if [ "$name" = 1-pytest ]; then  # pytest's last line: N passed, M skipped, K deselected in S s
    figures=$(grep -aE '[0-9]+ (passed|failed|skipped|deselected|errors?)' "$log" | tail -1 | tr -d '=' | xargs)
  else
    figures=$(grep -a '^FIGURES ' "$log" | tail -1 | cut -c9-)
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "${figures:--}" >>"$SUMMARY"
  echo "== $name: $status in $secs s"
  CURRENT=""
}

run_check 1-pytest 90 "$PY" -m pytest -q -rs -m gpu tests/ -p no:cacheprovider --continue-on-collection-errors
run_check 2-trainer 90 "$PY" bench/gpu/evidence.py trainer ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"
run_check 3-torchrun 80 "$PY" bench/gpu/evidence.py torchrun ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"
run_check 4-qwen3 220 "$PY" bench/gpu/evidence.py qwen3 ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"

echo
echo "== summary ($SUMMARY)"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
! grep -qE $'\t(fail|timeout|killed)' "$SUMMARY"
