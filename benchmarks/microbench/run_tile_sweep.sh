#!/usr/bin/env bash
# Compiles one microbenchmark binary per forward tile configuration (in
# parallel) and times each at seqlen 4096, causal and not, bf16, with the
# benchmark grid's shape (hidden 2048, batch*seqlen 16384).
#   benchmarks/microbench/run_tile_sweep.sh OUT_DIR "D:M:N:W D:M:N:W ..."
# SWEEP_STEP=compile or run splits the two halves (compile while the GPU does
# something else, time when it is idle); the default does both. EXTRAS=1
# times the softcap/ALiBi/dropout variant of the kernel instead of the plain one.
set -euo pipefail
step=${SWEEP_STEP:-all}
cd "$(dirname "$0")/../.."
out=${1:?output dir}
configs=${2:-"64:128:128:4 64:128:64:4 128:128:64:4 128:128:32:4 128:64:64:4 128:128:64:8 256:128:64:8 256:64:64:4"}
mkdir -p "$out"
cutlass=${CUTLASS_INCLUDE:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
arch=${ARCH:-90}
nvcc=${NVCC:-nvcc}
if [ "$step" != run ]; then
for config in $configs; do echo "$config"; done | xargs -P "$(nproc)" -I{} bash -c '
  IFS=: read -r d m n w <<<"{}"
  '"$nvcc"' -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I '"$cutlass"' \
    -gencode arch=compute_'"$arch"',code=sm_'"$arch"' -Xptxas -v \
    -DHEAD_DIM=$d -DBLOCK_M=$m -DBLOCK_N=$n -DWARPS=$w -DWITH_EXTRAS='"${EXTRAS:-0}"' \
    benchmarks/microbench/fwd_microbench.cu -o '"$out"'/fwd_${d}_${m}_${n}_${w} \
    >'"$out"'/ptxas_${d}_${m}_${n}_${w}.txt 2>&1 || echo "compile failed: {}"'
fi
[ "$step" = compile ] && exit 0
for config in $configs; do
  IFS=: read -r d m n w <<<"$config"
  spill=$(grep -m1 -o "[0-9]* bytes spill stores" "$out/ptxas_${d}_${m}_${n}_${w}.txt" || echo "?")
  for causal in 0 1; do
    "$out/fwd_${d}_${m}_${n}_${w}" 4096 $causal | sed "s/\$/  [$spill]/"
  done
done | tee "$out/sweep.txt"
