#!/usr/bin/env bash
# Compiles one microbenchmark binary per backward tile configuration (in
# parallel) and times the whole backward (bf16, hidden 2048, batch*seqlen
# 16384) at each seqlen, causal and not.
#   benchmarks/microbench/run_bwd_tile_sweep.sh OUT_DIR "CONFIG CONFIG ..." ["SEQLENS"]
# A CONFIG is D:M:N:WARPS:ATOM_SDP:ATOM_DKV:ATOM_DQ:DOUBLE_BUFFER[:DQ_BEFORE_DK],
# the fields of a csrc/cuda/bwd/bwd_tile_config.h entry (the last one defaults to
# the table's). EXTRAS=1 times the
# softcap/ALiBi/dropout variant of the main kernel instead of the plain one.
# SWEEP_STEP=compile or run splits the two halves (compile while the GPU does
# something else, time when it is idle); the default does both.
set -euo pipefail
step=${SWEEP_STEP:-all}
cd "$(dirname "$0")/../.."
out=${1:?output dir}
configs=${2:-"64:128:128:8:4:4:4:0 64:128:128:8:4:4:4:1 64:64:128:8:2:4:4:1 128:64:128:8:2:4:2:1 128:64:128:8:2:4:2:0 128:128:64:8:4:2:4:1 128:64:64:8:4:2:2:1 256:64:64:8:4:2:2:0 256:64:64:8:4:2:2:1"}
seqlens=${3:-"4096 16384"}
extras=${EXTRAS:-0}
mkdir -p "$out"
cutlass=${CUTLASS_INCLUDE:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
arch=${ARCH:-90}
nvcc=${NVCC:-nvcc}
name_of() { echo "bwd_${1//:/_}"; }
export -f name_of
if [ "$step" != run ]; then
for config in $configs; do echo "$config"; done | xargs -P "$(nproc)" -I{} bash -c '
  IFS=: read -r d m n w s k q b f <<<"{}"
  name=$(name_of "{}")
  '"$nvcc"' -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I '"$cutlass"' \
    -gencode arch=compute_'"$arch"',code=sm_'"$arch"' -Xptxas -v \
    -DHEAD_DIM=$d -DBLOCK_M=$m -DBLOCK_N=$n -DWARPS=$w -DATOM_SDP=$s -DATOM_DKV=$k \
    -DATOM_DQ=$q -DDOUBLE_BUFFER=$b ${f:+-DDQ_BEFORE_DK=$f} -DWITH_EXTRAS='"$extras"' \
    benchmarks/microbench/bwd_microbench.cu -o '"$out"'/$name \
    >'"$out"'/ptxas_$name.txt 2>&1 || echo "compile failed: {}"'
fi
[ "$step" = compile ] && exit 0
for config in $configs; do
  name=$(name_of "$config")
  [ -x "$out/$name" ] || { echo "$config: not built (see $out/ptxas_$name.txt)"; continue; }
  for seqlen in $seqlens; do
    for causal in 0 1; do
      "$out/$name" "$seqlen" "$causal" || echo "$config seqlen=$seqlen causal=$causal: failed"
    done
  done
done | tee "$out/sweep.txt"
