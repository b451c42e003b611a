#!/usr/bin/env bash
# Compiles every benchmarks/microbench/*.cu to an object file, JOBS at a time,
# with each file's default macros, so that a change in csrc/ that breaks a
# microbenchmark fails CI instead of the next tile sweep. Objects only: no GPU
# is needed, and nothing is linked or run.
#   benchmarks/microbench/compile_all.sh [FILE.cu ...]   (default: all of them)
# Overridable: JOBS (default: the cores), NVCC (default nvcc), ARCH (default 90a:
# compiles the SM80 and the Hopper kernels both), CUTLASS_INCLUDE (default: the
# nvidia-cutlass wheel's).
# Without nvcc it fails, unless FLASH_ATTN_FORCE_CUDA_BUILD=0 (a CPU-only
# check), when it says so and skips.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

nvcc=${NVCC:-nvcc}
if ! command -v "$nvcc" >/dev/null 2>&1; then
  if [ "${FLASH_ATTN_FORCE_CUDA_BUILD:-1}" = 0 ]; then
    echo "compile_all.sh: no $nvcc, and FLASH_ATTN_FORCE_CUDA_BUILD=0: microbenchmarks not compiled"
    exit 0
  fi
  echo "compile_all.sh: $nvcc not found (set NVCC, or FLASH_ATTN_FORCE_CUDA_BUILD=0 to skip)" >&2
  exit 1
fi
cutlass=${CUTLASS_INCLUDE:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
arch=${ARCH:-90a}

# The flags setup.py gives the kernels; the extended wgmma shapes and the
# sm90a mark as the Hopper instantiation files and the sm90 microbenchmarks'
# own compile lines have them.
flags=(-std=c++20 -O3 -DNDEBUG --use_fast_math --expt-relaxed-constexpr --expt-extended-lambda
  -I csrc -I "$cutlass" -gencode "arch=compute_${arch},code=sm_${arch}")
if [ "$arch" = 90a ]; then
  flags+=(-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DFLASH_ATTN_HAS_SM90A)
fi

if [ $# -gt 0 ]; then
  files=("$@")
else
  files=(benchmarks/microbench/*.cu)
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Files compile side by side, JOBS at a time (default: the cores; each nvcc of a
# kernel-sized file takes 3-5 GB), so CI's two cores halve the step.
jobs=${JOBS:-$(nproc)}
compile_one() {  # file: prints its line, exit status 1 when it fails
  local file=$1 start=$SECONDS
  if "$nvcc" "${flags[@]}" -c "$file" -o "$out/$(basename "$file" .cu).o"; then
    echo "compiled $file ($((SECONDS - start)) s)"
  else
    echo "FAILED   $file ($((SECONDS - start)) s)" >&2
    touch "$out/$(basename "$file" .cu).failed"
    return 1
  fi
}
running=0
for file in "${files[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  compile_one "$file" &
  running=$((running + 1))
done
wait || true
failed=()
for file in "${files[@]}"; do
  [ -e "$out/$(basename "$file" .cu).failed" ] && failed+=("$file")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "compile_all.sh: ${#failed[@]} of ${#files[@]} microbenchmarks do not compile: ${failed[*]}" >&2
  exit 1
fi
