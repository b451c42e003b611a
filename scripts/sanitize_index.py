"""Calls with bad index values for compute-sanitizer memcheck (not a pytest module).

    compute-sanitizer --tool memcheck python scripts/sanitize_index.py

Runs every case of tests/test_cuda_index_safety.py once (the kernels clamp the
bad value and record it; memcheck shows that no access leaves the tensors) and
checks that each one is reported: bad cu_seqlens, seqused_k and seqused_q
(forward and backward), paged varlen tables, and the KV-cache cases
(KVCACHE_CASES: cache_seqlens, cache_leftpad, cache_batch_idx also with a paged
cache, block_table, rotary positions, rotary_seqlens, and the varlen form's
cu_seqlens_q / cu_seqlens_k_new) at three num_splits; the varlen forward's bad
offsets also with num_splits=3 (its split-KV run). Exits non-zero if a
case is not reported.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from sanitize_calls import skips_left_out, summary  # noqa: E402

import test_cuda_index_safety as cases  # noqa: E402

from flash_attn_cuda import check_index_errors  # noqa: E402


@skips_left_out
def expect_reported(name, fn, kwargs, pattern):
    fn(**kwargs)
    try:
        check_index_errors()
    except RuntimeError as error:
        if pattern not in str(error):
            sys.exit(
                f"sanitize_index: {name}: reported {str(error).splitlines()[0]!r}, "
                f"expected {pattern!r}"
            )
        return
    sys.exit(f"sanitize_index: {name}: not reported")


def _varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q):
    torch.ops.flash_attn.varlen_bwd(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, None, 128, 128, 0.0,
        0.125, False, -1, -1, 0.0, False, None, seqused_q=seqused_q,
    )  # fmt: skip


@skips_left_out
def varlen_bwd_reported(name, q, k, v, kwargs, spec, causal):
    """varlen_bwd over the bad offsets of kwargs reports them (and stays inside its tensors)."""
    out = torch.randn_like(q)
    lse = torch.randn(q.shape[1], q.shape[0], device="cuda")
    torch.ops.flash_attn.varlen_bwd(
        torch.randn_like(q),
        q,
        k,
        v,
        out,
        lse,
        kwargs["cu_seqlens_q"],
        kwargs["cu_seqlens_k"],
        None,
        spec["max_q"],
        spec["max_k"],
        0.0,
        0.125,
        causal,
        -1,
        -1,
        0.0,
        False,
        None,
    )
    try:
        check_index_errors()
    except RuntimeError:
        pass
    else:
        sys.exit(f"sanitize_index: varlen_bwd {name}: not reported")


def main():
    torch.manual_seed(0)
    for name, (spec, pattern) in sorted(cases.VARLEN_CASES.items()):
        for causal in (False, True):
            q, k, v = cases._packed(256)
            kwargs = dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cases._int32(spec["cu_q"]),
                cu_seqlens_k=cases._int32(spec["cu_k"]),
                max_seqlen_q=spec["max_q"],
                max_seqlen_k=spec["max_k"],
                causal=causal,
            )
            expect_reported(f"varlen {name}", cases._varlen_call, kwargs, pattern)
            # The forward's split-KV run (num_splits) over the same offsets.
            expect_reported(
                f"varlen {name} splits=3", cases._varlen_call, dict(kwargs, num_splits=3), pattern
            )
            # The backward over the same offsets, and at head dim 512 (the
            # SM80 kernel's two head-dim slabs).
            varlen_bwd_reported(name, q, k, v, kwargs, spec, causal)
            wide = [torch.randn(*t.shape[:2], 512, device="cuda", dtype=t.dtype) for t in (q, k, v)]
            varlen_bwd_reported(f"{name} d512", *wide, kwargs, spec, causal)
    for name, (used, pattern) in sorted(cases.SEQUSED_CASES.items()):
        q, k, v = cases._packed(256)
        cu = cases._int32([0, 100, 200])
        kwargs = dict(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=128,
            max_seqlen_k=128,
            seqused_k=cases._int32(used),
        )
        expect_reported(f"varlen seqused_k {name}", cases._varlen_call, kwargs, pattern)
        torch.ops.flash_attn.varlen_bwd(
            torch.randn_like(q),
            q,
            k,
            v,
            torch.randn_like(q),
            torch.randn(q.shape[1], q.shape[0], device="cuda"),
            cu,
            cu,
            None,
            128,
            128,
            0.0,
            0.125,
            False,
            -1,
            -1,
            0.0,
            False,
            None,
            seqused_k=kwargs["seqused_k"],
        )
        try:
            check_index_errors()
        except RuntimeError:
            pass
        else:
            sys.exit(f"sanitize_index: varlen_bwd seqused_k {name}: not reported")
    # seqused_q: the forward and the backward, each on both kernel families
    # (run_sanitizers.sh runs this script with sm80 and with sm90 forced).
    for name, (used, pattern) in sorted(cases.SEQUSED_Q_CASES.items()):
        q, k, v = cases._packed(256)
        cu = cases._int32([0, 100, 200])
        seqused_q = cases._int32(used)
        for causal in (False, True):
            kwargs = dict(
                q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal, seqused_q=seqused_q
            )
            expect_reported(
                f"varlen seqused_q {name} causal={causal}",
                cases._varlen_call_seqused_q,
                kwargs,
                pattern,
            )
        kwargs = dict(
            dout=torch.randn_like(q),
            q=q,
            k=k,
            v=v,
            out=torch.randn_like(q),
            softmax_lse=torch.randn(q.shape[1], q.shape[0], device="cuda"),
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            seqused_q=seqused_q,
        )
        expect_reported(f"varlen_bwd seqused_q {name}", _varlen_bwd, kwargs, pattern)
    paged_seqused = cases._paged_varlen([[0, 1], [2, 3]], [0, 0, 0], 48)
    paged_seqused["seqused_k"] = cases._int32([40, 5])
    paged = {
        "entry_past_pool": (
            cases._paged_varlen([[0, 1], [2, 1000]], [0, 32, 64], 32),
            "is not a valid block index",
        ),
        "table_too_narrow": (
            cases._paged_varlen([[0, 1], [2, 3]], [0, 32, 80], 48),
            "but block_table has only 2",
        ),
        "seqused_k_past_table": (paged_seqused, "seqused_k[0] = 40 must be in [0, 32]"),
    }
    for name, (kwargs, pattern) in paged.items():
        expect_reported(f"paged varlen {name}", cases._varlen_call, kwargs, pattern)
    for name in cases.KVCACHE_CASES:
        for num_splits in (0, 1, 3):
            kwargs, _, pattern = cases._kvcache_case(name)
            kwargs["num_splits"] = num_splits
            expect_reported(
                f"kvcache {name} splits={num_splits}", cases._kvcache_call, kwargs, pattern
            )
    torch.cuda.synchronize()
    print(summary("sanitize_index").replace("all calls completed", "every bad value was reported"))


if __name__ == "__main__":
    main()
