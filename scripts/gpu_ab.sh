#!/usr/bin/env bash
# Same-run A/B of this checkout's working tree (B) against a git revision (A)
# on a machine with a GPU: builds both outside the checkout, then runs
# benchmarks/ab_builds.py (time B / A per case, and whether their outputs agree
# bit for bit).
#
#   scripts/gpu_ab.sh [--base REV | --base-tree DIR] [--rounds N] [--out FILE] [--providers P] \
#     -- BENCHMARK_ARGS...
#
# e.g. FLASH_ATTN_CUDA_HDIMS=128 FLASH_ATTN_CUDA_DTYPES=bf16 scripts/gpu_ab.sh -- \
#        --regimes train --dtypes bf16 --headdims 128 --modes fwd --seqlens 1024,8192
#
# REV (default HEAD) is exported with `git archive`, and the working tree is
# copied beside it, under AB_DIR (default /tmp/flash_attn_ab). A machine whose
# copy of the checkout has no git history takes the base as a folder instead:
# --base-tree DIR, e.g. made with `git archive main | tar -x -C .abbase` and
# carried to the machine (.abbase is left out of B's copy). Each tree builds
# with scripts/gpu_check.sh's build step (setup.py's choice of compiler) and its
# arch, the two at once, each with half of MAX_JOBS (default: the cores);
# FLASH_ATTN_CUDA_HDIMS / _DTYPES restrict both builds (one head dim and dtype:
# both in about 100 s on 16 cores). A second call on the same
# machine keeps both builds and recompiles what changed: the copy keeps the
# files' times, and the export gives every file REV's commit time. Build logs
# go to AB_DIR/logs_{a,b}/, the report to FILE (default AB_DIR/ab.json).
set -euo pipefail
cd "$(dirname "$0")/.."
base_rev=HEAD base_tree="" rounds=3 out="" providers=flash_attn_cuda
while [ $# -gt 0 ]; do
  case $1 in
    --base) base_rev=$2; shift 2 ;;
    --base-tree) base_tree=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --providers) providers=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "gpu_ab.sh: unknown argument '$1' (usage in the script's header)" >&2; exit 2 ;;
  esac
done
if [ -n "$base_tree" ] && [ ! -f "$base_tree/setup.py" ]; then
  echo "gpu_ab.sh: --base-tree '$base_tree' is not a source tree (no setup.py in it)" >&2
  exit 2
fi
ab=${AB_DIR:-/tmp/flash_attn_ab}
out=${out:-$ab/ab.json}
mkdir -p "$ab/a" "$ab/b"

# The CUTLASS wheel of an offline machine (.whl/, as scripts/gpu_check.sh).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$ab/site" .whl/*.whl
  export PYTHONPATH=$ab/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ -n "$base_tree" ]; then
  tar -c -C "$base_tree" --exclude=./build --exclude='*.so' . | tar -x -C "$ab/a"
  echo "gpu_ab: A = the tree in $base_tree, B = the working tree"
else
  git archive --format=tar "$base_rev" | tar -x -C "$ab/a"
  echo "gpu_ab: A = $(git rev-parse --short "$base_rev"), B = the working tree" \
    "($(git status --porcelain | wc -l) paths differ from HEAD)"
fi
# What a build does not need stays behind: git's folder, build outputs, the
# wheels, staged anchors and a base tree.
tar -c --exclude=./.git --exclude=./build --exclude='*.so' --exclude=./.whl --exclude=./.site \
  --exclude=./.anchors --exclude=./.abbase --exclude=./gpu_check_out . | tar -x -C "$ab/b"

# Both builds at once, each with half the jobs: one build's last, longest
# files leave most cores idle.
jobs=$(( ${MAX_JOBS:-$(nproc)} / 2 ))
declare -A pids
for side in a b; do
  MAX_JOBS=$(( jobs > 0 ? jobs : 1 )) RESULTS_DIR=$ab/logs_$side \
    bash "$ab/$side/scripts/gpu_check.sh" build > "$ab/build_$side.out" 2>&1 &
  pids[$side]=$!
done
for side in a b; do
  if ! wait "${pids[$side]}"; then
    echo "gpu_ab: build $side failed (its log: $ab/logs_$side/build.log)" >&2
    tail -30 "$ab/build_$side.out" >&2
    exit 1
  fi
  cat "$ab/build_$side.out"
done
python3 "$ab/b/benchmarks/ab_builds.py" --a "$ab/a" --b "$ab/b" --rounds "$rounds" --out "$out" \
  --providers "$providers" -- "$@"
