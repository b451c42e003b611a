#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the small forward, backward and KV-cache
# call sets in tests/sanitize_*.py. Exits non-zero on any reported error.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for script in tests/sanitize_fwd.py tests/sanitize_bwd.py tests/sanitize_kvcache.py; do
  for tool in memcheck racecheck; do
    log=${RESULTS_DIR:-.}/sanitizer_${tool}_$(basename "$script" .py).log
    compute-sanitizer --tool "$tool" --error-exitcode 3 python3 "$script" >"$log" 2>&1
    rc=$?
    echo "$tool $script: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    [ $rc -ne 0 ] && status=1
  done
done
exit $status
