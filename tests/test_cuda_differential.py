"""Seeded randomized differential test: the CUDA ops against the CPU ops.

Case i of a run is differential_cases.draw_case(base + i), drawn from
random.Random(base + i) alone (base from FLASH_ATTN_TEST_SEED, see
differential_cases.base_seed): fixed-length forward (+ backward), varlen
forward (+ backward, or paged; seqused_q), and fwd_kvcache (contiguous or paged
caches, appends, rotary, rotary_seqlens, cache_batch_idx, cache_leftpad, the last
two on paged caches too, num_splits), over head dims,
dtypes, GQA / MQA, causal / local windows, softcap, ALiBi, dropout (both paths
get the same Philox seed and offset, so their masks are the same), negative
scales and strided views. The CPU op is the reference of each case; the
tolerances come from plain torch in float64, float32 and the input dtype on
the GPU (see differential_cases.py).

The 2,000 cases run as 40 test items of 50 (`pytest -n 4` spreads them); a
failing item lists every mismatched seed with its drawn configuration, and

    FLASH_ATTN_DIFF_SEEDS=<seed>[,<seed>...] \
        python3 -m pytest -q tests/test_cuda_differential.py -k seeds

reruns just those. FLASH_ATTN_DIFF_CASES changes the number of cases. On a
build with a reduced kernel set, cases the build left out are skipped and
counted; an item whose cases were all left out is skipped.

Each item prints (shown with -rP or -s) how long its cases took: the CPU op,
the CUDA ops and the references. `python3 tests/differential_cases.py [sample]
[threads]` times the CPU op alone over a sample of the cases and extrapolates
to all of them.

The tests without the cuda mark run everywhere: they check that the generator
is seeded, draws only valid configurations, covers every feature it claims,
and that the CPU op accepts a sample of the drawn cases and meets the
criterion against the float64 reference there.
"""

import collections
import functools
import os
import time
import traceback

import pytest
import torch

import flash_attn_cuda  # noqa: F401  (registers torch.ops.flash_attn)
import differential_cases as dc
from reduced_build import left_out_reason

DEVICE = "cuda"
NUM_CASES = dc.case_count()
CHUNKS = range(-(-NUM_CASES // dc.CHUNK))
CPU_SAMPLE = 50
CPU_SAMPLE_PARTS = 5
CPU_SAMPLE_WORK_CAP = 6_000_000  # keep the CPU-only sample quick on a 2-core CI machine


def chunk_seeds(chunk):
    start = chunk * dc.CHUNK
    return [dc.base_seed() + i for i in range(start, min(start + dc.CHUNK, NUM_CASES))]


def chunk_id(chunk):
    start = chunk * dc.CHUNK
    return f"cases{start:04d}-{min(start + dc.CHUNK, NUM_CASES) - 1:04d}"


@pytest.fixture
def cpu_threads():
    """One share of the cores per pytest-xdist worker for the CPU op."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(workers, 1)))
    yield
    torch.set_num_threads(saved)


# ---------------------------------------------------------------------------
# CUDA against CPU
# ---------------------------------------------------------------------------


def check_case_on_cuda(c, timings):
    """The mismatches of case c (a list of strings); raises dc.LeftOut when the
    build left the case's kernel out."""
    inputs = dc.build_inputs(c)
    t0 = time.perf_counter()
    try:
        cpu = dc.run_ops(c, inputs, "cpu")
    except Exception as error:  # a drawn case the CPU op refuses is a generator bug
        return [f"CPU op raised: {type(error).__name__}: {str(error).splitlines()[0]}"]
    t1 = time.perf_counter()
    try:
        with dc.kernel_env(c):
            cuda = dc.run_ops(c, inputs, DEVICE, repeat=c["deterministic"])
    except RuntimeError as error:
        reason = left_out_reason(error, flash_attn_cuda.build_info)
        if reason is not None:
            raise dc.LeftOut(reason) from None
        return [f"CUDA op raised: {type(error).__name__}: {str(error).splitlines()[0]}"]
    t2 = time.perf_counter()
    refs = dc.references(c, inputs, DEVICE)  # on the CPU once they are back
    t3 = time.perf_counter()
    timings["cpu_op"] += t1 - t0
    timings["cuda_op"] += t2 - t1
    timings["references"] += t3 - t2
    return dc.compare(c, inputs, cuda, cpu, refs)


def run_seeds(seeds, record_property=None):
    timings = collections.Counter()
    failures, left_out = [], []
    started = time.perf_counter()
    for seed in seeds:
        c = dc.draw_case(seed)
        try:
            problems = check_case_on_cuda(c, timings)
        except dc.LeftOut as refusal:
            left_out.append((seed, str(refusal)))
            continue
        except Exception:
            problems = ["raised:\n" + traceback.format_exc(limit=6)]
        if problems:
            failures.append((c, problems))
    elapsed = time.perf_counter() - started
    summary = (
        f"{len(seeds)} cases in {elapsed:.1f} s (CPU op {timings['cpu_op']:.1f} s, CUDA ops "
        f"{timings['cuda_op']:.1f} s, references {timings['references']:.1f} s); "
        f"{len(left_out)} left out by this build; {len(failures)} mismatched"
    )
    print(summary)
    if record_property is not None:
        record_property("differential_summary", summary)
        record_property("left_out", len(left_out))
    if failures:
        lines = [
            f"{len(failures)} of {len(seeds)} cases mismatched "
            f"({len(left_out)} left out by this build):"
        ]
        for c, problems in failures:
            lines.append("  " + dc.describe(c))
            lines.extend("      " + p for p in problems[:6])
        seeds_text = ",".join(str(c["seed"]) for c, _ in failures)
        lines.append(
            f"rerun them alone: FLASH_ATTN_DIFF_SEEDS={seeds_text} "
            "python3 -m pytest -q tests/test_cuda_differential.py -k seeds"
        )
        pytest.fail("\n".join(lines), pytrace=False)
    if left_out and len(left_out) == len(seeds):
        pytest.skip(f"all {len(seeds)} cases left out by this build, e.g. {left_out[0][1]}")


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", CHUNKS, ids=chunk_id)
def test_cuda_matches_cpu(chunk, cpu_threads, record_property):
    run_seeds(chunk_seeds(chunk), record_property)


@pytest.mark.cuda
def test_cuda_matches_cpu_seeds(cpu_threads, record_property):
    """The cases named by FLASH_ATTN_DIFF_SEEDS (comma-separated seeds)."""
    text = os.environ.get("FLASH_ATTN_DIFF_SEEDS", "").strip()
    if not text:
        pytest.skip("set FLASH_ATTN_DIFF_SEEDS to the seeds to rerun")
    run_seeds([int(s) for s in text.split(",") if s.strip()], record_property)


# ---------------------------------------------------------------------------
# The generator itself (CPU only)
# ---------------------------------------------------------------------------


def drawn_cases(n=dc.DEFAULT_CASES):
    return [dc.draw_case(dc.base_seed() + i) for i in range(n)]


def _same_tensors(a, b):
    """Bitwise equal (NaN included), recursing into dicts."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tensors(a[n], b[n]) for n in a)
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(dc._bits(a), dc._bits(b))
    return a == b


def test_draw_is_a_function_of_the_seed():
    for i in range(0, 600, 20):
        seed = dc.base_seed() + i
        assert dc.draw_case(seed) == dc.draw_case(seed)
        assert _same_tensors(
            dc.build_inputs(dc.draw_case(seed)), dc.build_inputs(dc.draw_case(seed))
        ), seed
    assert dc.draw_case(1) != dc.draw_case(2)


def test_drawn_cases_are_valid_and_cover_every_feature():
    cases = drawn_cases()
    invalid = [(c["seed"], bad) for c in cases for bad in [dc.validate(c)] if bad]
    assert not invalid, f"invalid drawn cases: {invalid[:10]}"
    counts = dc.coverage(cases)
    print("feature coverage over", len(cases), "cases:")
    for name, n in sorted(counts.items()):
        print(f"  {name}: {n}")
    short = {
        name: counts[name]
        for name in dc.REQUIRED_FEATURES
        if counts[name] < (dc.MIN_COVERAGE_RARE if name in dc.RARE_FEATURES else dc.MIN_COVERAGE)
    }
    assert not short, f"features drawn too rarely: {short}"


@functools.lru_cache(maxsize=1)
def cpu_sample():
    """CPU_SAMPLE cheap cases of the 2,000, picked greedily to cover the most
    feature tags (each pick adds the most tags not covered yet)."""
    candidates = [c for c in drawn_cases() if dc.work_units(c) <= CPU_SAMPLE_WORK_CAP]
    tags = {c["seed"]: dc.features(c) for c in candidates}
    covered, picked = set(), []
    for _ in range(CPU_SAMPLE):
        best = max(
            (c for c in candidates if c not in picked),
            key=lambda c: (len(tags[c["seed"]] - covered), -c["seed"]),
        )
        picked.append(best)
        covered |= tags[best["seed"]]
    return picked


@pytest.mark.parametrize("part", range(CPU_SAMPLE_PARTS))
def test_cpu_op_accepts_drawn_cases_and_meets_the_criterion(part, cpu_threads):
    sample = cpu_sample()[part::CPU_SAMPLE_PARTS]
    failures = []
    for c in sample:
        inputs = dc.build_inputs(c)
        try:
            got = dc.run_ops(c, inputs, "cpu")
        except Exception as error:
            failures.append(f"{dc.describe(c)}\n      CPU op raised: {error}")
            continue
        refs = dc.references(c, inputs, "cpu")
        problems = dc.compare(c, inputs, got, dc.reference_as_result(c, refs), refs)
        if problems:
            failures.append(dc.describe(c) + "".join("\n      " + p for p in problems))
    assert not failures, "\n".join(failures)
