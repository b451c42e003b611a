#!/usr/bin/env bash
# ncu over one training cell, our kernels beside FA4's and cuDNN's in one process
# (benchmarks/profile_cell.py frames the calls). Writes to $OUT_DIR (default .):
#   cell.ncu-rep   the full report (ncu-ui, or ncu --import)
#   details.csv    every section of every kernel, one row per metric
#   summary.txt    per kernel: time, tensor-pipe and issue activity, registers, smem,
#                  the top warp stall reasons (the columns of PERF_LOG's issue-53 table)
#   source_sass.csv with NCU_SOURCE_KERNEL=<regex>: the source page of the kernels it
#                  names, one row per SASS instruction with its executed count and stall
#                  samples, to find where a kernel's instructions go (the build has
#                  -lineinfo; source_cuda_sass.csv maps them to lines where ncu can);
#                  benchmarks/ncu_source_top.py source_sass.csv summarises it
#   benchmarks/ncu_cell.sh --headdim 128 --seqlen 8192 --causal --mode bwd
# Arguments go to profile_cell.py. NCU_SET (default full) picks the section set.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT_DIR:-.}
mkdir -p "$out"
ncu --profile-from-start off --nvtx --set "${NCU_SET:-full}" --import-source no \
  -f -o "$out/cell" python3 "$here/profile_cell.py" "$@" >"$out/ncu.log" 2>&1 || {
  tail -30 "$out/ncu.log"; exit 1; }
ncu --import "$out/cell.ncu-rep" --page details --csv >"$out/details.csv"
python3 "$here/ncu_summary.py" "$out/details.csv" | tee "$out/summary.txt"
if [ -n "${NCU_SOURCE_KERNEL:-}" ]; then
  ncu --import "$out/cell.ncu-rep" --kernel-name "regex:$NCU_SOURCE_KERNEL" --page source \
    --csv --print-source sass >"$out/source_sass.csv" 2>"$out/source.log" || tail -5 "$out/source.log"
  ncu --import "$out/cell.ncu-rep" --kernel-name "regex:$NCU_SOURCE_KERNEL" --page source \
    --csv --print-source cuda,sass >"$out/source_cuda_sass.csv" 2>>"$out/source.log" || true
fi
