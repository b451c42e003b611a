#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the small forward, backward, KV-cache and combine
# call sets in scripts/sanitize_*.py, and memcheck over calls with bad index
# values (sanitize_index.py: every guarded index must stay inside its tensor).
# Exits non-zero on any reported error. On a build with a reduced kernel set the
# call sets skip the calls whose kernels the build left out, and each one's last
# line (in its log) says how many (scripts/sanitize_calls.py).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
# The forward and backward calls run once per kernel design
# (FLASH_ATTN_FWD_KERNEL, FLASH_ATTN_BWD_KERNEL; on GPUs other than sm90 both
# runs take the SM80-design kernels).
sanitize() {  # name, log suffix, extra environment
  local script=scripts/$1.py suffix=$2 tools=${TOOLS:-memcheck racecheck} tool log rc
  for tool in $tools; do
    log=${RESULTS_DIR:-.}/sanitizer_${tool}_$suffix.log
    env "${@:3}" compute-sanitizer --tool "$tool" --error-exitcode 3 python3 "$script" >"$log" 2>&1
    rc=$?
    echo "$tool $suffix: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    [ $rc -ne 0 ] && status=1
  done
}
sanitize sanitize_fwd sanitize_fwd_sm80 FLASH_ATTN_FWD_KERNEL=sm80
sanitize sanitize_fwd sanitize_fwd_sm90 FLASH_ATTN_FWD_KERNEL=sm90
sanitize sanitize_bwd sanitize_bwd_sm80 FLASH_ATTN_BWD_KERNEL=sm80
sanitize sanitize_bwd sanitize_bwd_sm90 FLASH_ATTN_BWD_KERNEL=sm90
sanitize sanitize_kvcache sanitize_kvcache
sanitize sanitize_combine sanitize_combine
TOOLS=memcheck sanitize sanitize_index sanitize_index_sm80 FLASH_ATTN_FWD_KERNEL=sm80 FLASH_ATTN_BWD_KERNEL=sm80
TOOLS=memcheck sanitize sanitize_index sanitize_index_sm90 FLASH_ATTN_FWD_KERNEL=sm90 FLASH_ATTN_BWD_KERNEL=sm90
exit $status
