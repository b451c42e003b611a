#!/usr/bin/env bash
# Context parallelism on N GPUs of one host (issue #46), in one go:
#
#   scripts/run_context_parallel.sh OUT_DIR
#
#   for each world size N of NS:
#   1. correctness: scripts/context_parallel_check.py on N GPUs, our provider and
#      torch's built-in FLASH kernels (check_ours_wsN.json, check_builtin_wsN.json);
#   2. scaling: benchmarks/context_parallel_bench.py on N GPUs at SEQLEN total
#      tokens, ours and built-in (bench_ours_wsN.json, bench_builtin_wsN.json);
#   then, unless BASELINE=0:
#   3. the one-GPU baseline, no context parallelism, at the first of BASE_SEQLENS
#      that fits (bench_ours_ws1.json, bench_builtin_ws1.json);
#   then summary.md (scripts/context_parallel_summary.py: a table of every JSON
#   in OUT_DIR, so runs made in several calls can share one folder) and logs/.
#
# OUT_DIR is meant to be committed as benchmarks/results/<gpu>/context_parallel/.
# The extension must be built first (scripts/gpu_check.sh build), or set BUILD=1
# to build here only what these runs use (head dim 128, bf16; FLASH_ATTN_CUDA_HDIMS /
# FLASH_ATTN_CUDA_DTYPES override), which takes a minute or two more.
#
# Environment (defaults): PROVIDERS ("ours builtin"), NS (the number of GPUs
# visible; e.g. "2 4" on a 4-GPU host runs both world sizes on GPUs 0..N-1),
# SEQLEN (65536 * N for each N), BASELINE (1), BASE_SEQLENS
# ("131072 65536 32768"), CHECK_SEQLENS ("8192 4040"), BENCH_ARGS (extra
# arguments of every bench run, e.g. "--layers 2"), EXTRA_PROVIDERS (e.g. "cudnn":
# more bench runs beside ours and builtin), CHECK_TIMEOUT (180 s), BENCH_TIMEOUT
# (240 s), FLASH_ATTN_CUDA_COMMIT (recorded as the commit where .git is absent).
# The exit status is 1 when any step failed; every step runs regardless.
# DEVICE=cpu: the same steps at toy sizes on the CPU with gloo (N defaults to 2),
# our CPU kernels only (torch has no CPU kernel for the built-in runs): a smoke
# run of the driver itself, no GPU needed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:?usage: scripts/run_context_parallel.sh OUT_DIR}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)

# NVLink multicast stays off on the lent machines (the device docs say why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Both use the GPUs' threads, not the CPU's: keep torchrun's one-thread default quiet.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ls .whl/*.whl >/dev/null 2>&1; then  # an offline machine's nvidia-cutlass wheel
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
fi
[ -d .site ] && export PYTHONPATH=$ROOT/.site${PYTHONPATH:+:$PYTHONPATH}
# The checkout's package when it is (or is about to be) built in place, else the installed
# one, which an unbuilt checkout on PYTHONPATH would hide.
if [ "${BUILD:-0}" = 1 ] || ls flash_attn_cuda/_C.* >/dev/null 2>&1; then
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# The scripts record FLASH_ATTN_CUDA_COMMIT when set, else git's HEAD (+"-dirty").
COMMIT=${FLASH_ATTN_CUDA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "unknown (no .git)")}

if [ "${BUILD:-0}" = 1 ]; then
  FLASH_ATTN_CUDA_HDIMS=${FLASH_ATTN_CUDA_HDIMS:-128} FLASH_ATTN_CUDA_DTYPES=${FLASH_ATTN_CUDA_DTYPES:-bf16} \
    RESULTS_DIR="$OUT/logs/build" timeout 900 scripts/gpu_check.sh build || {
      echo "build failed: $OUT/logs/build/build.log"; exit 1; }
fi

DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then
  NS=${NS:-2}
  SEQ_PER_GPU=64
  BASE_SEQLENS=${BASE_SEQLENS:-128}
  CHECK_SEQLENS=${CHECK_SEQLENS:-64 36}
  CHECK_ARGS="--device cpu --dim 64 --heads 2 --batch 1"
  BENCH_ARGS="--device cpu --layers 1 --hidden 64 --head-dim 32 --vocab 64 ${BENCH_ARGS:-}"
  PROVIDERS=${PROVIDERS:-ours}
else
  NS=${NS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
  SEQ_PER_GPU=65536
  BASE_SEQLENS=${BASE_SEQLENS:-131072 65536 32768}
  CHECK_SEQLENS=${CHECK_SEQLENS:-8192 4040}
  CHECK_ARGS=""
  BENCH_ARGS=${BENCH_ARGS:-}
  PROVIDERS=${PROVIDERS:-ours builtin ${EXTRA_PROVIDERS:-}}
fi
CHECK_TIMEOUT=${CHECK_TIMEOUT:-180}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
if command -v torchrun >/dev/null 2>&1; then TORCHRUN=(torchrun); else TORCHRUN=(python3 -m torch.distributed.run); fi
for N in $NS; do
  [ "$N" -ge 2 ] || echo "warning: a world size of $N: the context-parallel runs use a mesh of $N"
done

{
  echo "start: $(date -u +%FT%TZ)  NS='$NS' SEQLEN=${SEQLEN:-$SEQ_PER_GPU per GPU} BASE_SEQLENS='$BASE_SEQLENS' commit=$COMMIT"
  echo "device: $DEVICE providers: $PROVIDERS"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>/dev/null
  nvidia-smi topo -m 2>/dev/null
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} >>"$OUT/logs/env.txt" 2>&1
cat "$OUT/logs/env.txt"

failed=()
step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name: $*"
  timeout --kill-after=20 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/logs/$name.log"
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  echo "$name rc=$rc seconds=$((SECONDS - start))" >>"$OUT/logs/steps.txt"
  [ $rc -eq 0 ] || failed+=("$name(rc=$rc)")
}

T0=$SECONDS
# shellcheck disable=SC2086
{
for N in $NS; do
  DIST=("${TORCHRUN[@]}" --standalone --nproc_per_node "$N")
  for provider in $PROVIDERS; do
    [ "$provider" = cudnn ] && continue  # the check compares FLASH kernels only
    step "check_${provider}_ws$N" "$CHECK_TIMEOUT" "${DIST[@]}" scripts/context_parallel_check.py \
      $CHECK_ARGS $([ "$provider" = builtin ] && echo --builtin) --seqlen $CHECK_SEQLENS \
      --out "$OUT/check_${provider}_ws$N.json"
  done
  [ "$N" -gt 1 ] || continue  # N=1: the baseline below is that run
  for provider in $PROVIDERS; do
    step "bench_${provider}_ws$N" "$BENCH_TIMEOUT" "${DIST[@]}" benchmarks/context_parallel_bench.py \
      --provider "$provider" --seqlen "${SEQLEN:-$((SEQ_PER_GPU * N))}" $BENCH_ARGS \
      --out "$OUT/bench_${provider}_ws$N.json"
  done
done
if [ "${BASELINE:-1}" = 1 ]; then
  for provider in $PROVIDERS; do
    step "bench_${provider}_ws1" "$BENCH_TIMEOUT" python3 benchmarks/context_parallel_bench.py \
      --provider "$provider" --seqlen $BASE_SEQLENS $BENCH_ARGS --out "$OUT/bench_${provider}_ws1.json"
  done
fi
}

python3 scripts/context_parallel_summary.py "$OUT" >"$OUT/summary.md" 2>"$OUT/logs/summary.err"
cat "$OUT/summary.md"
echo "total: $((SECONDS - T0)) s; results in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
