#!/usr/bin/env bash
# Build, test and benchmark on a machine with a GPU, in one go, writing logs
# and results under $RESULTS_DIR (default ./gpu_check_out).
#
#   scripts/gpu_check.sh [build|test|sanitize|bench|all]...   (default: all)
#
# sanitize: scripts/run_sanitizers.sh (compute-sanitizer memcheck and racecheck
# over the scripts/sanitize_*.py call sets), its logs in RESULTS_DIR and its
# summary in RESULTS_DIR/sanitizers.txt; not part of all (it takes minutes).
#
# Environment: FLASH_ATTN_CUDA_ARCHS (default: this GPU's arch), MAX_JOBS,
# TESTS (pytest selection, default tests/test_cuda_*.py), WORKERS (default 4 per GPU), BENCH_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR=${RESULTS_DIR:-$PWD/gpu_check_out}
mkdir -p "$RESULTS_DIR"
export PYTHONUNBUFFERED=1

# A wheel folder (.whl/) with nvidia-cutlass lets an offline machine build.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
  export PYTHONPATH=$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
fi

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)

do_build() {
  if [ -z "${FLASH_ATTN_CUDA_ARCHS:-}" ]; then
    # sm90 builds as sm_90a: the Hopper forward kernel (wgmma) needs it.
    FLASH_ATTN_CUDA_ARCHS=$(python3 -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}" + ("a" if (m, n) == (9, 0) else ""))')
    export FLASH_ATTN_CUDA_ARCHS
  fi
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  # A CXX set by the machine to a g++ that finds no shared libstdc++ would link the
  # static C++ runtime into the extension, and then an argument check that should
  # raise kills the process (setup.py's _use_shared_cxx_runtime, which only warns
  # about a CXX the user set). This script's builds drop such a CXX / CC and let
  # setup.py pick a compiler that links the shared runtime.
  local cxx=${CXX:-c++}
  if [ -n "${CXX:-}${CC:-}" ] &&
    [ "$("$cxx" -print-file-name=libstdc++.so 2>/dev/null)" = libstdc++.so ]; then
    echo "gpu_check: $cxx finds no shared libstdc++; building without CXX / CC set" \
      | tee -a "$RESULTS_DIR/build_time.txt"
    unset CXX CC
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$RESULTS_DIR/gpu.txt"
  local start=$SECONDS
  FLASH_ATTN_FORCE_CUDA_BUILD=1 FLASH_ATTN_PTXAS_VERBOSE=${FLASH_ATTN_PTXAS_VERBOSE:-1} \
    python3 setup.py build_ext --inplace >"$RESULTS_DIR/build.log" 2>&1 || {
      tail -50 "$RESULTS_DIR/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s with MAX_JOBS=$MAX_JOBS archs=$FLASH_ATTN_CUDA_ARCHS" | tee -a "$RESULTS_DIR/build_time.txt"
  grep -E "Function properties|spill|Used [0-9]+ registers" "$RESULTS_DIR/build.log" >"$RESULTS_DIR/ptxas.txt" || true
}

do_test() {
  local selection=${TESTS:-tests/test_cuda_*.py} ngpu workers=()
  # Four pytest-xdist workers per GPU, spread by tests/conftest.py (FLASH_ATTN_TEST_GPUS).
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$ngpu" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
    export FLASH_ATTN_TEST_GPUS=${FLASH_ATTN_TEST_GPUS:-$(seq -s, 0 $((ngpu - 1)))}
    workers=(-n "${WORKERS:-$((4 * ngpu))}")
  fi
  # shellcheck disable=SC2086
  python3 -m pytest -q "${workers[@]}" --maxfail=${MAXFAIL:-25} --no-header -rs $selection 2>&1 |
    tee "$RESULTS_DIR/tests.log" | grep -vE '^[.sx]+ +\[ *[0-9]+%\]$' | tail -40
}

do_sanitize() {
  # The call sets import the package built in place here.
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} RESULTS_DIR=$RESULTS_DIR \
    bash scripts/run_sanitizers.sh 2>&1 | tee "$RESULTS_DIR/sanitizers.txt"
}

do_bench() {
  # shellcheck disable=SC2086
  python3 benchmarks/benchmark_attention.py --out "$RESULTS_DIR/bench" ${BENCH_ARGS:---quick} \
    2>&1 | tee "$RESULTS_DIR/bench.log" | tail -60
}

for step in "${steps[@]}"; do
  case $step in
    build) do_build ;;
    test) do_test ;;
    sanitize) do_sanitize ;;
    bench) do_bench ;;
    all) do_build; do_test; do_bench ;;
    *) echo "unknown step $step (build|test|sanitize|bench|all)"; exit 2 ;;
  esac
done
