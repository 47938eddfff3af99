#!/usr/bin/env bash
# The GPU evidence run: every GPU-only path of opsd, each check under its own timeout, on one machine
# with one CUDA GPU and no network (the workplace's H200 machine: Python 3.12, torch 2.11, no vLLM).
#
#     bash bench/gpu/evidence.sh [--tiny] [--out DIR]      # DIR defaults to $OUT, else runs/evidence
#
# --tiny: the same script on the CPU (no CUDA needed) at tiny shapes; tests/train/test_gpu_evidence.py runs
# it so that it cannot rot, and bench/gpu/pinned_dry_run.sh runs it on the GPU machine's versions.
# Installs nothing from a registry: opsd runs from this tree (PYTHONPATH=$PWD) and, where its
# pure-Python dependencies are missing, from the wheels that bench/gpu/fetch_wheels.sh put in .whl/
# (installed into /tmp/site). .whl/ is ignored by git: it reaches the GPU machine only when the run
# names it in `carry`. Where `import opsd` still fails after that step the run stops at once, with one
# line naming the missing module and what to carry, rather than spend every check's budget failing.
#
# Written to DIR as it goes (at most 8 files, so that all of them come back from the machine):
#   env.log                   the machine, versions, the wheel install, the import check
#   1-pytest.log .. 5-loss.log    each check's output, streamed (PYTHONUNBUFFERED=1, tee)
#   summary.tsv               check, status (ok/fail/timeout/skipped), seconds, key figures: one line
#                             appended right after each check ends, so a run cut off later keeps it
#   evidence.jsonl            every measurement of checks 2-5, one JSON object per line, as measured
#
# Order and guards: each check runs under its own timeout and fails alone; inside checks 2-4 full
# fine-tuning runs first, then LoRA, each setup in its own guard (check 2: an exception caught and
# recorded; checks 3 and 4: a process of its own under its own timeout), so one failure costs only its
# own figure.
#
# Budgets, in seconds (the checks' budgets add up to 510 s; the environment, the wheel install and the
# import check take < 20 s; each overrun is cut 10 s after its budget at most: call it with 580 s):
#   1 pytest -m gpu tests/       80  collection ~15 s; bf16 loss products, host syncs, CUDA RNG < 5 s;
#                                    bf16 full fine-tuning, 3 tiny steps ~10 s; FSDP2 on NCCL, float32
#                                    and bf16, one spawned rank each ~2 x 20 s
#   2 the Trainer (tiny)         70  2 setups (full, LoRA) x 3 runs (4 steps; 2, a checkpoint and a
#                                    resumed 2) ~ 6 x 5 s + imports 10 s; a fourth run per setup only
#                                    if the resume is not bit-exact
#   3 torchrun FSDP2 (tiny)      60  2 launches (full, LoRA; bf16 policy) x (~15 s start + 2 steps + checkpoint)
#   4 Qwen3-1.7B shape          250  build 1.72e9 params on the GPU in bf16 ~5 s, save them (bf16
#                                    safetensors, 3.4 GB) ~10 s; the matmul peak ~2 s; full fine-tuning
#                                    (100 s) then LoRA (80 s), each a process of its own: the Trainer
#                                    loads ~10 s, 3 steps x (rollouts 8 prompts x 2 x 256 tokens ~10-20 s
#                                    + training ~2 s); the plain PyTorch baseline on the full setup's
#                                    batches (45 s)
#   5 the loss, dense vs chunked 50  bench/loss.py at Qwen3-1.7B's head, N = 1024 and 4096, a process
#                                    per configuration (~5 s of imports each)
# Disk (64 GiB): the Qwen3 model 3.4 GB (5%), tiny checkpoints < 20 MB; no Qwen3 checkpoint (its full
# fine-tuning checkpoint would be 1.72e9 x 16 B = 27.5 GB with AdamW's moments: checkpoint.enabled=false).
# GPU memory (139 GiB), check 4's full fine-tuning: float32 masters 6.9 GB + gradients 6.9 + AdamW 13.8
# + the frozen teacher 4.0 (bf16 matrices, float32 embedding and norms) = 32 GB before activations (the
# micro-batch budget takes a quarter of what is free); the baseline's full logits add ~8 GB a micro-batch.
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
SCALE=1  # --tiny: budgets x3, for a loaded CPU; the dry run checks the script, not the GPU's times
[ "$TINY" = 1 ] && TINY_FLAG=(--tiny) && SCALE=3

{
  echo "== evidence run $(date -u +%FT%TZ), tiny=$TINY, out=$OUT_DIR"
  uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: none"
  df -h /tmp 2>&1 | tail -1
} 2>&1 | tee "$ENV_LOG"
# opsd's pure-Python dependencies, where this Python lacks them, from the wheels of fetch_wheels.sh.
WHEELS="${OPSD_WHEELS:-.whl}"
SITE="${OPSD_SITE:-/tmp/site}"
if ! "$PY" -c "import pydantic, math_verify" 2>/dev/null; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS/ into $SITE" | tee -a "$ENV_LOG"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl 2>&1 | tee -a "$ENV_LOG" && export PYTHONPATH="$SITE:$PYTHONPATH"
  else
    echo "no wheels in $WHEELS/, and pydantic or math_verify does not import here" | tee -a "$ENV_LOG"
  fi
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
EOF
# What every check needs. Where it fails: one line, naming the missing module and what to carry; stop.
if ! why=$("$PY" - 2>>"$ENV_LOG" <<'EOF'
import sys
try:
    import opsd.cli, opsd.trainer  # noqa: F401
except Exception as e:  # an ImportError names its module; anything else, its own message
    missing = getattr(e, "name", None)
    what = f"missing {missing}" if missing else "opsd does not import"
    print(f"{what} ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
    sys.exit(1)
print("opsd imports from", opsd.cli.__file__)
EOF
); then
  line="evidence: stopped before the checks: import opsd failed after the wheel step, $why; carry $WHEELS"
  line+=" (bash bench/gpu/fetch_wheels.sh here, then name $WHEELS in the run's carry)"
  echo "$line" >>"$ENV_LOG"
  printf 'check\tstatus\tseconds\tfigures\nimport\tfail\t0\t%s\n' "$why" >"$SUMMARY"
  echo "$line" >&2
  exit 3
fi
echo "$why" | tee -a "$ENV_LOG"

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
  local name=$1 budget=$(($2 * SCALE))
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

run_check 1-pytest 80 "$PY" -m pytest -q -rs -m gpu tests/ -p no:cacheprovider --continue-on-collection-errors
run_check 2-trainer 70 "$PY" bench/gpu/evidence.py trainer ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"
run_check 3-torchrun 60 "$PY" bench/gpu/evidence.py torchrun ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"
run_check 4-qwen3 250 "$PY" bench/gpu/evidence.py qwen3 ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"
run_check 5-loss 50 "$PY" bench/gpu/evidence.py loss ${TINY_FLAG[@]+"${TINY_FLAG[@]}"} --out "$OUT_DIR"
echo
echo "== summary ($SUMMARY)"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
! grep -qE $'\t(fail|timeout|killed)' "$SUMMARY"
