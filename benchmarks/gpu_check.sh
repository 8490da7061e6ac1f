#!/usr/bin/env bash
# The GPU check, in one run on a machine with a GPU (torch with CUDA, nvcc, pytest, compute-sanitizer; no network):
#
#     bash benchmarks/gpu_check.sh
#
# Builds the kernels for the visible GPU, runs the self-check, the CUDA tests and the correctness tests,
# compute-sanitizer's memcheck on a small forward+backward (with border, far-outside and non-finite points),
# and the GPU benchmark (S1-S5 at batch 32, fp32 and bf16, against torchvision and cuDNN's conv2d). Logs and
# tables go to $OUT (default benchmarks/results/gpu-check). Exit code 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export DEFORM_CONV_CACHE_DIR="${DEFORM_CONV_CACHE_DIR:-$OUT/cache}"

status=0
step() {
  local name=$1 seconds=$2
  shift 2
  local start=$SECONDS
  echo "== $name"
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start)) s; log $OUT/$name.log"
  tail -n 4 "$OUT/$name.log" | sed 's/^/   | /'
  [ "$rc" -eq 0 ] || status=1
}

step environment 60 python -m deform_conv doctor
step build 300 python -m deform_conv build
step selfcheck 120 python -m deform_conv check
step tests 300 python -m pytest -q -rs tests/test_cuda.py tests/test_correctness.py tests/test_errors.py tests/test_nonfinite.py
step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/gpu_memcheck_case.py
step benchmark 300 python -m deform_conv bench --gpu --out "$OUT"
echo "== done: $([ "$status" -eq 0 ] && echo 'every step passed' || echo 'SOME STEPS FAILED'); results in $OUT"
exit "$status"
