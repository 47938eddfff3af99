#!/usr/bin/env bash
# The wheels of opsd's pure-Python dependencies that the GPU machine lacks (its image has torch 2.11,
# transformers 5.17, peft, accelerate, pyyaml, tqdm, safetensors, tokenizers, sympy, pytest and
# hypothesis, but not these), for Python 3.12 on manylinux x86_64, into .whl/ (ignored by git; it
# travels with the working tree, within the 64 MiB the tree may take):
#
#     bash bench/gpu/fetch_wheels.sh        # here, with network; then on the GPU machine:
#     bash bench/gpu/evidence.sh            # installs .whl/*.whl into /tmp/site where they are missing
#
# What `import opsd.trainer` and `opsd.cli` load beyond the image: pydantic (the config) with
# pydantic-core at the exact version pydantic pins, annotated-types and typing-inspection;
# math-verify (the grader) with latex2sympy2_extended and antlr4-python3-runtime (sympy is there);
# typing-extensions, at least what pydantic-core needs (>= 4.14.1), whatever the image holds. Not
# needed: datasets (read only for .json/.parquet/.csv files and hub names, not .jsonl) and gguf (never
# imported by training). One version of each: two would stop the whole install. math-verify is imported
# only where grading runs (opsd.grading), so training runs without it; the evidence run's tests grade.
#
# The working tree and everything carried travel within 64 MiB: the wheels must stay under 48 MiB
# (MAX_MIB) so that the tree keeps its room; over it, this script fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
MAX_MIB="${MAX_MIB:-48}"
WHEELS=(
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  typing-extensions==4.16.0
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0
  antlr4-python3-runtime==4.13.2
)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

# pydantic pins pydantic-core exactly: the two must agree, or pydantic refuses to import.
pin=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
core=$(ls .whl/pydantic_core-*.whl | sed 's/.*pydantic_core-\([^-]*\)-.*/\1/')
if [ "$pin" != "$core" ]; then
  echo "pydantic pins pydantic-core==$pin but .whl holds $core" >&2
  exit 1
fi
count=$(ls .whl/*.whl | wc -l)
if [ "$count" != "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels, .whl holds $count" >&2
  exit 1
fi
ls -l .whl
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1048576 }')
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "the wheels take $mib MiB, over $MAX_MIB MiB: with the working tree they would not travel (64 MiB)" >&2
  exit 1
fi
echo "$count wheels, $mib MiB in .whl/ (under $MAX_MIB MiB; pydantic-core==$core as pydantic pins)"
