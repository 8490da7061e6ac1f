#!/usr/bin/env bash
# The GPU check, in one command on a machine with a GPU (torch with CUDA, nvcc, pytest; compute-sanitizer where
# installed; no network):
#
#     OUT=some/empty/dir bash benchmarks/gpu_check.sh [--quick] [--dry-run]
#
# Steps, most telling first, so that a check stopped early has still said the most: environment (torch, the
# GPU, `deform-conv doctor`), build (the CPU library and the visible GPU's, into a fresh private cache),
# selfcheck (`deform-conv check`), tests (CUDA and correctness), benchmark (`deform-conv bench --gpu`; in full
# mode also benchmarks/ms_deform_attn_speed.py's encoder case, into the log), then
# compute-sanitizer's memcheck and initcheck on benchmarks/gpu_memcheck_case.py. Each step has a timeout; the
# timeouts add up to under 8 minutes (--quick: under 4), and a step that no longer fits before the deadline is
# skipped. $OUT (default benchmarks/results/gpu-check) receives at most 8 files: summary.txt (one line per step:
# passed, failed (exit N after S s) or skipped (reason)), a log per step (both sanitizer tools in
# sanitizer.log) and the benchmark's gpu.md. Exit code 0 when no step failed.
#
# --dry-run (or GPU_CHECK_DRY_RUN=1) needs no GPU: it chooses the interpreter, resolves the paths, prints the
# plan and writes the summary with every step "skipped (dry run)". $PYTHON chooses the interpreter (else
# python3, else python); $GPU_CHECK_DEADLINE the seconds the whole check may take (default 570).
set -uo pipefail

mode=full
dry_run=${GPU_CHECK_DRY_RUN:-0}
for arg in "$@"; do
  case $arg in
    --quick) mode=quick ;;
    --dry-run) dry_run=1 ;;
    -h | --help) sed -n '2,19s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (expected --quick, --dry-run or --help)" >&2; exit 2 ;;
  esac
done

# A relative OUT or TMPDIR names a folder below where the command started: resolved before leaving it.
if [ -n "${OUT:-}" ]; then
  if ! mkdir -p -- "$OUT" || ! OUT=$(cd -- "$OUT" && pwd -P); then echo "gpu_check.sh: cannot create OUT=$OUT" >&2; exit 2; fi
fi
case ${TMPDIR:-/} in /*) ;; *) export TMPDIR=$PWD/$TMPDIR ;; esac
cd -- "$(dirname -- "$0")/.." || exit 2
repo=$(pwd -P)
OUT=${OUT:-$repo/benchmarks/results/gpu-check}
mkdir -p -- "$OUT" || exit 2

# Some machines have python3 and no python; a venv may want its own: $PYTHON decides where given.
if [ -n "${PYTHON:-}" ]; then
  py=$(command -v -- "$PYTHON") python_from="\$PYTHON"
elif py=$(command -v python3); then
  python_from="python3 on PATH"
else
  py=$(command -v python) python_from="python on PATH"
fi
[ -n "$py" ] || { echo "gpu_check.sh: no interpreter (${PYTHON:+PYTHON=$PYTHON not found; }no python3 or python on PATH)" >&2; exit 2; }
case $py in /*) ;; *) py=$(cd -- "$(dirname -- "$py")" && pwd -P)/${py##*/} ;; esac

# An inherited TORCH_CUDA_ARCH_LIST would build for other archs than the visible GPU's, and the package's own
# variables could turn the CUDA library off, run the reference instead or share a cache: the check tests what a
# new user of this GPU gets.
arch_list_note=""
[ -n "${TORCH_CUDA_ARCH_LIST+set}" ] && arch_list_note=" (was '$TORCH_CUDA_ARCH_LIST')"
unset TORCH_CUDA_ARCH_LIST
inherited=""
for name in $(compgen -e); do
  [[ $name == DEFORM_CONV_* ]] && inherited+="$name " && unset "$name"
done

# The cache lives outside $OUT: one entry alone has 15-17 files, and only 8 come back from $OUT.
if ! work=$(mktemp -d "${TMPDIR:-/tmp}/deform-conv-gpu-check.XXXXXX") || ! work=$(cd -- "$work" && pwd -P); then
  echo "gpu_check.sh: mktemp -d failed" >&2; exit 2
fi
trap 'rm -rf -- "$work"' EXIT
case $work/ in "$OUT"/*) echo "gpu_check.sh: the temporary directory $work is inside OUT; set TMPDIR elsewhere" >&2; exit 2 ;; esac
export DEFORM_CONV_CACHE_DIR=$work/cache
export PYTHONPATH=$repo/src${PYTHONPATH:+:$PYTHONPATH}
# Python block-buffers output sent to a file: a step killed by its timeout would leave an empty log.
export PYTHONUNBUFFERED=1

# The toolkit's bin directory need not be on PATH: the package finds nvcc through CUDA_HOME or /usr/local/cuda.
sanitizer=$(command -v compute-sanitizer)
for candidate in "${CUDA_HOME:-/usr/local/cuda}"/{bin,compute-sanitizer}/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$candidate" ] && sanitizer=$candidate
done
sanitizer_off=""  # why the sanitizer steps cannot run, once known
if [ -z "$sanitizer" ]; then
  sanitizer_off="compute-sanitizer not installed"
elif ! sanitizer_version=$("$sanitizer" --version 2>&1); then
  sanitizer_off="compute-sanitizer --version failed: ${sanitizer_version##*$'\n'}"
fi

# Timeouts in seconds, the steps in the order that tells most first; 0: not in this mode. A step still running
# at its timeout gets SIGTERM, and KILL_GRACE seconds later SIGKILL. The build compiles the CPU library (ten
# files in parallel, the longest 50 s on a 2-core EPYC) and then the CUDA one (its .cu alone 95 s there), and
# --quick cannot make that shorter: it leaves out the sanitizer instead, whose run of the case (torch's start
# included) takes tens of seconds.
steps=(environment build selfcheck tests benchmark memcheck initcheck)
declare -A limit
if [ "$mode" = quick ]; then
  limit=([environment]=18 [build]=155 [selfcheck]=15 [tests]=30 [benchmark]=20 [memcheck]=0 [initcheck]=0)
else
  limit=([environment]=30 [build]=180 [selfcheck]=25 [tests]=120 [benchmark]=50 [memcheck]=45 [initcheck]=25)
fi
KILL_GRACE=5
deadline=${GPU_CHECK_DEADLINE:-570}
[[ $deadline =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: GPU_CHECK_DEADLINE=$deadline is not a number of seconds" >&2; exit 2; }
budget=0
for name in "${steps[@]}"; do budget=$((budget + limit[$name])); done

# 6 logs + summary.txt + gpu.md = the 8 files that come back.
declare -A log
for name in environment build selfcheck tests benchmark; do log[$name]=$OUT/$name.log; done
log[memcheck]=$OUT/sanitizer.log
log[initcheck]=$OUT/sanitizer.log

# The GPU's own tests first: pytest runs the files in this order, and a timeout then cuts the CPU-only ones. (The
# CUDA simulation's tests run the same kernels on the CPU in every CI run; here they would only cost time.)
tests=(tests/deform_conv2d/test_cuda.py tests/ms_deform_attn/test_ms_deform_attn_cuda.py)
if [ "$mode" = full ]; then
  tests+=(tests/deform_conv2d/test_correctness.py)
fi

# The environment step's first lines name torch and the device, for the summary; then the doctor reports.
cat >"$work/environment.py" <<'EOF'
import os, subprocess, sys
import torch
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
print("TORCH_CUDA_ARCH_LIST:", os.environ.get("TORCH_CUDA_ARCH_LIST", "unset"))
visible = torch.cuda.is_available()
if visible:
    print("device: %s (capability %d.%d; %d visible)" % (torch.cuda.get_device_name(0),
          *torch.cuda.get_device_capability(0), torch.cuda.device_count()))
else:
    print("device: none visible (the later steps would test the CPU only)")
doctor = subprocess.call([sys.executable, "-m", "deform_conv", "doctor"])
sys.exit(doctor or (0 if visible else 1))
EOF

# Sets cmd to the command line of step $1.
command_for() {
  # torch's caching allocator carves small tensors out of 2 MiB segments, where memcheck cannot see a write a
  # few bytes past one: without it each tensor is an allocation of its own. API errors are not reported: torch
  # and cuBLAS probe the driver with calls that fail by design, and a failed launch of ours raises in the case.
  local sanitize=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${sanitizer:-compute-sanitizer}" --report-api-errors no --error-exitcode 1)
  case $1 in
    environment) cmd=("$py" "$work/environment.py") ;;
    build) cmd=("$py" -m deform_conv build) ;;
    selfcheck) cmd=("$py" -m deform_conv check) ;;
    # Progress per file, not -q: a log cut by the timeout still tells which file got how far.
    # cuBLAS gives the same bits run to run only with a fixed workspace, which torch's deterministic mode (the
    # deterministic-backward tests) asks for; the other steps keep the default workspace.
    tests) cmd=(env CUBLAS_WORKSPACE_CONFIG=:4096:8 "$py" -m pytest -rfEs --durations=10 -p no:cacheprovider "${tests[@]}") ;;
    # The GPU benchmark's cases are fixed; --quick shortens each measurement (0.3 s otherwise). The full mode then
    # times multi-scale deformable attention's encoder op against Deformable DETR's grid_sample version, into the
    # log (an estimated 10 s, most of it starting torch, not yet measured on a GPU; --quick's 20 s have no room
    # for it; without a CUDA kernel for the op it says so and passes).
    benchmark)
      cmd=("$py" -m deform_conv bench --gpu --out "$OUT")
      if [ "$mode" = quick ]; then
        cmd+=(--min-seconds 0.05)
      else
        # shellcheck disable=SC2016  # expanded by the inner bash: $0 is the interpreter, "$@" the bench command
        cmd=("$BASH" -c '"$@" && "$0" benchmarks/ms_deform_attn_speed.py --device cuda --cases encoder --min-seconds 0.1'
             "$py" "${cmd[@]}")
      fi ;;
    memcheck | initcheck) cmd=("${sanitize[@]}" --tool "$1" "$py" benchmarks/gpu_memcheck_case.py) ;;
  esac
}

declare -A result
write_summary() {
  local device torch_version name
  device=$(sed -n 's/^device: //p' "${log[environment]}" 2>/dev/null | head -n 1)
  torch_version=$(sed -n 's/^torch: //p' "${log[environment]}" 2>/dev/null | head -n 1)
  {
    echo "deform_conv GPU check, $mode mode$([ "$dry_run" = 1 ] && echo ', dry run'), started $started"
    echo "interpreter: $py ($python_from, Python $python_version)"
    if [ "$dry_run" = 1 ]; then
      device="not probed (dry run)" torch_version="not probed (dry run)"
    fi
    echo "device: ${device:-not reported (the environment step did not get to its device line)}"
    echo "torch: ${torch_version:-not reported}"
    echo "budget: $budget s of step timeouts, deadline $deadline s"
    for name in "${steps[@]}"; do echo "$name: ${result[$name]:-skipped (not reached: the check was stopped)}"; done
    echo "total: $((SECONDS - start)) s"
  } >"$OUT/summary.txt"
}

failed_result() {  # rc seconds limit [detail]
  local timed_out=""
  { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; } && [ "$2" -ge "$3" ] && timed_out=": timed out"
  verdict="failed (exit $1 after $2 s$timed_out${4:+; $4})"
}

# compute-sanitizer refuses the device on some machines, before or while starting the program: that is a
# skip, not a failure of ours. The case prints its last line only when it ran to the end.
sanitizer_result() {  # rc seconds limit output
  local refusal errors ran=""
  refusal=$(grep -E -i '^========= .*(not supported|unsupported|unable to|failed to (launch|initiali[sz]e|attach)|internal sanitizer error)' \
    <<<"$4" | grep -v 'Program hit' | head -n 1 | sed 's/^=* *//')
  errors=$(sed -n 's/^========= ERROR SUMMARY: //p' <<<"$4" | tail -n 1)
  grep -q '^memcheck case ran on cuda' <<<"$4" && ran=yes
  if [ -n "$refusal" ] && ! grep -q '^Traceback' <<<"$4"; then
    sanitizer_off="compute-sanitizer refused the device: $refusal"
    verdict="skipped ($sanitizer_off${ran:+; the case ran unchecked})"
  elif [ "$1" -eq 0 ] && [ -n "$ran" ]; then
    verdict="passed ($2 s; ${errors:-no error summary})"
  else
    failed_result "$1" "$2" "$3" "$errors"
  fi
}

# Why step $1 cannot run now, or nothing.
skip_reason() {
  local left=$((deadline - (SECONDS - start)))
  if [ "${limit[$1]}" -eq 0 ]; then
    echo "not in $mode mode"
  elif [ "$left" -lt $((limit[$1] + KILL_GRACE)) ]; then
    echo "out of time: $left s left, the step may take $((limit[$1] + KILL_GRACE)) s"
  elif [ "$dry_run" = 1 ]; then
    echo "dry run"
  elif [ -n "$blocked" ]; then
    echo "$blocked"
  elif [[ $1 == memcheck || $1 == initcheck ]] && [ -n "$sanitizer_off" ]; then
    echo "$sanitizer_off"
  # initcheck runs the same case as memcheck at about its cost: where memcheck took longer than initcheck's
  # timeout, initcheck would only time out.
  elif [ "$1" = initcheck ] && [ "${memcheck_seconds:-0}" -gt "${limit[initcheck]}" ]; then
    echo "out of time: memcheck took $memcheck_seconds s, initcheck has ${limit[initcheck]} s"
  fi
}

run_step() {
  local name=$1 file=${log[$1]} reason seconds rc before output detail=""
  command_for "$name"
  reason=$(skip_reason "$name")
  before=$(wc -l <"$file")
  printf '== %s (timeout %s s)\n$ %s\n' "$name" "${limit[$name]}" "${cmd[*]}" >>"$file"
  if [ -n "$reason" ]; then
    result[$name]="skipped ($reason)"
    echo "${result[$name]}" >>"$file"
    echo "== $name: ${result[$name]}"
  else
    echo "== $name (timeout ${limit[$name]} s)"
    seconds=$SECONDS
    timeout -k "$KILL_GRACE" "${limit[$name]}" "${cmd[@]}" </dev/null >>"$file" 2>&1
    rc=$?
    seconds=$((SECONDS - seconds))
    output=$(tail -n +"$((before + 1))" "$file")
    # pytest's last line counts the skipped tests too: every CUDA test skips where no GPU is visible.
    [ "$name" = tests ] && detail=$(grep -E '^=* *[0-9]+ (passed|failed|skipped|errors?|deselected)' <<<"$output" \
      | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    if [[ $name == memcheck || $name == initcheck ]]; then
      [ "$name" = memcheck ] && memcheck_seconds=$seconds
      sanitizer_result "$rc" "$seconds" "${limit[$name]}" "$output"
    elif [ "$rc" -eq 0 ]; then
      verdict="passed ($seconds s${detail:+; $detail})"
    else
      failed_result "$rc" "$seconds" "${limit[$name]}" "$detail"
    fi
    result[$name]=$verdict
    # The cache, and with it the compiler's log of a failed build, goes at exit.
    if [ "$name" = build ] && [ "$rc" -ne 0 ]; then
      for output in "$DEFORM_CONV_CACHE_DIR"/logs/*.log; do
        [ -f "$output" ] && { echo "== $output (last 200 lines)"; tail -n 200 "$output"; } >>"$file"
      done
    fi
    echo "   ${result[$name]}; log $file"
    tail -n 5 "$file" | sed 's/^/   | /'
  fi
  write_summary  # after every step: a check killed from outside still leaves what it found
}

start=$SECONDS
started=$(date -u '+%Y-%m-%d %H:%M:%S UTC')
python_version=$("$py" -c 'import sys; print(sys.version.split()[0])' 2>&1) \
  || { echo "gpu_check.sh: $py does not run: $python_version" >&2; exit 2; }
seen=$("$py" -c 'import os
print(" ".join(k + "=" + os.environ.get(k, "<unset>") for k in ("PYTHONUNBUFFERED", "TORCH_CUDA_ARCH_LIST")))')

echo "deform_conv GPU check: $mode mode$([ "$dry_run" = 1 ] && echo ', dry run')"
echo "  repository   $repo"
echo "  interpreter  $py ($python_from, Python $python_version)"
echo "  OUT          $OUT (at most 8 files come back)"
echo "  cache        $DEFORM_CONV_CACHE_DIR (private, removed at exit)"
echo "  TORCH_CUDA_ARCH_LIST unset$arch_list_note: the CUDA library is built for the visible GPU"
[ -n "$inherited" ] && echo "  unset        ${inherited}(the check runs with the package's defaults)"
echo "  python sees  $seen"
echo "  sanitizer    ${sanitizer_off:-$sanitizer ($(grep -m 1 -o 'Version [^ ]*' <<<"$sanitizer_version" || echo 'version not printed'))}"
echo "  budget       $budget s of step timeouts (+$KILL_GRACE s each to stop one that ignores SIGTERM); deadline $deadline s"
for name in "${steps[@]}"; do
  command_for "$name"
  printf 'plan: %s | %s s | %s | %s\n' "$name" "${limit[$name]}" "${log[$name]}" "${cmd[*]}"
done

# Files of an earlier check in the same OUT would pass for this one's.
rm -f -- "$OUT/gpu.md"
for file in "${log[@]}"; do : >"$file"; done
blocked="" memcheck_seconds=""
for name in "${steps[@]}"; do
  run_step "$name"
  # Every later step imports the package, and the import would start the same build again.
  if [ "$name" = build ]; then
    case ${result[build]} in failed*) blocked="the build failed" ;; skipped*) blocked="the build did not run" ;; esac
  fi
done

shopt -s globstar nullglob dotglob
files=0
for file in "$OUT"/**; do [ -f "$file" ] && files=$((files + 1)); done
[ "$files" -gt 8 ] && echo "WARNING: $files files in $OUT, and only 8 come back" >>"$OUT/summary.txt"
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
status=0
for name in "${steps[@]}"; do [[ ${result[$name]} == failed* ]] && status=1; done
exit "$status"
