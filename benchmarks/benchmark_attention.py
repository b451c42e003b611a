#!/usr/bin/env python3
"""Attention speed, decode bandwidth and memory: flash_attn_cuda against PyTorch.

    python benchmarks/benchmark_attention.py --quick    # a small subset, about a minute
    python benchmarks/benchmark_attention.py            # the whole grid, several minutes

On a GPU it measures flash_attn_cuda against F.scaled_dot_product_attention pinned
to each of its backends (flash, cuDNN, memory-efficient, math), flex_attention
under torch.compile and, where flash_attn.cute imports, FlashAttention-4. Without
a GPU it measures flash_attn_cuda's CPU path against SDPA on the CPU. Results go
to results.json and PNG plots in --out (default benchmarks/results/<device name>/).
The training regime also measures head-dim pairs (d_qk, d_v) whose v is narrower
than q and k, DeepSeek-MLA's (192, 128) by default (--headdim-pairs), in tables of
their own. benchmarks/README.md explains every option and column.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
# The rule that tells a reduced build's refusal of a left-out head dim or dtype
# (FLASH_ATTN_CUDA_HDIMS / _DTYPES) from an error, shared with the tests.
sys.path.insert(1, os.path.join(BENCH_DIR, "..", "tests"))
from reduced_build import left_out_reason  # noqa: E402

OURS = "flash_attn_cuda"
SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}
GPU_PROVIDERS = [OURS, "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex"]
# FlashAttention-4 (flash_attn.cute), an anchor that is never a dependency: it joins
# the GPU default providers only where it imports (see gpu_default_providers).
FA4 = "fa4"
# Measured only when named in --providers: this project's backward with
# deterministic=True (the cost of bitwise-reproducible gradients). FA4's
# deterministic backward, its anchor, comes along wherever FA4 imports.
OURS_DETERMINISTIC = "flash_attn_cuda_deterministic"
FA4_DETERMINISTIC = "fa4_deterministic"
# Measured only when named in --providers: this project's kernels with dropout at
# DROPOUT_P, whose ratio to flash_attn_cuda is what dropout costs (issue 57). No
# anchor draws the same mask (FA3 / FA4 have no dropout, cuDNN only p in 1/16ths).
OURS_DROPOUT = "flash_attn_cuda_dropout"
DROPOUT_P = 0.1
# Measured only when named in --providers: decode over a float8_e4m3fn KV cache
# holding the same values (descales of 1), whose ratio to flash_attn_cuda is
# what the e4m3 cache saves (issue 58, docs/fp8.md).
OURS_FP8KV = "flash_attn_cuda_fp8kv"
# Measured only when named in --providers: FP8 attention, q, k and v in
# float8_e4m3fn holding the training inputs' values rounded (descales of 1),
# bfloat16 out, forward only (issue 58; FA3 publishes about 1.2 PFLOP/s on an
# H100). Its FLOPs are counted as the 16-bit call's.
OURS_FP8 = "flash_attn_cuda_fp8"
# Known on a GPU beyond GPU_PROVIDERS: FA4 (a default where it imports), the
# deterministic backwards, dropout, the e4m3 cache and FP8 attention.
GPU_OPTIONAL_PROVIDERS = [
    FA4,
    OURS_DETERMINISTIC,
    FA4_DETERMINISTIC,
    OURS_DROPOUT,
    OURS_FP8KV,
    OURS_FP8,
]
CPU_PROVIDERS = [OURS, "sdpa_cpu"]
CPU_OPTIONAL_PROVIDERS = [OURS_DROPOUT, OURS_FP8KV, OURS_FP8]
# This project's rows, on which the exit status gates.
OWN_PROVIDERS = {OURS, OURS_DETERMINISTIC, OURS_DROPOUT, OURS_FP8KV, OURS_FP8}
DETERMINISTIC_PROVIDERS = {OURS_DETERMINISTIC, FA4_DETERMINISTIC}
# The row a provider's ratio is taken against: a deterministic anchor against our
# deterministic backward, every other provider against our default kernels.
REFERENCE_OF = {FA4_DETERMINISTIC: OURS_DETERMINISTIC}
# FA4 is a training anchor: no KV-cache call, and its memory is not the question;
# dropout is a training feature.
TRAIN_ONLY = {FA4, FA4_DETERMINISTIC, OURS_DROPOUT, OURS_FP8}
# Forward only: FP8 attention has no backward.
FWD_ONLY = {OURS_FP8}
# flex_attention would need one compile per decode shape for little insight;
# decode has no backward, so the deterministic variant is the plain one.
DECODE_EXCLUDED = {"flex", OURS_DETERMINISTIC} | TRAIN_ONLY
# The e4m3 cache is a KV-cache call only.
DECODE_ONLY = {OURS_FP8KV}
MEMORY_EXCLUDED = TRAIN_ONLY | DECODE_ONLY

MODES = ["fwd", "bwd", "fwd_bwd"]
# FLOPs of each mode as a multiple of the forward pass (flash-attn's convention).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REGIMES = ["train", "decode", "memory", "paged_prefill"]

ROW_KEYS = [
    "gpu",
    "torch",
    "cuda",
    "dtype",
    "headdim",
    "headdim_v",
    "causal",
    "seqlen_q",
    "seqlen_k",
    "batch",
    "nheads",
    "nheads_k",
    "mode",
    "provider",
    "ms",
    "tflops",
    "gbps",
    "peak_mem_bytes",
    "error",
    "note",
    "ms_rounds",
]

# Warnings that mean flex_attention ran eagerly instead of as a compiled kernel.
FLEX_EAGER_MARKERS = ("without torch.compile", "unfused implementation")
# Errors after which the CUDA context is unusable for the rest of the process.
STICKY_CUDA_MARKERS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "an illegal",
)
GIB = float(1 << 30)
# Largest K cache whose output is cross-checked against SDPA in the decode regime.
CHECK_MAX_CACHE_BYTES = 1 << 30
MIB = float(1 << 20)


# ----------------------------------------------------------------------------
# Grids


@dataclass
class Grid:
    """Every shape one run measures."""

    dtypes: list
    headdims: list
    causals: list
    modes: list
    seqlens: list
    # Training shapes keep batch * seqlen = tokens and nheads * headdim = hidden.
    tokens: int
    hidden: int
    decode_seqlens_q: list
    decode_seqlens_k: list
    decode_batches: list
    decode_nheads: int = 32
    decode_nheads_k: int = 8
    decode_headdim: int = 128
    decode_dtype: str = "bf16"
    decode_page_sizes: list = field(default_factory=list)
    # Absorbed MLA decode cases beside the regular ones (--decode-mla): 128
    # query heads over one latent head of 576 columns, v_cache = k_cache[..., :512].
    decode_mla: bool = False
    memory_seqlens: list = field(default_factory=list)
    memory_batch: int = 1
    memory_nheads: int = 16
    memory_headdim: int = 128
    memory_dtype: str = "bf16"
    # Chunked prefill through a paged KV cache: (batch, q_chunk, context) per case,
    # the q_chunk new rows being the last of context keys (causal, bottom-right).
    prefill_shapes: list = field(default_factory=list)
    prefill_page_sizes: list = field(default_factory=list)
    prefill_nheads: int = 32
    prefill_nheads_k: int = 8
    prefill_headdim: int = 128
    prefill_dtype: str = "bf16"
    # nheads / nheads_k of every training shape (1: MHA; 4: GQA 4:1, e.g. 16 query
    # heads over 4 kv heads at head dim 128).
    kv_ratios: list = field(default_factory=lambda: [1])
    # GQA shapes on top of those: (headdim, ratio) pairs, at gqa_seqlens (None: every seqlen).
    gqa_cells: list = field(default_factory=list)
    gqa_seqlens: Optional[list] = None
    # Training shapes whose v has a smaller head dim than q and k: (d_qk, d_v) pairs,
    # e.g. DeepSeek-MLA's (192, 128) (issue 56), with nheads = hidden // d_v and no GQA.
    headdim_pairs: list = field(default_factory=list)

    def train_kv_ratios(self, headdim: int, seqlen: int) -> list:
        ratios = list(self.kv_ratios)
        if self.gqa_seqlens is None or seqlen in self.gqa_seqlens:
            ratios += [r for d, r in self.gqa_cells if d == headdim and r not in ratios]
        return ratios


def pow2_range(lo: int, hi: int) -> list:
    values = []
    n = lo
    while n <= hi:
        values.append(n)
        n *= 2
    return values


def gpu_grid(quick: bool) -> Grid:
    if quick:
        return Grid(
            dtypes=["bf16"],
            headdims=[128],
            causals=[False, True],
            modes=list(MODES),
            seqlens=[2048, 8192],
            tokens=16384,
            hidden=2048,
            decode_seqlens_q=[1],
            decode_seqlens_k=[8192, 65536],
            decode_batches=[1, 16],
            memory_seqlens=[8192, 32768],
            prefill_shapes=[(4, 512, 4096), (4, 2048, 16384)],
            prefill_page_sizes=[1, 16, 64, 256],
            gqa_cells=[(128, 4)],
            gqa_seqlens=[8192],
            headdim_pairs=[(192, 128)],
        )
    return Grid(
        dtypes=["bf16", "fp16"],
        headdims=[64, 128, 256],
        causals=[False, True],
        modes=list(MODES),
        seqlens=pow2_range(512, 16384),
        tokens=16384,
        hidden=2048,
        decode_seqlens_q=[1, 4],
        decode_seqlens_k=pow2_range(4096, 131072),
        decode_batches=[1, 4, 16, 64],
        memory_seqlens=pow2_range(1024, 65536),
        prefill_shapes=[(4, 512, 4096), (4, 2048, 16384), (8, 128, 8192), (2, 4096, 4096)],
        prefill_page_sizes=[1, 16, 64, 256],
        # The issue's GQA training cells: 16 query heads over 4 kv heads.
        gqa_cells=[(128, 4)],
        # DeepSeek-MLA's head dims: q and k 192, v 128, 16 heads.
        headdim_pairs=[(192, 128)],
    )


def cpu_grid(quick: bool) -> Grid:
    # Small enough for two cores: one batch, a few heads, short sequences.
    if quick:
        return Grid(
            dtypes=["fp32", "bf16"],
            headdims=[64],
            causals=[False, True],
            modes=["fwd", "fwd_bwd"],
            seqlens=[128, 256],
            tokens=512,
            hidden=256,
            decode_seqlens_q=[1],
            decode_seqlens_k=[2048],
            decode_batches=[1],
            decode_nheads=8,
            decode_nheads_k=2,
            decode_headdim=64,
            decode_dtype="fp32",
            prefill_shapes=[(2, 16, 64)],
            prefill_page_sizes=[1, 16],
            prefill_dtype="fp32",
            # A small d_v < d_qk pair: a machine without a GPU walks that path too.
            headdim_pairs=[(64, 32)],
        )
    return Grid(
        dtypes=["fp32", "bf16"],
        headdims=[64, 128],
        causals=[False, True],
        modes=list(MODES),
        seqlens=pow2_range(128, 2048),
        tokens=2048,
        hidden=256,
        decode_seqlens_q=[1, 4],
        decode_seqlens_k=[1024, 4096, 16384],
        decode_batches=[1, 4],
        decode_nheads=8,
        decode_nheads_k=2,
        decode_headdim=64,
        decode_dtype="fp32",
        prefill_shapes=[(2, 16, 64), (1, 32, 128)],
        prefill_page_sizes=[1, 16],
        prefill_dtype="fp32",
    )


def standin_grid() -> Grid:
    """Tiny shapes that walk the GPU code paths on the CPU (numbers meaningless)."""
    return Grid(
        dtypes=["fp32"],
        headdims=[32],
        causals=[False, True],
        modes=list(MODES),
        seqlens=[64, 128],
        tokens=128,
        hidden=64,
        decode_seqlens_q=[1, 4],
        decode_seqlens_k=[256],
        decode_batches=[1, 2],
        decode_nheads=8,
        decode_nheads_k=2,
        decode_headdim=32,
        decode_dtype="fp32",
        decode_page_sizes=[16, 256],
        memory_seqlens=[64, 128],
        memory_nheads=2,
        memory_headdim=32,
        memory_dtype="fp32",
        # 100 keys: the last page of each page size is partly filled.
        prefill_shapes=[(2, 16, 64), (1, 32, 128), (2, 8, 100)],
        prefill_page_sizes=[1, 16],
        prefill_dtype="fp32",
        # Two query heads over one kv head: walks the GQA training path.
        gqa_cells=[(32, 2)],
        gqa_seqlens=[64],
        # v narrower than q and k: walks every provider's d_v < d_qk path.
        headdim_pairs=[(32, 16)],
    )


# ----------------------------------------------------------------------------
# Environment


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


def describe_environment(device: torch.device) -> dict:
    meta = {
        "device": device.type,
        "gpu": None,
        "torch": torch.__version__,
        "cuda": None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(
            gpu=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            gpu_memory_bytes=props.total_memory,
        )
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    ours, error = load_ours()
    if ours is not None:
        meta["flash_attn_cuda"] = getattr(ours, "__version__", "unknown")
        meta["flash_attn_cuda_cuda_built"] = getattr(ours, "cuda_built", None)
    else:
        meta["flash_attn_cuda"] = None
        meta["flash_attn_cuda_error"] = error
    return meta


_ours_cache: dict = {}


def load_ours():
    """(module, None) when flash_attn_cuda imports, else (None, reason)."""
    if "result" not in _ours_cache:
        try:
            import flash_attn_cuda

            _ours_cache["result"] = (flash_attn_cuda, None)
        except Exception as exc:  # a missing or stale build must not stop the run
            _ours_cache["result"] = (None, f"import flash_attn_cuda failed: {first_line(exc)}")
    return _ours_cache["result"]


def ours_op(name: str, device: torch.device):
    module, error = load_ours()
    if module is None:
        raise Unavailable(error)
    op = getattr(module, name, None)
    if op is None:
        raise Unavailable(f"flash_attn_cuda has no {name}")
    if device.type == "cuda" and getattr(module, "cuda_built", True) is False:
        raise Unavailable("flash_attn_cuda was built without its CUDA kernels")
    return op


_fa4_cache: dict = {}


def load_fa4():
    """(flash_attn.cute.flash_attn_func, None) when FlashAttention-4 imports, else (None, reason).

    Imported here and nowhere else: FA4 is an anchor of this benchmark, never a
    dependency of the package."""
    if "result" not in _fa4_cache:
        try:
            from flash_attn.cute import flash_attn_func

            _fa4_cache["result"] = (flash_attn_func, None)
        except Exception as exc:  # not staged here, or a broken install: rows say which
            _fa4_cache["result"] = (
                None,
                f"FA4 unavailable: from flash_attn.cute import flash_attn_func failed: "
                f"{first_line(exc)} (benchmarks/README.md says how to stage it)",
            )
    return _fa4_cache["result"]


def fa4_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("flash-attn-4")
    except Exception:
        module = sys.modules.get("flash_attn")
        return getattr(module, "__version__", None)


def gpu_default_providers() -> list:
    """The GPU providers measured without --providers: FA4 only where it imports, so
    that a machine without it gets no column of errors."""
    fa4, _ = load_fa4()
    return GPU_PROVIDERS + ([FA4] if fa4 is not None else [])


def with_paired_anchors(providers: list) -> list:
    """FA4's deterministic backward follows ours wherever FA4 imports: ours alone
    would have nothing to be held against."""
    if OURS_DETERMINISTIC not in providers or FA4_DETERMINISTIC in providers:
        return providers
    if load_fa4()[0] is None:
        return providers
    i = providers.index(OURS_DETERMINISTIC)
    return providers[: i + 1] + [FA4_DETERMINISTIC] + providers[i + 1 :]


# ----------------------------------------------------------------------------
# Errors and helpers


class Unavailable(Exception):
    """The provider cannot run this case here (missing op, would not fit, ...)."""


class FellBack(Exception):
    """The provider ran, but not as the implementation it claims to be."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    detail = [ln for ln in lines if ln.startswith("Developer debug context:")]
    text = lines[0] if lines else text
    if detail:
        # torch.compile puts the real cause of a graph break on a later line.
        text = f"{text} ({detail[0][len('Developer debug context:') :].strip()})"
    if not text.startswith(type(exc).__name__):
        text = f"{type(exc).__name__}: {text}"
    return text[:limit]


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return "out of memory" in str(exc).lower()


def is_sticky_cuda_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in STICKY_CUDA_MARKERS)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# After the allocator hands tens of GB back to the driver, the GPU streams
# memory slower for a while: on the H200, a decode kernel measured right after
# 86 GB were released ran 154 us for about 0.2 s, then 137 us on the same
# tensors (43 GB: under 0.05 s). Whichever provider was timed first in the
# next case paid for it, so release_memory waits 10 ms per GB released, a
# few times that settling time.
SETTLE_S_PER_GB = 0.01


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        released = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        torch.cuda.empty_cache()
        if released >= 1 << 30:
            torch.cuda.synchronize(device)
            time.sleep(min(1.0, SETTLE_S_PER_GB * released / 1e9))


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def require_fits(nbytes: float, device: torch.device, what: str) -> None:
    free = free_bytes(device)
    if nbytes > 0.9 * free:
        raise Unavailable(
            f"skipped: {what} needs about {nbytes / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
        )


def random_tensor(shape, dtype, device, requires_grad=False) -> torch.Tensor:
    # Random normal inputs: zeros would let a kernel skip work or hide a bug.
    t = torch.randn(shape, dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


def attention_flops(
    batch, nheads, seqlen_q, seqlen_k, headdim, causal, mode, headdim_v=None
) -> float:
    """Q K^T costs 2 * d_qk and P V 2 * d_v FLOPs per (query, key) pair: 4 * d when
    v has the head dim of q and k (headdim_v None)."""
    headdim_v = headdim if headdim_v is None else headdim_v
    fwd = 2.0 * batch * nheads * seqlen_q * seqlen_k * (headdim + headdim_v)
    if causal:
        fwd /= 2.0
    return fwd * MODE_FLOP_FACTOR[mode]


def prefill_flops(batch, nheads, q_chunk, context, headdim) -> float:
    """Forward FLOPs of a causal chunk: the last q_chunk of context rows, bottom-right
    aligned, so query row i sees context - q_chunk + i + 1 keys (not half of them)."""
    pairs = q_chunk * (context - q_chunk) + q_chunk * (q_chunk + 1) / 2.0
    return 4.0 * batch * nheads * headdim * pairs


# ----------------------------------------------------------------------------
# Timing and memory


class Timer:
    """Median wall time of fn() in milliseconds, the same method for every provider."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float, cpu_budget_s: float):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.cpu_budget_s = cpu_budget_s
        self._do_bench = None
        self._median_kwargs = {}
        self._flush = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench

                params = inspect.signature(do_bench).parameters
                self._do_bench = do_bench
                if "return_mode" in params:
                    self._median_kwargs = {"return_mode": "median"}
                else:
                    self._median_kwargs = {"quantiles": [0.5]}
            except Exception:
                self._do_bench = None

    def describe(self) -> str:
        if self.device.type != "cuda":
            return (
                f"time.perf_counter, median of runs within {self.cpu_budget_s}s after "
                f"{self.cpu_budget_s / 4:g}s of warm-up"
            )
        if self._do_bench is not None:
            return (
                f"triton.testing.do_bench(warmup={self.warmup_ms}ms, rep={self.rep_ms}ms, "
                f"{self._median_kwargs}), CUDA events, L2 flushed before each run"
            )
        return (
            f"CUDA events, median after {self.warmup_ms}ms warm-up over {self.rep_ms}ms, "
            "L2 flushed before each run"
        )

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            return self._cpu_median(fn)
        if self._do_bench is not None:
            result = self._do_bench(
                fn, warmup=self.warmup_ms, rep=self.rep_ms, **self._median_kwargs
            )
            if isinstance(result, (list, tuple)):
                result = result[0]
            return float(result)
        return self._cuda_event_median(fn)

    def _cpu_median(self, fn) -> float:
        # Warm up for a quarter of the budget: the first calls also start thread pools.
        warm_until = time.perf_counter() + self.cpu_budget_s / 4
        fn()
        while time.perf_counter() < warm_until:
            fn()
        times = []
        deadline = time.perf_counter() + self.cpu_budget_s
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def _cuda_event_median(self, fn) -> float:
        # Same shape as triton's do_bench: flush L2 (256 MB write) before every
        # run so that no provider profits from the previous run's cache.
        if self._flush is None:
            self._flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=self.device)
        fn()
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            self._flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize(self.device)
        estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
        n_warmup = max(1, int(self.warmup_ms / estimate_ms))
        n_repeat = max(5, min(10000, int(self.rep_ms / estimate_ms)))
        for _ in range(n_warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        for i in range(n_repeat):
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def peak_extra_bytes(fn, device: torch.device) -> Optional[int]:
    """Peak allocated bytes during fn() above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return int(peak)


def measure_copy_bandwidth(device: torch.device, timer: Timer) -> Optional[float]:
    """GB/s of a large device-to-device copy, counting bytes read + written."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    try:
        src = torch.randint(0, 127, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = timer(lambda: dst.copy_(src))
        return 2.0 * nbytes / (ms * 1e-3) / 1e9
    except Exception as exc:
        print(f"copy bandwidth not measured: {first_line(exc)}", flush=True)
        return None
    finally:
        release_memory(device)


# ----------------------------------------------------------------------------
# Providers


@dataclass
class Shape:
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    # The head dim of v when it is smaller than q's and k's; None: headdim.
    headdim_v: Optional[int] = None

    @property
    def dv(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v


@dataclass
class Prepared:
    """A provider's inputs, built once per shape, and how to call it."""

    forward: Callable[[], torch.Tensor]
    grad_inputs: tuple = ()
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    fallback_markers: tuple = ()
    note: Optional[str] = None
    extra: dict = field(default_factory=dict)


def _sdpa_backend(provider: str):
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        raise Unavailable(f"torch.nn.attention.sdpa_kernel missing: {exc}")
    backend = getattr(SDPBackend, SDPA_BACKENDS[provider], None)
    if backend is None:
        raise Unavailable(f"SDPBackend.{SDPA_BACKENDS[provider]} missing in this torch")
    return lambda: sdpa_kernel([backend])


def _math_bytes(shape: Shape, with_grad: bool) -> float:
    # The math backend materialises (batch, nheads, seqlen_q, seqlen_k) scores,
    # probabilities and, for the backward pass, their gradients; count fp32.
    elements = float(shape.batch) * shape.nheads * shape.seqlen_q * shape.seqlen_k
    return elements * 4.0 * (4 if with_grad else 2)


def configure_compile_for_flex() -> None:
    """Make torch.compile fail loudly rather than silently run flex eagerly."""
    import torch._dynamo

    dynamo = torch._dynamo.config
    settings = {
        "recompile_limit": 4096,  # older torch: cache_size_limit
        "cache_size_limit": 4096,
        "accumulated_recompile_limit": 65536,
        "accumulated_cache_size_limit": 65536,
        "fail_on_recompile_limit_hit": True,
        "suppress_errors": False,
    }
    for name, value in settings.items():
        if hasattr(dynamo, name):
            try:
                setattr(dynamo, name, value)
            except Exception:
                pass
    try:
        # Donated buffers forbid backward(retain_graph=True), which the bwd mode uses.
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
    except Exception:
        pass


def build_train(provider: str, shape: Shape, device: torch.device, with_grad: bool) -> Prepared:
    dtype = DTYPES[shape.dtype]
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    h, hk, d = shape.nheads, shape.nheads_k, shape.headdim
    dv = shape.dv  # v, and so the output and its gradient, has dv columns
    gqa = h != hk

    if provider in (FA4, FA4_DETERMINISTIC):
        attn, error = load_fa4()
        if attn is None:
            raise Unavailable(error)
        deterministic = provider == FA4_DETERMINISTIC
        q = random_tensor((b, sq, h, d), dtype, device, with_grad)
        k = random_tensor((b, sk, hk, d), dtype, device, with_grad)
        v = random_tensor((b, sk, hk, dv), dtype, device, with_grad)

        def fa4_forward():
            # It returns (out, lse); GQA is its k / v with fewer heads, as for ours.
            result = attn(q, k, v, causal=shape.causal, deterministic=deterministic)
            return result[0] if isinstance(result, (tuple, list)) else result

        prepared = Prepared(forward=fa4_forward, grad_inputs=(q, k, v))
        # Besides catching a wrong anchor, the check's forward and backward calls
        # compile FA4's kernels for this shape before any timing starts.
        prepared.extra.update(check_against_sdpa(prepared.forward, q, k, v, shape))
        return prepared

    if provider == OURS_FP8:
        attn = ours_op("flash_attn_func", device)
        fp8 = torch.float8_e4m3fn
        q, k, v = (
            random_tensor(size, dtype, device, False).to(fp8)
            for size in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, dv))
        )
        prepared = Prepared(forward=lambda: attn(q, k, v, causal=shape.causal), grad_inputs=())
        prepared.note = "float8_e4m3fn q, k, v; bfloat16 out"
        # SDPA on the same values in bfloat16 (every e4m3 value is one).
        exact = [t.to(torch.bfloat16) for t in (q, k, v)]
        prepared.extra.update(check_against_sdpa(prepared.forward, *exact, shape))
        return prepared

    if provider in (OURS, OURS_DETERMINISTIC, OURS_DROPOUT):
        attn = ours_op("flash_attn_func", device)
        deterministic = provider == OURS_DETERMINISTIC
        dropout_p = DROPOUT_P if provider == OURS_DROPOUT else 0.0
        q = random_tensor((b, sq, h, d), dtype, device, with_grad)
        k = random_tensor((b, sk, hk, d), dtype, device, with_grad)
        v = random_tensor((b, sk, hk, dv), dtype, device, with_grad)
        prepared = Prepared(
            forward=lambda: attn(
                q, k, v, dropout_p=dropout_p, causal=shape.causal, deterministic=deterministic
            ),
            grad_inputs=(q, k, v),
        )
        if dropout_p:
            prepared.note = f"dropout_p={dropout_p}"
            prepared.extra.update(check_dropout(attn, q, k, v, shape, dropout_p))
        else:
            # The digests let ab_builds.py tell whether two builds agree bit for bit.
            prepared.extra.update(check_against_sdpa(prepared.forward, q, k, v, shape, digest=True))
        return prepared

    if shape.causal and sq != sk and provider != "flex":
        # SDPA's is_causal is aligned to the top-left corner, ours to the bottom-right.
        raise Unavailable(
            "SDPA is_causal is top-left aligned; not comparable when seqlen_q != seqlen_k"
        )

    q = random_tensor((b, h, sq, d), dtype, device, with_grad)
    k = random_tensor((b, hk, sk, d), dtype, device, with_grad)
    v = random_tensor((b, hk, sk, dv), dtype, device, with_grad)
    sdpa_kwargs = {"is_causal": shape.causal}
    if gqa:
        sdpa_kwargs["enable_gqa"] = True

    if provider in SDPA_BACKENDS:
        if provider == "sdpa_math":
            require_fits(
                _math_bytes(shape, with_grad), device, "the math backend's attention matrix"
            )
        return Prepared(
            forward=lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs),
            grad_inputs=(q, k, v),
            context=_sdpa_backend(provider),
        )
    if provider == "sdpa_cpu":
        return Prepared(
            forward=lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs),
            grad_inputs=(q, k, v),
        )
    if provider == "flex":
        return build_flex(q, k, v, shape, device)
    raise Unavailable(f"unknown provider {provider}")


def build_flex(q, k, v, shape: Shape, device: torch.device) -> Prepared:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        raise Unavailable(f"torch.nn.attention.flex_attention missing: {exc}")
    configure_compile_for_flex()
    # One compile per shape: start from an empty cache so that guards stay
    # short and no earlier specialisation is reused.
    torch.compiler.reset()
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    kwargs = {}
    if shape.causal:
        diagonal_offset = shape.seqlen_k - shape.seqlen_q  # bottom-right aligned, like ours

        def causal_mask(batch_idx, head_idx, q_idx, kv_idx):
            return q_idx + diagonal_offset >= kv_idx

        kwargs["block_mask"] = create_block_mask(
            causal_mask, None, None, shape.seqlen_q, shape.seqlen_k, device=str(device)
        )
    if shape.nheads != shape.nheads_k:
        kwargs["enable_gqa"] = True
    return Prepared(
        forward=lambda: compiled(q, k, v, **kwargs),
        grad_inputs=(q, k, v),
        fallback_markers=FLEX_EAGER_MARKERS,
    )


def _compare(
    ours: torch.Tensor, ref: torch.Tensor, what: str, result: dict, against: str = "SDPA"
) -> float:
    """Max |ours - ref|; adds a warning to result when beyond a loose tolerance."""
    diff = (ours.float() - ref.float()).abs().max().item()
    ref_max = ref.float().abs().max().item()
    # Loose on purpose: two correct kernels differ by a few ulps; a wrong one
    # (a skipped block, a wrong scale) by a sizeable fraction of the values.
    relative, floor = (1e-3, 1e-5) if ref.dtype == torch.float32 else (5e-2, 1e-3)
    tolerance = relative * ref_max + floor
    if not math.isfinite(diff) or diff > tolerance:
        message = f"{what} differs from {against}: max abs diff {diff:.3g} > {tolerance:.3g}"
        result["warning"] = join_notes(result.get("warning"), message)
    return diff if math.isfinite(diff) else float("nan")


def bits_digest(*tensors: torch.Tensor) -> str:
    """A fingerprint of the tensors' bits, computed where they are: two builds that
    should agree bit for bit (ab_builds.py) compare these instead of their values.
    Two weighted sums of the raw 16- or 32-bit words, in int64 (wrapping): any
    realistic difference changes them."""
    parts = []
    for t in tensors:
        t = t.detach().contiguous()
        words = t.view(torch.int16 if t.element_size() == 2 else torch.int32).flatten()
        x = words.to(torch.int64)
        weights = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
        parts.append(f"{int(x.sum())}:{int((x * weights).sum())}")
    return "/".join(parts)


def check_against_sdpa(
    forward, q, k, v, shape: Shape, key_rows: Optional[int] = None, digest: bool = False
) -> dict:
    """Max |ours - SDPA| on ours' own inputs: a fast number from a wrong kernel is worthless.

    q, k, v are (batch, seqlen, heads, headdim), v's headdim d_v for a head-dim
    pair, and so the outputs compared; SDPA runs on whichever backend it picks.
    When q requires grad, dq, dk, dv are compared too. Returns {} when
    SDPA itself cannot run the case (the measurement then reports ours' errors).
    With digest, the result also holds bits_digest of the output
    (``output_digest``) and of the gradients (``grad_digest``)."""
    if shape.causal and shape.seqlen_q != shape.seqlen_k:
        return {}  # SDPA's is_causal is top-left aligned
    kwargs = {"is_causal": shape.causal}
    if q.shape[2] != k.shape[2]:
        kwargs["enable_gqa"] = True

    def sdpa(qb, kb, vb):
        kt, vt = kb.transpose(1, 2), vb.transpose(1, 2)
        if key_rows is not None:
            kt, vt = kt[:, :, :key_rows], vt[:, :, :key_rows]
        return F.scaled_dot_product_attention(qb.transpose(1, 2), kt, vt, **kwargs).transpose(1, 2)

    result = {}
    try:
        with torch.no_grad():
            out = forward()
            if isinstance(out, (tuple, list)):
                out = out[0]
            if digest:
                result["output_digest"] = bits_digest(out)
            ref = sdpa(q, k, v)
            result["max_abs_diff_vs_sdpa"] = _compare(out, ref, "output", result)
            del out, ref
    except Exception:
        return {}
    if not q.requires_grad:
        return result
    try:
        out = forward()
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        del out
        if digest:
            result["grad_digest"] = bits_digest(*grads)
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        ref_grads = torch.autograd.grad(sdpa(*leaves), leaves, dout)
        result["max_abs_diff_grad_vs_sdpa"] = max(
            _compare(g, r, name, result) for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv"))
        )
    except Exception:
        pass  # the bwd / fwd_bwd measurements report ours' errors
    return result


# The dropout check's slice of a training shape: its mask (S_dmask) and the
# float64 reference are seqlen^2 per head, so the check runs on the first
# sequence's first two heads and at most this many rows, with the same kernel
# rule (head dim, causal, dtype).
DROPOUT_CHECK_ROWS = 1024


def check_dropout(attn, q, k, v, shape: Shape, dropout_p: float) -> dict:
    """Max |ours - reference| of a forward with dropout: the reference applies the
    keep mask our call returns (S_dmask, dropped elements negated, flash-attn's
    convention) to float64 softmax(Q K^T) and scales by 1 / (1 - p)."""
    rows = min(shape.seqlen_q, DROPOUT_CHECK_ROWS)
    heads = min(q.shape[2], 2)
    group = q.shape[2] // k.shape[2]
    qs = q[:1, :rows, :heads].detach()
    ks = k[:1, :rows, : max(1, heads // group)].detach()
    vs = v[:1, :rows, : max(1, heads // group)].detach()
    result: dict = {}
    try:
        with torch.no_grad():
            out, _, s_dmask = attn(
                qs, ks, vs, dropout_p=dropout_p, causal=shape.causal, return_attn_probs=True
            )
            kk = ks.repeat_interleave(group, dim=2)[:, :, :heads].double()
            vv = vs.repeat_interleave(group, dim=2)[:, :, :heads].double()
            scores = torch.einsum("bqhd,bkhd->bhqk", qs.double(), kk) * shape.headdim**-0.5
            if shape.causal:
                keep_causal = torch.ones(rows, rows, dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~keep_causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            keep = s_dmask[..., :rows, :rows] >= 0
            ref = torch.einsum("bhqk,bkhd->bqhd", probs * keep / (1.0 - dropout_p), vv)
            result["max_abs_diff_vs_reference"] = _compare(
                out, ref, "output with dropout", result, against="the float64 reference"
            )
    except Exception as exc:  # the timed calls report ours' errors
        result["warning"] = f"dropout check failed: {first_line(exc)}"
    return result


def mla_decode_shape(dtype: str, batch: int, seqlen_q: int, seqlen_k: int) -> Shape:
    """Absorbed MLA decode (DeepSeek's): 128 query heads of 576 columns over one
    latent head, whose first 512 columns are the values."""
    return Shape(dtype, batch, seqlen_q, seqlen_k, 128, 1, 576, False, headdim_v=512)


def build_decode(
    provider: str, shape: Shape, page_size: Optional[int], device: torch.device
) -> Prepared:
    """Decode: q (b, sq, 32, d) against a (b, sk, 8, d) K/V cache, forward only.
    A shape with headdim_v is absorbed MLA's: v_cache is k_cache[..., :headdim_v],
    the latent cache read in place (mla_decode_shape)."""
    dtype = DTYPES[shape.dtype]
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    h, hk, d, dv = shape.nheads, shape.nheads_k, shape.headdim, shape.dv
    latent = shape.headdim_v is not None

    if provider in (OURS, OURS_FP8KV):
        fp8 = provider == OURS_FP8KV
        if fp8 and latent:
            raise Unavailable(f"{provider}: absorbed MLA over an e4m3 cache is not built")
        if fp8 and dtype not in (torch.bfloat16, torch.float16):
            raise Unavailable(f"{provider}: an e4m3 cache is read with a bf16 / fp16 q")
        attn = ours_op("flash_attn_with_kvcache", device)
        q = random_tensor((b, sq, h, d), dtype, device)
        cache_seqlens = torch.full((b,), sk, dtype=torch.int32, device=device)
        block_table = None
        rows = (b, sk) if page_size is None else (b * -(-sk // page_size), page_size)
        k_cache = random_tensor(rows + (hk, d), dtype, device)
        v_cache = k_cache[..., :dv] if latent else random_tensor(rows + (hk, d), dtype, device)
        descales = {}
        if fp8:
            # The same values in e4m3 (randn's fit it), read with descales of 1.
            k_cache, v_cache = (t.to(torch.float8_e4m3fn) for t in (k_cache, v_cache))
            ones = torch.ones(b, hk, device=device)
            descales = dict(k_descale=ones, v_descale=ones)
        if page_size is None:
            k_view, v_view = (
                (t.to(dtype) for t in (k_cache, v_cache)) if fp8 else (k_cache, v_cache)
            )
        else:
            num_pages, pages_per_seq = rows[0], rows[0] // b
            # Pages scattered at random, as an allocator that has run a while leaves them.
            block_table = (
                torch.randperm(num_pages, device=device).to(torch.int32).view(b, pages_per_seq)
            )

        def forward():
            return attn(
                q,
                k_cache,
                v_cache,
                cache_seqlens=cache_seqlens,
                block_table=block_table,
                causal=shape.causal,
                **descales,
            )

        prepared = Prepared(forward=forward)
        # The check needs a gathered copy of a paged cache: only for caches of a
        # size where that copy is cheap.
        if k_cache.numel() * k_cache.element_size() <= CHECK_MAX_CACHE_BYTES:
            if block_table is not None:
                k_view = k_cache[block_table.long()].reshape(b, -1, hk, d).to(dtype)
                v_view = v_cache[block_table.long()].reshape(b, -1, hk, dv).to(dtype)
            prepared.extra.update(
                check_against_sdpa(forward, q, k_view, v_view, shape, key_rows=sk)
            )
            del k_view, v_view
        prepared.extra["kv_layout"] = "contiguous" if page_size is None else f"paged{page_size}"
        return prepared
    if latent:
        raise Unavailable(f"{provider} is not measured on absorbed MLA's latent cache")

    if provider not in SDPA_BACKENDS and provider != "sdpa_cpu":
        raise Unavailable(f"{provider} is not measured in the decode regime")
    if shape.causal and sq != sk:
        raise Unavailable(
            "SDPA is_causal is top-left aligned; not comparable when seqlen_q != seqlen_k"
        )
    context = _sdpa_backend(provider) if provider in SDPA_BACKENDS else contextlib.nullcontext
    if provider == "sdpa_math":
        # It also expands grouped K/V to every query head.
        expanded_kv = 2.0 * b * h * sk * d * DTYPES[shape.dtype].itemsize
        require_fits(
            _math_bytes(shape, False) + expanded_kv,
            device,
            "the math backend's attention matrix and expanded K/V",
        )
    q = random_tensor((b, h, sq, d), dtype, device)
    k = random_tensor((b, hk, sk, d), dtype, device)
    v = random_tensor((b, hk, sk, d), dtype, device)

    def grouped():
        return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=True)

    try:
        with context():
            grouped()
        synchronize(device)
        return Prepared(forward=grouped, context=context, extra={"kv_layout": "gqa"})
    except Exception as exc:
        if is_oom(exc) or is_sticky_cuda_error(exc):
            raise
        gqa_error = first_line(exc, 160)
    # This backend cannot read grouped K/V: give it K/V expanded to every query
    # head, copied outside the timed region (it then reads h/hk times the bytes).
    groups = h // hk
    require_fits(
        2.0 * k.numel() * k.element_size() * groups, device, "K/V expanded to every query head"
    )
    k_full = k.repeat_interleave(groups, dim=1)
    v_full = v.repeat_interleave(groups, dim=1)
    del k, v

    def expanded():
        return F.scaled_dot_product_attention(q, k_full, v_full, is_causal=shape.causal)

    note = (
        f"enable_gqa unsupported ({gqa_error}); K/V expanded to {h} heads before timing, "
        f"so the kernel reads {groups}x the K/V bytes"
    )
    return Prepared(forward=expanded, context=context, note=note, extra={"kv_layout": "expanded"})


def prefill_inputs(shape: Shape, device: torch.device) -> dict:
    """One paged_prefill shape's packed queries, keys and values, shared by its cases.

    Every sequence has seqlen_q (q_chunk) new query rows and seqlen_k (context)
    keys, the chunk's own keys included."""
    dtype = DTYPES[shape.dtype]
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    h, hk, d = shape.nheads, shape.nheads_k, shape.headdim
    if not 0 < sq <= sk:
        raise Unavailable(f"q_chunk {sq} must lie in 1..context ({sk})")
    return {
        "q": random_tensor((b * sq, h, d), dtype, device),
        "k": random_tensor((b * sk, hk, d), dtype, device),
        "v": random_tensor((b * sk, hk, d), dtype, device),
        "cu_seqlens_q": torch.arange(0, b + 1, dtype=torch.int32, device=device) * sq,
        "cu_seqlens_k": torch.arange(0, b + 1, dtype=torch.int32, device=device) * sk,
        "seqused_k": torch.full((b,), sk, dtype=torch.int32, device=device),
    }


def build_paged_prefill(
    shape: Shape, page_size: Optional[int], inputs: dict, device: torch.device, check: bool
) -> Prepared:
    """flash_attn_varlen_func forward, causal, on a chunk of new queries against its
    context: packed K/V (page_size None), or a paged cache behind a random block table.

    inputs (filled by the first case of a shape) holds what every case of the shape
    shares; with check, a paged case's output is compared with the contiguous one."""
    attn = ours_op("flash_attn_varlen_func", device)
    if not inputs:
        inputs.update(prefill_inputs(shape, device))
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    hk, d = shape.nheads_k, shape.headdim
    q, cu_q, cu_k = inputs["q"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]

    if page_size is None:
        k, v = inputs["k"], inputs["v"]

        def contiguous():
            return attn(q, k, v, cu_q, cu_k, sq, sk, causal=True)

        return Prepared(forward=contiguous, extra={"kv_layout": "contiguous"})

    if page_size < 1:
        raise Unavailable(f"page size {page_size} must be positive")
    pages_per_seq = -(-sk // page_size)
    num_pages = b * pages_per_seq
    # Rows past a sequence's keys in its last page stay random: seqused_k must keep them out.
    k_cache = random_tensor((num_pages, page_size, hk, d), DTYPES[shape.dtype], device)
    v_cache = random_tensor((num_pages, page_size, hk, d), DTYPES[shape.dtype], device)
    # Pages scattered at random, as an allocator that has run a while leaves them.
    block_table = torch.randperm(num_pages, device=device).to(torch.int32).view(b, pages_per_seq)
    # Key p of sequence i goes to row p % page_size of page block_table[i, p // page_size].
    positions = torch.arange(sk, device=device)
    pages = block_table.long()[:, positions // page_size]
    rows = (positions % page_size).expand(b, -1)
    k_cache[pages, rows] = inputs["k"].view(b, sk, hk, d)
    v_cache[pages, rows] = inputs["v"].view(b, sk, hk, d)
    del positions, pages, rows
    seqused_k = inputs["seqused_k"]

    def paged():
        return attn(
            q,
            k_cache,
            v_cache,
            cu_q,
            cu_k,
            sq,
            sk,
            causal=True,
            block_table=block_table,
            seqused_k=seqused_k,
        )

    prepared = Prepared(forward=paged, extra={"kv_layout": f"paged{page_size}"})
    if check:
        prepared.extra.update(check_paged_prefill(paged, shape, inputs, attn))
    return prepared


def check_paged_prefill(paged, shape: Shape, inputs: dict, attn) -> dict:
    """The paged output against the contiguous call's on the same keys (computed once
    per shape). Returns {} when either call fails: the measurements report that."""
    result = {}
    try:
        with torch.no_grad():
            if "reference" not in inputs:
                inputs["reference"] = attn(
                    inputs["q"],
                    inputs["k"],
                    inputs["v"],
                    inputs["cu_seqlens_q"],
                    inputs["cu_seqlens_k"],
                    shape.seqlen_q,
                    shape.seqlen_k,
                    causal=True,
                )
            ref = inputs["reference"]
            out = paged()
    except Exception:
        return result
    diff = (out.float() - ref.float()).abs().max().item()
    result["max_abs_diff_vs_contiguous"] = diff if math.isfinite(diff) else float("nan")
    result["equal_to_contiguous"] = bool(torch.equal(out, ref))
    tolerance = 1e-4 if out.dtype == torch.float32 else 2e-2
    try:
        torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
    except AssertionError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        result["warning"] = (
            f"paged output differs from the contiguous call (atol=rtol={tolerance:g}): "
            f"{'; '.join(lines[:3])[:200]}"
        )
    return result


# ----------------------------------------------------------------------------
# Measuring one provider on one shape


def call_checked(fn, prepared: Prepared):
    """First call of a provider: surfaces errors and eager fallbacks, with warnings as context."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except Exception as exc:
            hints = [
                str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()
            ]
            if hints:
                raise RuntimeError(
                    f"{first_line(exc)} [warnings: {' | '.join(hints[:2])[:300]}]"
                ) from exc
            raise
    for w in caught:
        text = str(w.message)
        if any(marker in text for marker in prepared.fallback_markers):
            raise FellBack(f"fallback: {text.strip().splitlines()[0][:200]}")
    return result


def measure_mode(prepared: Prepared, mode: str, timer: Timer, device: torch.device):
    """(ms, peak_mem_bytes, note) of one mode."""
    forward = prepared.forward
    inputs = prepared.grad_inputs
    with prepared.context():
        if mode == "fwd":
            call_checked(forward, prepared)
            synchronize(device)
            peak = peak_extra_bytes(forward, device)
            return timer(forward), peak, None

        first = call_checked(forward, prepared)
        dout = torch.randn_like(first)
        if mode == "fwd_bwd":
            del first

            def fwd_bwd():
                return torch.autograd.grad(forward(), inputs, dout)

            fwd_bwd()
            synchronize(device)
            peak = peak_extra_bytes(fwd_bwd, device)
            return timer(fwd_bwd), peak, None

        # bwd: time the backward pass alone, on an output computed once.
        out = first
        del first

        def bwd():
            return torch.autograd.grad(out, inputs, dout, retain_graph=True)

        try:
            bwd()
            bwd()  # a backward that frees what it saved fails on the second call
            synchronize(device)
        except Exception as exc:
            if is_oom(exc) or is_sticky_cuda_error(exc):
                raise
            # Some backward graphs refuse retain_graph; derive it instead.
            del out

            def fwd_bwd():
                return torch.autograd.grad(forward(), inputs, dout)

            ms = max(timer(fwd_bwd) - timer(forward), 0.0)
            return (
                ms,
                None,
                f"bwd = fwd_bwd - fwd (backward with retain_graph failed: {first_line(exc, 150)})",
            )
        peak = peak_extra_bytes(bwd, device)
        return timer(bwd), peak, None


# ----------------------------------------------------------------------------
# The run


class Run:
    def __init__(self, args, device: torch.device, grid: Grid, providers: list):
        self.args = args
        self.device = device
        self.grid = grid
        self.providers = providers
        self.timer = Timer(device, args.warmup_ms, args.rep_ms, args.cpu_budget_s)
        self.meta = describe_environment(device)
        self.meta.update(
            timer=self.timer.describe(),
            flops="fwd 2*b*h*sq*sk*(d_qk+d_v), i.e. 4*b*h*sq*sk*d when d_v = d_qk (halved "
            "when causal), bwd 2.5x, fwd_bwd 3.5x; paged_prefill "
            "4*b*h*d*(sq*(sk-sq) + sq*(sq+1)/2), the pairs a bottom-right causal mask keeps",
            argv=sys.argv[1:],
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
        if TRAIN_ONLY & set(providers):
            fa4, error = load_fa4()
            self.meta["fa4"] = fa4_version() if fa4 is not None else None
            if fa4 is None:
                self.meta["fa4_error"] = error
        if args.cpu_standin:
            self.meta["note"] = "CPU stand-in of the GPU protocol: numbers are meaningless"
        elif device.type == "cpu":
            self.meta["note"] = "no GPU found: these are CPU numbers"
        # Rounds per decode and paged_prefill case (see measure_rounds): 3 on a GPU, 1 on the CPU.
        self.decode_rounds = args.decode_rounds or (
            3 if device.type == "cuda" and not args.cpu_standin else 1
        )
        self.meta["decode_rounds"] = self.decode_rounds
        self.rows: list = []
        self.copy_gbps: Optional[float] = None
        self.broken: Optional[str] = None  # set once the CUDA context is unusable
        self.done = 0
        self.total = 0
        self.t_start = time.perf_counter()

    # -- bookkeeping ---------------------------------------------------------

    def base_row(self, regime: str, shape: Shape, mode: str, provider: str) -> dict:
        row = dict.fromkeys(ROW_KEYS)
        row.update(
            gpu=self.meta["gpu"],
            torch=self.meta["torch"],
            cuda=self.meta["cuda"],
            dtype=shape.dtype,
            headdim=shape.headdim,
            headdim_v=shape.headdim_v,
            causal=shape.causal,
            seqlen_q=shape.seqlen_q,
            seqlen_k=shape.seqlen_k,
            batch=shape.batch,
            nheads=shape.nheads,
            nheads_k=shape.nheads_k,
            mode=mode,
            provider=provider,
            regime=regime,
            device=self.device.type,
        )
        return row

    def record(self, row: dict, label: str) -> None:
        self.rows.append(row)
        self.done += 1
        elapsed = time.perf_counter() - self.t_start
        if row["error"]:
            result = row["error"][:150]
        elif row["regime"] == "decode":
            result = f"{_fmt(row['ms'] * 1e3, '9.1f')} us  {_fmt(row['gbps'], '8.1f')} GB/s"
            if row.get("pct_of_copy_bw") is not None:
                result += f" ({row['pct_of_copy_bw']:.0f}% of copy)"
        elif row["regime"] == "paged_prefill":
            scale, unit = (1e3, "GFLOP/s") if self.device.type == "cpu" else (1.0, "TFLOP/s")
            result = (
                f"{_fmt(row['ms'] * 1e3, '9.1f')} us  "
                f"{_fmt(row['tflops'] * scale if row['tflops'] else None, '8.2f')} {unit}"
            )
            if row.get("paged_over_contiguous") is not None:
                result += f"  x{row['paged_over_contiguous']:.2f} of contiguous"
            if row.get("equal_to_contiguous") is not None and not row.get("warning"):
                result += (
                    "  output = contiguous"
                    if row["equal_to_contiguous"]
                    else (
                        f"  output close to contiguous (max diff {row['max_abs_diff_vs_contiguous']:.2g})"
                    )
                )
        else:
            if self.device.type == "cpu":
                throughput = (
                    f"{_fmt(row['tflops'] * 1e3 if row['tflops'] else None, '8.2f')} GFLOP/s"
                )
            else:
                throughput = f"{_fmt(row['tflops'], '8.2f')} TFLOP/s"
            result = f"{_fmt(row['ms'], '9.3f')} ms  {throughput}"
            if row["peak_mem_bytes"] is not None:
                result += f"  peak {row['peak_mem_bytes'] / MIB:9.1f} MiB"
        if row.get("warning"):
            result += f"  WARNING: {row['warning']}"
        elif row["note"] and not row["error"]:
            result += f"  [{row['note'][:80]}]"
        print(f"[{self.done:5d}/{self.total}] {elapsed:7.1f}s  {label:<52s} {result}", flush=True)

    def write_json(self) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        self.meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.meta["copy_gbps"] = self.copy_gbps
        payload = {"meta": self.meta, "rows": self.rows}
        path = os.path.join(self.args.out, "results.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(json_safe(payload), f, indent=1)
        os.replace(tmp, path)

    def check_context(self, exc: BaseException) -> None:
        """After a failure, find out whether the CUDA context survived it."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).item()
            if not is_sticky_cuda_error(exc):
                return
        except Exception:
            pass
        self.broken = f"CUDA context lost after: {first_line(exc, 200)}"
        print(f"!! {self.broken}; the remaining cases are recorded as skipped", flush=True)

    def error_text(self, exc: Exception, provider: str) -> str:
        """A row's error for what a provider's build or timed call raised. Our
        kernels' refusal of a head dim or dtype that a reduced build left out
        (FLASH_ATTN_CUDA_HDIMS, as ab_builds.py's builds are) is a skip, not a
        failure."""
        left_out = left_out_reason(exc, our_build_info()) if provider in OWN_PROVIDERS else None
        if left_out is not None:
            return f"skipped: {left_out}"
        self.check_context(exc)
        return f"OOM: {first_line(exc)}" if is_oom(exc) else first_line(exc)

    def run_provider(self, regime, shape, provider, modes, build, label, extra=None, record=True):
        """Build one provider's inputs once, then measure each mode; never raises.
        Returns the rows by mode; record=False leaves recording them to the caller."""
        rows = {mode: self.base_row(regime, shape, mode, provider) for mode in modes}
        for row in rows.values():
            row.update(extra or {})
        prepared = None
        build_error = None
        if self.broken:
            build_error = f"skipped: {self.broken}"
        else:
            try:
                t0 = time.perf_counter()
                prepared = build()
                build_s = time.perf_counter() - t0
            except (Unavailable, FellBack) as exc:
                build_error = str(exc)
            except Exception as exc:
                build_error = self.error_text(exc, provider)
        for mode in modes:
            row = rows[mode]
            if prepared is None:
                row["error"] = build_error
            elif self.broken:
                row["error"] = f"skipped: {self.broken}"
            else:
                row["note"] = prepared.note
                t0 = time.perf_counter()
                try:
                    ms, peak, note = measure_mode(prepared, mode, self.timer, self.device)
                    self.fill(row, ms, peak, note, prepared)
                    if provider == "flex" and mode == modes[0]:
                        first_s = time.perf_counter() - t0 + build_s
                        row["note"] = join_notes(
                            row["note"], f"compile + first timing {first_s:.1f}s"
                        )
                    elif provider in (FA4, FA4_DETERMINISTIC) and mode == modes[0]:
                        # FA4 compiles in the build's check, before the timed calls.
                        row["note"] = join_notes(
                            row["note"], f"inputs + check + JIT compile {build_s:.1f}s"
                        )
                except (Unavailable, FellBack) as exc:
                    row["error"] = str(exc)
                except Exception as exc:
                    row["error"] = self.error_text(exc, provider)
            if record:
                self.record(
                    row, f"{label} {provider_label(row)} {mode if regime != 'decode' else ''}"
                )
        del prepared
        release_memory(self.device)
        return rows

    def fill(self, row: dict, ms: float, peak, note, prepared: Prepared) -> None:
        row["peak_mem_bytes"] = peak
        row["note"] = join_notes(prepared.note, note)
        for key, value in prepared.extra.items():
            row[key] = value
        self.set_time(row, ms)

    def set_time(self, row: dict, ms: float) -> None:
        """The time and what follows from it (throughput, bandwidth)."""
        row["ms"] = ms
        if row["regime"] == "paged_prefill":
            flops = prefill_flops(
                row["batch"], row["nheads"], row["seqlen_q"], row["seqlen_k"], row["headdim"]
            )
        else:
            flops = attention_flops(
                row["batch"],
                row["nheads"],
                row["seqlen_q"],
                row["seqlen_k"],
                row["headdim"],
                row["causal"],
                row["mode"],
                row.get("headdim_v"),
            )
        row["tflops"] = flops / (ms * 1e-3) / 1e12 if ms > 0 else None
        if row["regime"] == "decode" and ms > 0:
            elem = DTYPES[row["dtype"]].itemsize
            # K and V; absorbed MLA's latent rows (headdim_v set) hold both, read once.
            copies = 1.0 if row.get("headdim_v") is not None else 2.0
            kv_bytes = (
                copies * row["batch"] * row["seqlen_k"] * row["nheads_k"] * row["headdim"] * elem
            )
            row["gbps"] = kv_bytes / (ms * 1e-3) / 1e9
            if self.copy_gbps:
                row["pct_of_copy_bw"] = 100.0 * row["gbps"] / self.copy_gbps

    # -- regimes -------------------------------------------------------------

    def train_shapes(self):
        g = self.grid
        for dtype in g.dtypes:
            for headdim in g.headdims:
                nheads = max(1, g.hidden // headdim)
                ratios = []
                for seqlen in g.seqlens:
                    ratios += [r for r in g.train_kv_ratios(headdim, seqlen) if r not in ratios]
                # A ratio that does not divide the head count has no shape here.
                for ratio in [r for r in ratios if r >= 1 and nheads % r == 0]:
                    for causal in g.causals:
                        for seqlen in g.seqlens:
                            if ratio not in g.train_kv_ratios(headdim, seqlen):
                                continue
                            yield Shape(
                                dtype,
                                max(1, g.tokens // seqlen),
                                seqlen,
                                seqlen,
                                nheads,
                                nheads // ratio,
                                headdim,
                                causal,
                            )
            # v narrower than q and k: nheads from d_v (2048 // 128 = 16), MHA only.
            for headdim, headdim_v in g.headdim_pairs:
                nheads = max(1, g.hidden // headdim_v)
                for causal in g.causals:
                    for seqlen in g.seqlens:
                        yield Shape(
                            dtype,
                            max(1, g.tokens // seqlen),
                            seqlen,
                            seqlen,
                            nheads,
                            nheads,
                            headdim,
                            causal,
                            headdim_v,
                        )

    def memory_providers(self) -> list:
        return [p for p in self.providers if p not in MEMORY_EXCLUDED]

    def decode_cases(self):
        g = self.grid
        providers = [p for p in self.providers if p not in DECODE_EXCLUDED]
        for sq in g.decode_seqlens_q:
            for sk in g.decode_seqlens_k:
                for batch in g.decode_batches:
                    shape = Shape(
                        g.decode_dtype,
                        batch,
                        sq,
                        sk,
                        g.decode_nheads,
                        g.decode_nheads_k,
                        g.decode_headdim,
                        False,
                    )
                    cases = []
                    for provider in providers:
                        cases.append((provider, None))
                        if provider in (OURS, OURS_FP8KV):
                            cases.extend((provider, ps) for ps in g.decode_page_sizes)
                    yield shape, cases
                    if g.decode_mla and OURS in providers:
                        mla = mla_decode_shape(g.decode_dtype, batch, sq, sk)
                        yield mla, [(OURS, None)] + [(OURS, ps) for ps in g.decode_page_sizes]

    def prefill_cases(self):
        """Only flash_attn_cuda: SDPA's is_causal is top-left aligned, not a chunk's mask."""
        g = self.grid
        if OURS not in self.providers:
            return
        for batch, q_chunk, context in g.prefill_shapes:
            shape = Shape(
                g.prefill_dtype,
                batch,
                q_chunk,
                context,
                g.prefill_nheads,
                g.prefill_nheads_k,
                g.prefill_headdim,
                True,
            )
            yield shape, [(OURS, None)] + [(OURS, ps) for ps in g.prefill_page_sizes]

    def memory_shapes(self):
        g = self.grid
        for seqlen in g.memory_seqlens:
            yield Shape(
                g.memory_dtype,
                g.memory_batch,
                seqlen,
                seqlen,
                g.memory_nheads,
                g.memory_nheads,
                g.memory_headdim,
                False,
            )

    def count(self) -> int:
        total = 0
        if "train" in self.args.regimes:
            total += sum(1 for _ in self.train_shapes()) * sum(
                len(self.train_modes(p)) for p in self.providers
            )
        if "decode" in self.args.regimes:
            total += sum(len(cases) for _, cases in self.decode_cases())
        if "memory" in self.args.regimes:
            total += sum(1 for _ in self.memory_shapes()) * len(self.memory_providers())
        if "paged_prefill" in self.args.regimes:
            total += sum(len(cases) for _, cases in self.prefill_cases())
        return total

    def run(self) -> None:
        self.total = self.count()
        print(f"{self.total} measurements planned; timer: {self.timer.describe()}", flush=True)
        try:
            if "train" in self.args.regimes and self.grid.modes:
                self.run_train()
            if "decode" in self.args.regimes:
                self.run_decode()
            if "memory" in self.args.regimes:
                self.run_memory()
            if "paged_prefill" in self.args.regimes:
                self.run_paged_prefill()
        except KeyboardInterrupt:
            print("\ninterrupted: writing what was measured so far", flush=True)
            self.meta["interrupted"] = True
        self.write_json()

    def train_modes(self, provider: str) -> list:
        if provider in DECODE_ONLY:
            return []
        if provider in DETERMINISTIC_PROVIDERS:
            # Its forward is the plain one; only the backward differs.
            return [m for m in self.grid.modes if m != "fwd"]
        if provider in FWD_ONLY:
            return [m for m in self.grid.modes if m == "fwd"]
        return self.grid.modes

    def run_train(self) -> None:
        with_grad = any(mode != "fwd" for mode in self.grid.modes)
        for shape in self.train_shapes():
            label = (
                f"train {shape.dtype} d={head_dims(shape.headdim, shape.headdim_v)} "
                f"{'causal' if shape.causal else 'full  '} "
                f"s={shape.seqlen_q} b={shape.batch} h={shape.nheads}"
                + (f":{shape.nheads_k}" if shape.nheads_k != shape.nheads else "")
            )
            for provider in self.providers:
                if not self.train_modes(provider):
                    continue
                self.run_provider(
                    "train",
                    shape,
                    provider,
                    self.train_modes(provider),
                    lambda p=provider: build_train(p, shape, self.device, with_grad),
                    label,
                )
            self.write_json()

    def run_decode(self) -> None:
        if self.copy_gbps is None and not self.broken:
            self.copy_gbps = measure_copy_bandwidth(self.device, self.timer)
            if self.copy_gbps:
                print(
                    f"device copy bandwidth (read + write): {self.copy_gbps:.0f} GB/s", flush=True
                )
        for shape, cases in self.decode_cases():
            label = f"decode sq={shape.seqlen_q} sk={shape.seqlen_k} b={shape.batch}"
            for row in self.measure_rounds(
                "decode",
                shape,
                cases,
                label,
                lambda p, ps, _round: build_decode(p, shape, ps, self.device),
            ):
                self.record(row, f"{label} {provider_label(row)}")
            self.write_json()

    def measure_rounds(self, regime, shape, cases, label, build) -> list:
        """The fwd row of each (provider, page_size) case of one shape, not yet recorded.

        Decode cells of different providers are within a few percent of each
        other, about as far apart as one provider's time is from one process or
        position in the run to the next; so are paged and contiguous prefill.
        So every case of a shape is measured in `decode_rounds` rounds, each
        round in the order of the previous one rotated by one case, and a case
        reports the median of its rounds: no case is always measured first or
        right after another's memory traffic. build(provider, page_size,
        round_index) prepares one case."""
        rounds = self.decode_rounds
        per_case = [[] for _ in cases]
        for round_index in range(rounds):
            for i in [(round_index + j) % len(cases) for j in range(len(cases))]:
                provider, page_size = cases[i]
                rows = self.run_provider(
                    regime,
                    shape,
                    provider,
                    ["fwd"],
                    lambda p=provider, ps=page_size, r=round_index: build(p, ps, r),
                    label,
                    extra={"page_size": page_size},
                    record=False,
                )
                per_case[i].append(rows["fwd"])
        result = []
        for case_rows in per_case:
            row = case_rows[0]
            times = [r["ms"] for r in case_rows]
            errors = [r["error"] for r in case_rows if r["error"]]
            if rounds > 1 and not errors and None not in times:
                self.set_time(row, statistics.median(times))
                row["ms_rounds"] = times
            elif rounds > 1:
                # A case that failed in any round reports the failure, not
                # the rounds that happened to pass.
                row["error"] = errors[0] if errors else "no time measured"
                for key in ("ms", "tflops", "gbps", "pct_of_copy_bw"):
                    row[key] = None
            result.append(row)
        return result

    def run_paged_prefill(self) -> None:
        for shape, cases in self.prefill_cases():
            label = (
                f"paged_prefill b={shape.batch} q_chunk={shape.seqlen_q} context={shape.seqlen_k}"
            )
            inputs = {}  # the shape's q, k, v, built by its first case, shared by the rest
            rows = self.measure_rounds(
                "paged_prefill",
                shape,
                cases,
                label,
                lambda _p, ps, r: build_paged_prefill(shape, ps, inputs, self.device, check=r == 0),
            )
            inputs.clear()
            release_memory(self.device)
            contiguous = rows[0]
            good = not contiguous["error"] and contiguous["ms"]
            for row in rows[1:]:
                row["paged_over_contiguous"] = (
                    row["ms"] / contiguous["ms"]
                    if good and not row["error"] and row["ms"]
                    else None
                )
            for row in rows:
                self.record(row, f"{label} {provider_label(row)}")
            self.write_json()

    def run_memory(self) -> None:
        for shape in self.memory_shapes():
            label = f"memory s={shape.seqlen_q} b={shape.batch} h={shape.nheads} d={shape.headdim}"
            elem = DTYPES[shape.dtype].itemsize
            input_bytes = 4 * shape.batch * shape.seqlen_q * shape.nheads * shape.headdim * elem
            for provider in self.memory_providers():
                self.run_provider(
                    "memory",
                    shape,
                    provider,
                    ["fwd_bwd"],
                    lambda p=provider: build_train(p, shape, self.device, True),
                    label,
                    extra={"input_bytes": input_bytes},
                )
            self.write_json()


def join_notes(*notes) -> Optional[str]:
    kept = [n for n in notes if n]
    return "; ".join(kept) if kept else None


def head_dims(headdim: int, headdim_v: Optional[int] = None) -> str:
    """'128', or '192/128' for q and k of head dim 192 over v of 128."""
    return str(headdim) if headdim_v is None else f"{headdim}/{headdim_v}"


def kv_group(row: dict) -> int:
    """nheads / nheads_k of a row: 1 for MHA, 4 for GQA 4:1."""
    nheads, nheads_k = row.get("nheads"), row.get("nheads_k")
    return nheads // nheads_k if nheads and nheads_k else 1


def provider_label(row: dict) -> str:
    if row.get("page_size"):
        return f"{row['provider']}[paged{row['page_size']}]"
    return row["provider"]


def json_safe(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# ----------------------------------------------------------------------------
# Tables


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(title: str, header: list, lines: list) -> None:
    widths = [
        max(len(str(h)), *(len(str(line[i])) for line in lines)) for i, h in enumerate(header)
    ]
    print()
    print(title)
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for line in lines:
        print("  ".join(str(c).rjust(w) for c, w in zip(line, widths)))


def _cell(row: Optional[dict], value_key: str, scale: float, spec: str) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        text = row["error"]
        return (
            "skip"
            if text.startswith(("skipped", "unavailable"))
            else ("n/a" if "import flash_attn_cuda" in text or "has no" in text else "err")
        )
    value = row.get(value_key)
    return _fmt(value * scale if value is not None else None, spec)


def print_tables(meta: dict, rows: list) -> None:
    on_cpu = meta.get("device") == "cpu"
    flop_scale, flop_unit = (1e3, "GFLOP/s") if on_cpu else (1.0, "TFLOP/s")
    providers = []
    for row in rows:
        if row["provider"] not in providers:
            providers.append(row["provider"])
    others = [p for p in providers if p != OURS]

    train = [r for r in rows if r.get("regime") == "train"]
    groups = {}
    for r in train:
        group = kv_group(r)
        # A (d_qk, d_v) pair gets tables of its own, apart from d_qk's and d_v's.
        heads = (r["headdim"], r.get("headdim_v"))
        groups.setdefault((r["dtype"], heads, group, r["causal"], r["mode"]), {}).setdefault(
            (r["seqlen_q"], r["batch"], r["nheads"]), {}
        )[r["provider"]] = r
    ratio_log = {p: [] for p in others}
    for (dtype, heads, group, causal, mode), by_shape in groups.items():
        header = (
            ["seqlen", "batch", "nheads"]
            + providers
            + [f"x{p}" for p in others if REFERENCE_OF.get(p, OURS) in providers]
        )
        lines = []
        for (seqlen, batch, nheads), by_provider in sorted(by_shape.items()):
            line = [seqlen, batch, nheads]
            line += [_cell(by_provider.get(p), "tflops", flop_scale, ".1f") for p in providers]
            for p in others:
                if REFERENCE_OF.get(p, OURS) in providers:
                    ours = by_provider.get(REFERENCE_OF.get(p, OURS))
                    other = by_provider.get(p)
                    ratio = None
                    if (
                        ours
                        and other
                        and not ours.get("error")
                        and not other.get("error")
                        and ours.get("ms")
                        and other.get("ms")
                    ):
                        ratio = other["ms"] / ours["ms"]
                        ratio_log[p].append(ratio)
                    line.append(_fmt(ratio, ".2f"))
            lines.append(line)
        against = "".join(f"; x{p} against {REFERENCE_OF[p]}" for p in others if p in REFERENCE_OF)
        _print_table(
            f"train {dtype} headdim={head_dims(*heads)}{f' GQA {group}:1' if group != 1 else ''} "
            f"{'causal' if causal else 'non-causal'} {mode}: {flop_unit}"
            f" (xP = time of P / time of {OURS}; >1 means {OURS} is faster{against})",
            header,
            lines,
        )

    decode = [r for r in rows if r.get("regime") == "decode"]
    if decode:
        labels = []
        for r in decode:
            if provider_label(r) not in labels:
                labels.append(provider_label(r))
        # One table per query length and head shape (absorbed MLA's apart).
        by_sq = {}
        for r in decode:
            key = (r["seqlen_q"], r["nheads"], r["nheads_k"], r["headdim"], r.get("headdim_v") or 0)
            by_sq.setdefault(key, {}).setdefault((r["seqlen_k"], r["batch"]), {})[
                provider_label(r)
            ] = r
        copy = meta.get("copy_gbps")
        for (sq, *_), by_shape in sorted(by_sq.items()):
            sample = next(iter(next(iter(by_shape.values())).values()))
            header = (
                ["seqlen_k", "batch"] + [f"{lb} us" for lb in labels] + [f"{OURS} GB/s", "% copy"]
            )
            header += [f"x{lb}" for lb in labels if lb in others]
            lines = []
            for (sk, batch), by_label in sorted(by_shape.items()):
                line = [sk, batch] + [_cell(by_label.get(lb), "ms", 1e3, ".1f") for lb in labels]
                ours = by_label.get(OURS)
                ok = ours is not None and not ours.get("error") and ours.get("ms")
                line.append(_fmt(ours.get("gbps") if ok else None, ".0f"))
                line.append(_fmt(ours.get("pct_of_copy_bw") if ok else None, ".0f"))
                for lb in labels:
                    if lb in others:
                        other = by_label.get(lb)
                        good = ok and other and not other.get("error") and other.get("ms")
                        line.append(_fmt(other["ms"] / ours["ms"] if good else None, ".2f"))
                lines.append(line)
            _print_table(
                f"decode seqlen_q={sq} heads {sample['nheads']}:{sample['nheads_k']} headdim="
                f"{head_dims(sample['headdim'], sample.get('headdim_v'))} {sample['dtype']}: "
                "microseconds; GB/s of K/V read; copy bandwidth "
                f"{_fmt(copy, '.0f')} GB/s (read + write)",
                header,
                lines,
            )

    memory = [r for r in rows if r.get("regime") == "memory"]
    if memory:
        by_seqlen = {}
        for r in memory:
            by_seqlen.setdefault(r["seqlen_q"], {})[r["provider"]] = r
        measured = [p for p in providers if any(r["provider"] == p for r in memory)]
        header = ["seqlen"] + measured
        lines = [
            [s] + [_cell(by_p.get(p), "peak_mem_bytes", 1 / MIB, ".0f") for p in measured]
            for s, by_p in sorted(by_seqlen.items())
        ]
        sample = memory[0]
        _print_table(
            f"memory: peak MiB allocated by fwd+bwd beyond its inputs (batch {sample['batch']}, "
            f"{sample['nheads']} heads, headdim {sample['headdim']}, {sample['dtype']})",
            header,
            lines,
        )

    prefill = [r for r in rows if r.get("regime") == "paged_prefill"]
    if prefill:
        groups = {}
        for r in prefill:
            key = (r["dtype"], r["nheads"], r["nheads_k"], r["headdim"])
            groups.setdefault(key, {}).setdefault((r["batch"], r["seqlen_q"], r["seqlen_k"]), {})[
                r.get("page_size")
            ] = r
        for (dtype, nheads, nheads_k, headdim), by_shape in groups.items():
            page_sizes = sorted({ps for by_ps in by_shape.values() for ps in by_ps if ps})
            header = ["batch", "q_chunk", "context", "contiguous us", flop_unit]
            for ps in page_sizes:
                header += [f"paged{ps} us", f"x paged{ps}"]
            header.append("check")
            lines = []
            for (batch, q_chunk, context), by_ps in sorted(by_shape.items()):
                contiguous = by_ps.get(None)
                line = [
                    batch,
                    q_chunk,
                    context,
                    _cell(contiguous, "ms", 1e3, ".1f"),
                    _cell(contiguous, "tflops", flop_scale, ".1f"),
                ]
                for ps in page_sizes:
                    paged = by_ps.get(ps)
                    line += [
                        _cell(paged, "ms", 1e3, ".1f"),
                        _fmt(paged.get("paged_over_contiguous") if paged else None, ".2f"),
                    ]
                line.append(_prefill_check(by_ps[ps] for ps in page_sizes if ps in by_ps))
                lines.append(line)
            _print_table(
                f"paged_prefill causal heads {nheads}:{nheads_k} headdim={headdim} {dtype}: "
                f"{OURS} flash_attn_varlen_func forward, microseconds; x pagedN = paged time / "
                f"contiguous time (>1 means paging costs time); check: paged output against "
                f"contiguous (exact, close, FAIL, - not checked)",
                header,
                lines,
            )

    summary = [(p, v) for p, v in ratio_log.items() if v]
    if summary:
        print()
        print(f"training summary ({OURS} speed relative to each provider, geometric mean):")
        for p, values in summary:
            geo = math.exp(sum(math.log(x) for x in values) / len(values))
            against = f" (against {REFERENCE_OF[p]})" if p in REFERENCE_OF else ""
            if p == OURS_DROPOUT:
                against = f" (what dropout_p={DROPOUT_P} costs)"
            print(
                f"  vs {p:<16s} {geo:5.2f}x over {len(values)} cases (min {min(values):.2f}, max {max(values):.2f}){against}"
            )

    errors = {}
    for r in rows:
        if r.get("error"):
            key = (r["provider"], r["error"][:160])
            errors[key] = errors.get(key, 0) + 1
    if errors:
        print()
        print("errors and skipped cases (provider: count x message):")
        for (provider, message), n in sorted(errors.items()):
            print(f"  {provider}: {n} x {message}")
    warned = {}
    for r in rows:
        if r.get("warning"):
            warned.setdefault(r["provider"], []).append(r)
    for provider, bad in warned.items():
        # An anchor that disagrees with SDPA makes its ratios meaningless.
        print()
        print(
            f"WARNING: {len(bad)} {provider} rows differ from their reference (SDPA; with dropout the float64 reference; for "
            f"paged_prefill the contiguous call) beyond tolerance, e.g.: {bad[0]['warning']}"
        )


def _prefill_check(paged_rows) -> str:
    """exact / close / FAIL over a shape's paged rows; - when none was compared."""
    checked = [
        r for r in paged_rows if r.get("equal_to_contiguous") is not None or r.get("warning")
    ]
    if not checked:
        return "-"
    if any(r.get("warning") for r in checked):
        return "FAIL"
    return "exact" if all(r.get("equal_to_contiguous") for r in checked) else "close"


# ----------------------------------------------------------------------------
# Command line


def parse_list(text: Optional[str], convert=str) -> Optional[list]:
    if text is None:
        return None
    return [convert(x.strip()) for x in text.split(",") if x.strip()]


def parse_prefill_shape(text: str) -> tuple:
    """'4x512x4096' -> (batch 4, q_chunk 512, context 4096)."""
    try:
        batch, q_chunk, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--prefill-shapes: {text!r} is not BATCHxQ_CHUNKxCONTEXT")
    if min(batch, q_chunk, context) < 1 or q_chunk > context:
        raise SystemExit(f"--prefill-shapes: {text!r} needs positive sizes and q_chunk <= context")
    return batch, q_chunk, context


def parse_headdim_pair(text: str) -> tuple:
    """'192x128' -> (d_qk 192, d_v 128)."""
    try:
        headdim, headdim_v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--headdim-pairs: {text!r} is not DxV (e.g. 192x128)")
    if min(headdim, headdim_v) < 1 or headdim_v > headdim:
        raise SystemExit(f"--headdim-pairs: {text!r} needs positive head dims and d_v <= d_qk")
    return headdim, headdim_v


def parse_bool_choice(text: str) -> list:
    return {"both": [False, True], "true": [True], "false": [False]}[text]


def build_parser() -> argparse.ArgumentParser:
    # Defaults are written into each help string: most options default to None and take
    # their value from the device's grid (gpu_grid / cpu_grid), which argparse cannot show.
    p = argparse.ArgumentParser(
        description="Benchmark flash_attn_cuda against PyTorch SDPA backends and flex_attention. "
        "Defaults below: GPU / CPU grid; --quick picks a smaller one.",
    )
    p.add_argument("--quick", action="store_true", help="a small subset (about a minute)")
    p.add_argument(
        "--out",
        default=None,
        help="output folder for results.json and PNGs (default: benchmarks/out/<device>/, "
        "ignored by git: a run becomes a kept result only when it is copied to "
        "benchmarks/results/<device>/current/ on purpose)",
    )
    p.add_argument(
        "--regimes",
        default=None,
        help=f"comma list of {REGIMES} (default: all / train,decode,paged_prefill)",
    )
    p.add_argument(
        "--providers",
        default=None,
        help=f"comma list (default: all of GPU {GPU_PROVIDERS} / CPU {CPU_PROVIDERS}); a GPU "
        f"also has {GPU_OPTIONAL_PROVIDERS}",
    )
    p.add_argument(
        "--dtypes",
        default=None,
        help="comma list of bf16, fp16, fp32, training grid (default: bf16,fp16 / fp32,bf16; "
        "--quick: bf16 / fp32,bf16)",
    )
    p.add_argument(
        "--headdims",
        default=None,
        help="comma list of head dims, training grid (default: 64,128,256 / 64,128; --quick: "
        "128 / 64)",
    )
    p.add_argument(
        "--headdim-pairs",
        default=None,
        help="comma list of DxV training cells whose v has head dim V below q's and k's D, "
        "nheads = hidden / V, no GQA; '' for none (default: 192x128 / none; --quick: "
        "192x128 / 64x32)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma list of {MODES} (default: all; --quick on the CPU: fwd,fwd_bwd)",
    )
    p.add_argument(
        "--seqlens",
        default=None,
        help="comma list of training seqlens (default: 512..16384 / 128..2048, powers of 2; "
        "--quick: 2048,8192 / 128,256)",
    )
    p.add_argument(
        "--causal",
        default=None,
        choices=["both", "true", "false"],
        help="training grid (default: both)",
    )
    p.add_argument(
        "--decode-paged",
        action="store_true",
        help="also measure flash_attn_with_kvcache on a paged cache (page sizes: "
        "--decode-page-sizes)",
    )
    p.add_argument(
        "--decode-page-sizes",
        default=None,
        help="comma list of page sizes for --decode-paged (default: 1,16,256)",
    )
    p.add_argument("--decode-seqlens-q", default=None, help="comma list (default: 1,4; --quick: 1)")
    p.add_argument(
        "--decode-mla",
        action="store_true",
        help="also measure absorbed MLA decode (128 heads over one latent head, 576 / 512, "
        "v_cache = k_cache[..., :512]) at each decode batch, seqlen_q and seqlen_k, with the "
        "page sizes of --decode-paged; ours only",
    )
    p.add_argument(
        "--decode-headdim",
        type=int,
        default=None,
        help="head dim of the decode regime (default: 128; on the CPU 32-64); e.g. 512, "
        "which flash_attn_with_kvcache serves on CUDA",
    )
    p.add_argument(
        "--decode-seqlens-k",
        default=None,
        help="comma list (default: 4096..131072, powers of 2 / 1024,4096,16384; --quick: "
        "8192,65536 / 2048)",
    )
    p.add_argument(
        "--decode-batches",
        default=None,
        help="comma list (default: 1,4,16,64 / 1,4; --quick: 1,16 / 1)",
    )
    p.add_argument(
        "--decode-rounds",
        type=int,
        default=None,
        help="rounds per decode and paged_prefill case, in rotated order; a case "
        "reports their median (default: 3 / 1)",
    )
    p.add_argument(
        "--prefill-shapes",
        default=None,
        help="paged_prefill: comma list of BATCHxQ_CHUNKxCONTEXT (default: "
        "4x512x4096,4x2048x16384,8x128x8192,2x4096x4096 / 2x16x64,1x32x128; --quick: the "
        "first two / 2x16x64)",
    )
    p.add_argument(
        "--prefill-page-sizes",
        default=None,
        help="paged_prefill: comma list of page sizes, each measured against the "
        "contiguous call (default: 1,16,64,256 / 1,16)",
    )
    p.add_argument(
        "--memory-seqlens",
        default=None,
        help="comma list, GPU only (default: 1024..65536, powers of 2; --quick: 8192,32768)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="auto: the GPU when torch sees one (default: auto)",
    )
    p.add_argument(
        "--warmup-ms", type=float, default=25.0, help="GPU warm-up per measurement (default: 25)"
    )
    p.add_argument(
        "--rep-ms",
        type=float,
        default=100.0,
        help="GPU timing window per measurement (default: 100)",
    )
    p.add_argument(
        "--cpu-budget-s",
        type=float,
        default=None,
        help="CPU timing window per measurement (default: 0.5; --quick: 0.15)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument(
        "--cpu-standin",
        action="store_true",
        help="developer check: walk the GPU providers and regimes on the CPU with tiny "
        "shapes (numbers meaningless)",
    )
    add_grid_options(p)
    return p


def add_grid_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gqa-ratios",
        default=None,
        help="comma list of nheads/nheads_k ratios measured at every training shape, "
        "1 = MHA (default: 1, plus GQA 4:1 at head dim 128 on a GPU)",
    )


def select(args) -> tuple:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")
    use_gpu = torch.cuda.is_available() and args.device != "cpu" and not args.cpu_standin
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    if args.cpu_standin:
        grid, known, default_regimes = standin_grid(), GPU_PROVIDERS, REGIMES
    elif use_gpu:
        grid, known, default_regimes = gpu_grid(args.quick), GPU_PROVIDERS, REGIMES
    else:
        # No GPU: peak-memory rows would be empty, so that regime is off by default.
        grid, known, default_regimes = (
            cpu_grid(args.quick),
            CPU_PROVIDERS,
            ["train", "decode", "paged_prefill"],
        )

    if use_gpu:
        defaults = gpu_default_providers()
    else:
        # The stand-in walks GPU code paths on CPU tensors, which FA4 does not take.
        defaults = list(known)
    providers = parse_list(args.providers) or defaults
    if device.type == "cuda" or args.cpu_standin:
        known = known + [p for p in GPU_OPTIONAL_PROVIDERS if p not in known]
        providers = with_paired_anchors(providers)
    else:
        known = known + [p for p in CPU_OPTIONAL_PROVIDERS if p not in known]
    unknown = [p for p in providers if p not in known]
    if unknown:
        raise SystemExit(f"unknown provider(s) {unknown} on {device.type}; choose from {known}")
    args.regimes = parse_list(args.regimes) or default_regimes
    bad = [r for r in args.regimes if r not in REGIMES]
    if bad:
        raise SystemExit(f"unknown regime(s) {bad}; choose from {REGIMES}")

    if args.dtypes:
        grid.dtypes = parse_list(args.dtypes)
        bad = [d for d in grid.dtypes if d not in DTYPES]
        if bad:
            raise SystemExit(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    if args.headdims:
        grid.headdims = parse_list(args.headdims, int)
    if args.headdim_pairs is not None:
        grid.headdim_pairs = [parse_headdim_pair(t) for t in parse_list(args.headdim_pairs)]
    if args.modes:
        grid.modes = parse_list(args.modes)
        bad = [m for m in grid.modes if m not in MODES]
        if bad:
            raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.seqlens:
        grid.seqlens = parse_list(args.seqlens, int)
        grid.gqa_seqlens = None
    if args.causal:
        grid.causals = parse_bool_choice(args.causal)
    if args.gqa_ratios:
        grid.kv_ratios = parse_list(args.gqa_ratios, int)
        grid.gqa_cells = []
        bad = [r for r in grid.kv_ratios if r < 1]
        if bad:
            raise SystemExit(f"--gqa-ratios must be positive, got {bad}")
    if args.decode_seqlens_q:
        grid.decode_seqlens_q = parse_list(args.decode_seqlens_q, int)
    if args.decode_seqlens_k:
        grid.decode_seqlens_k = parse_list(args.decode_seqlens_k, int)
    grid.decode_mla = args.decode_mla
    if args.decode_headdim is not None:
        if not 8 <= args.decode_headdim <= 1024:
            raise SystemExit(f"--decode-headdim must be in [8, 1024], got {args.decode_headdim}")
        grid.decode_headdim = args.decode_headdim
    if args.decode_batches:
        grid.decode_batches = parse_list(args.decode_batches, int)
    if args.decode_rounds is not None and args.decode_rounds < 1:
        raise SystemExit(f"--decode-rounds must be at least 1, got {args.decode_rounds}")
    if args.decode_paged:
        grid.decode_page_sizes = parse_list(args.decode_page_sizes, int) or [1, 16, 256]
    if args.memory_seqlens:
        grid.memory_seqlens = parse_list(args.memory_seqlens, int)
    if args.prefill_shapes:
        grid.prefill_shapes = [parse_prefill_shape(t) for t in parse_list(args.prefill_shapes)]
    if args.prefill_page_sizes:
        grid.prefill_page_sizes = parse_list(args.prefill_page_sizes, int)
        bad = [ps for ps in grid.prefill_page_sizes if ps < 1]
        if bad:
            raise SystemExit(f"--prefill-page-sizes must be positive, got {bad}")
    if args.cpu_budget_s is None:
        args.cpu_budget_s = 0.15 if (args.quick or args.cpu_standin) else 0.5

    if args.out is None:
        if device.type == "cuda":
            name = sanitize(torch.cuda.get_device_name(device))
        else:
            name = "cpu-standin" if args.cpu_standin else "cpu"
        # Not the tracked results folder: a run lands there only on purpose.
        args.out = os.path.join(BENCH_DIR, "out", name)
    return device, grid, providers


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device, grid, providers = select(args)
    torch.manual_seed(0)
    if device.type == "cpu" and not args.cpu_standin:
        print("=" * 78)
        print("No CUDA GPU found: measuring flash_attn_cuda's CPU path against SDPA on the CPU.")
        print("These are CPU numbers; they say nothing about the GPU kernels.")
        print("=" * 78, flush=True)
    run = Run(args, device, grid, providers)
    print(
        f"device: {run.meta['gpu'] or run.meta['cpu']} ({device.type}); torch {run.meta['torch']}; "
        f"CUDA {run.meta['cuda']}; flash_attn_cuda {run.meta['flash_attn_cuda']}",
        flush=True,
    )
    if run.meta.get("flash_attn_cuda_error"):
        print(f"  {OURS} unavailable: {run.meta['flash_attn_cuda_error']}", flush=True)
    if device.type == "cuda" and FA4 not in providers:
        reason = load_fa4()[1]
        if reason:
            print(f"  {FA4} not measured: {reason}", flush=True)
    elif run.meta.get("fa4"):
        print(f"  {FA4}: flash-attn-4 {run.meta['fa4']}", flush=True)
    run.run()
    print_tables(run.meta, run.rows)
    out_json = os.path.join(args.out, "results.json")
    print(f"\n{len(run.rows)} rows written to {out_json}")
    if not args.no_plots:
        try:
            import plot_results

            for path in plot_results.make_plots(run.meta, run.rows, args.out):
                print(f"plot: {path}")
        except Exception as exc:  # plots are a convenience; the JSON is the record
            print(f"plots skipped: {first_line(exc)} (regenerate with benchmarks/plot_results.py)")
    if device.type == "cpu" and not args.cpu_standin:
        print("(no GPU found: every number above is a CPU number)")
    return exit_status(run)


def our_build_info() -> Optional[str]:
    """flash_attn_cuda.build_info, or None where the package does not import."""
    try:
        import flash_attn_cuda
    except ImportError:
        return None
    return getattr(flash_attn_cuda, "build_info", None)


def exit_status(run: Run) -> int:
    """1 when this project's kernels (flash_attn_cuda, and its deterministic and dropout
    rows) failed or disagreed with their reference (SDPA; with dropout the float64
    reference of the returned mask; paged, the contiguous call) anywhere, so CI can
    gate on it."""
    ours = [r for r in run.rows if r["provider"] in OWN_PROVIDERS]
    failed = [r for r in ours if r["error"] and not r["error"].startswith("skipped:")]
    wrong = [r for r in ours if r.get("warning")]
    if run.broken:
        print(f"FAILED: {run.broken}")
    if failed:
        print(
            f"FAILED: {failed[0]['provider']} raised on {len(failed)} of {len(ours)} cases, "
            f"e.g. {failed[0]['error'][:200]}"
        )
    if wrong:
        print(
            f"FAILED: {wrong[0]['provider']} disagreed with its reference on {len(wrong)} "
            f"cases, e.g. {wrong[0]['warning'][:200]}"
        )
    return 1 if (run.broken or failed or wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
