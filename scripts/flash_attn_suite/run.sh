#!/usr/bin/env bash
# Runs flash-attn's own test file (tests/test_flash_attn.py of flash-attn 2.x,
# downloaded by you) against flash_attn_cuda, through the name shim in shim/.
#
#   scripts/flash_attn_suite/run.sh [options] TEST_FILE [-- PYTEST_ARGS...]
#
#   --sample N        run about N cases in all, spread evenly over the test
#                     functions (default: every case)
#   --seed S          which sample --sample draws (default 0)
#   -n, --jobs N      pytest-xdist workers, 1 to 4 (default 4; 1 = no xdist)
#   -k EXPR           pytest's -k
#   --out DIR         summary.md, summary.json, failures.txt, junit.xml and
#                     pytest.log go there (default ./flash_attn_suite_out)
#   --max-minutes M   interrupt the run after M minutes; the summary still
#                     covers what ran (default: no limit)
#   --collect         only collect, and count the cases per test function
#
# flash_attn_cuda must be importable (installed, or built in place in this
# checkout). See README.md beside this script.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "flash_attn_suite: $*" >&2; exit 2; }

sample=0 seed=0 jobs=4 kexpr="" out="$PWD/flash_attn_suite_out" max_minutes="" collect=0 test_file=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sample) sample="${2:?--sample needs a number}"; shift 2 ;;
    --seed) seed="${2:?--seed needs a number}"; shift 2 ;;
    -n|--jobs) jobs="${2:?--jobs needs a number}"; shift 2 ;;
    -k) kexpr="${2:?-k needs an expression}"; shift 2 ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --max-minutes) max_minutes="${2:?--max-minutes needs a number}"; shift 2 ;;
    --collect) collect=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$test_file" ] || die "one test file only (got $test_file and $1)"; test_file="$1"; shift ;;
  esac
done
[ -n "$test_file" ] || { usage >&2; exit 2; }
[ -f "$test_file" ] || die "no such file: $test_file"
[[ "$sample" =~ ^[0-9]+$ ]] || die "--sample takes a whole number, got '$sample'"
[[ "$seed" =~ ^[0-9]+$ ]] || die "--seed takes a whole number, got '$seed'"
[[ "$jobs" =~ ^[1-4]$ ]] || die "--jobs takes 1 to 4, got '$jobs'"
[ -z "$max_minutes" ] || [[ "$max_minutes" =~ ^[0-9]+$ ]] || die "--max-minutes takes whole minutes"

mkdir -p "$out"
out="$(cd "$out" && pwd)"
rm -f "$out"/collected.json "$out"/summary.md "$out"/summary.json "$out"/failures.txt "$out"/junit.xml

# The shim first, so that `import flash_attn` finds it even where a real
# flash-attn is installed; then this script's folder for the pytest plugin.
# Imports are tried from / so that the current folder does not count (pytest
# runs in a folder of its own).
importable() { (cd / && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import $2") >/dev/null 2>&1; }
pythonpath="$here/shim:$here"
if ! importable "" flash_attn_cuda; then
  # An in-place build (python3 setup.py build_ext --inplace) of this checkout.
  if importable "$repo" flash_attn_cuda; then
    pythonpath="$pythonpath:$repo"
  else
    (cd / && PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import flash_attn_cuda") || true
    die "flash_attn_cuda does not import; build and install it first (README.md of the repository)"
  fi
fi
if importable "" einops; then
  einops_note="einops: installed"
else
  # The test file imports einops; without it, the small stand-in in einops_fallback/.
  pythonpath="$pythonpath:$here/einops_fallback"
  einops_note="einops: not installed, using scripts/flash_attn_suite/einops_fallback"
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

found="$(cd / && python3 -c 'import flash_attn, os; print(os.path.dirname(flash_attn.__file__))')"
[ "$found" = "$here/shim/flash_attn" ] || die "import flash_attn found $found instead of the shim"

xdist_args=()
if [ "$jobs" -gt 1 ] && [ "$collect" = 0 ]; then
  if importable "" xdist; then
    xdist_args=(-n "$jobs")
  else
    echo "flash_attn_suite: pytest-xdist is not installed; running in one process" >&2
  fi
fi

# A folder of its own: no conftest.py or pytest configuration of the place the
# file was downloaded to (or of this repository) applies.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$test_file" "$work/test_flash_attn.py"
printf '[pytest]\n' >"$work/pytest.ini"

args=(-p suite_plugin --suite-out "$out" --suite-sample "$sample" --suite-seed "$seed"
      -p no:cacheprovider -q -rfE --tb=short)
[ -z "$kexpr" ] || args+=(-k "$kexpr")
if [ "$collect" = 1 ]; then
  args+=(--collect-only)
else
  args+=("${xdist_args[@]}" --junitxml "$out/junit.xml")
fi

runner=()
if [ -n "$max_minutes" ]; then
  # SIGINT lets pytest finish the session and write the summary.
  runner=(timeout --signal=INT --kill-after=120 "${max_minutes}m")
fi

echo "flash_attn_suite: $test_file -> $out ($einops_note; ${xdist_args[*]:-no xdist})"
set +e
(cd "$work" && "${runner[@]}" python3 -m pytest "${args[@]}" test_flash_attn.py "$@") \
  2>&1 | tee "$out/pytest.log" | { if [ "$collect" = 1 ]; then grep -v '::'; else cat; fi; }
status=${PIPESTATUS[0]}
set -e

if [ "$collect" = 1 ] && [ -f "$out/collected.json" ]; then
  python3 - "$out/collected.json" <<'EOF' | tee "$out/collected.md"
import json, sys
counts = json.load(open(sys.argv[1]))["collected"]
print("| test function | cases |\n|---|---|")
for name, n in counts.items():
    print(f"| {name} | {n} |")
print(f"| **total** | {sum(counts.values())} |")
EOF
elif [ -f "$out/summary.md" ]; then
  echo "flash_attn_suite: summary in $out/summary.md (failing cases: $out/failures.txt)"
fi
exit "$status"
