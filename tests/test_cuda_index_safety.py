"""Bad values inside index tensors on the CUDA path (docs/memory_safety.md).

Every case hands a CUDA call one bad value in cu_seqlens / cache_seqlens /
cache_leftpad / cache_batch_idx / block_table / the rotary tables' reach, and
checks that

* the same call on CPU tensors raises, and the CUDA path raises the same
  message: at the call with sync checks on, from check_index_errors() or from
  the next call by default;
* the caller's buffers around a cache that the call writes into are untouched
  (the cache is a view into a larger buffer of sentinels);
* the process stays usable: a good call afterwards gives the right answer.

compute-sanitizer runs the same cases (scripts/sanitize_index.py) to show that
no access leaves the tensors.
"""

import math

import pytest
import torch

import flash_attn_cuda
from flash_attn_cuda import check_index_errors, set_sync_index_checks

pytestmark = pytest.mark.cuda

DTYPE = torch.bfloat16
HEAD_DIM = 128


@pytest.fixture(autouse=True)
def _clean_record():
    """Each test starts and ends with no recorded error and sync checks off."""
    if torch.cuda.is_available():
        try:
            check_index_errors()
        except RuntimeError:
            pass
    previous = set_sync_index_checks(False)
    yield
    set_sync_index_checks(previous)
    if torch.cuda.is_available():
        try:
            check_index_errors()
        except RuntimeError:
            pass


def _int32(values, device="cuda"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _first_line(error):
    return str(error).splitlines()[0]


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _cpu_message(fn, kwargs):
    """The message the CPU path raises for the same call (inputs moved to the CPU)."""
    cpu_kwargs = {name: _to(value, "cpu") for name, value in kwargs.items()}
    with pytest.raises(RuntimeError) as info:
        fn(**cpu_kwargs)
    return _first_line(info.value)


def _expect_cuda_error(fn, kwargs, pattern):
    """The CUDA call's error in all three reporting modes, equal to the CPU path's."""
    cpu = _cpu_message(fn, kwargs)
    assert pattern in cpu, cpu

    # Deferred (default): the call returns; check_index_errors() raises.
    fn(**kwargs)
    with pytest.raises(RuntimeError) as info:
        check_index_errors()
    assert _first_line(info.value) == cpu

    # Deferred: the next call raises, before it launches anything.
    fn(**kwargs)
    torch.cuda.synchronize()
    q = torch.randn(1, 4, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
    with pytest.raises(RuntimeError) as info:
        flash_attn_cuda.flash_attn_func(q, q, q)
    assert _first_line(info.value) == cpu
    assert "earlier call" in str(info.value)

    # Sync checks: the call itself raises.
    set_sync_index_checks(True)
    try:
        with pytest.raises(RuntimeError) as info:
            fn(**kwargs)
        assert _first_line(info.value) == cpu
    finally:
        set_sync_index_checks(False)
    _good_call_still_works()


def _good_call_still_works():
    q, k, v = (torch.randn(2, 33, 2, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(3))
    out = flash_attn_cuda.flash_attn_func(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(),
        k.transpose(1, 2).float(),
        v.transpose(1, 2).float(),
        is_causal=True,
    ).transpose(1, 2)
    assert (out.float() - ref).abs().max().item() < 2e-2
    check_index_errors()  # nothing recorded


# ----------------------------------------------------------------------------- varlen


def _varlen_call(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    block_table=None,
    causal=False,
    seqused_k=None,
    num_splits=1,
):
    return flash_attn_cuda.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        block_table=block_table,
        seqused_k=seqused_k,
        num_splits=num_splits,
    )


def _packed(rows, nheads=2):
    return [torch.randn(rows, nheads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(3)]


VARLEN_CASES = {
    # The report: a write past the output.
    "past_rows": (
        dict(cu_q=[0, 100, 4096], cu_k=[0, 100, 4096], max_q=4096, max_k=4096),
        "cu_seqlens_q[2] = 4096 exceeds the number of rows of its tensor (256)",
    ),
    "past_rows_k_only": (
        dict(cu_q=[0, 100, 200], cu_k=[0, 100, 300], max_q=128, max_k=256),
        "cu_seqlens_k[2] = 300 exceeds the number of rows",
    ),
    "decreasing": (
        dict(cu_q=[0, 120, 60], cu_k=[0, 120, 60], max_q=128, max_k=128),
        "cu_seqlens_q must be non-decreasing",
    ),
    "first_negative": (
        dict(cu_q=[-64, 100, 200], cu_k=[0, 100, 200], max_q=256, max_k=256),
        "cu_seqlens_q[0] must be >= 0, got -64",
    ),
    "longer_than_max": (
        dict(cu_q=[0, 100, 150], cu_k=[0, 100, 150], max_q=64, max_k=128),
        "sequence 0 has length 100 according to cu_seqlens_q, more than the "
        "max_seqlen given for it (64)",
    ),
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_forward_bad_cu_seqlens(case, causal, num_splits):
    """Also in the split-KV run of the forward (num_splits=3), which reads
    the sequences as the forward kernels do."""
    spec, pattern = VARLEN_CASES[case]
    q, k, v = _packed(256)
    kwargs = dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=_int32(spec["cu_q"]),
        cu_seqlens_k=_int32(spec["cu_k"]),
        max_seqlen_q=spec["max_q"],
        max_seqlen_k=spec["max_k"],
        causal=causal,
        num_splits=num_splits,
    )
    _expect_cuda_error(_varlen_call, kwargs, pattern)


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 512])
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_backward_bad_cu_seqlens(case, head_dim):
    """Also at head dim 512, the SM80 kernel's two head-dim slabs."""
    spec, pattern = VARLEN_CASES[case]
    q, k, v = (torch.randn(256, 2, head_dim, device="cuda", dtype=DTYPE) for _ in range(3))
    cu_q, cu_k = _int32(spec["cu_q"]), _int32(spec["cu_k"])

    def backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k):
        return torch.ops.flash_attn.varlen_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            None,
            spec["max_q"],
            spec["max_k"],
            0.0,
            head_dim**-0.5,
            False,
            -1,
            -1,
            0.0,
            False,
            None,
        )

    out = torch.randn_like(q)
    lse = torch.randn(q.shape[1], q.shape[0], device="cuda", dtype=torch.float32)
    kwargs = dict(
        q=q,
        k=k,
        v=v,
        out=out,
        lse=lse,
        dout=torch.randn_like(q),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )
    _expect_cuda_error(backward, kwargs, pattern)


# seqused_k[b] must lie in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]]; one bad value per case.
SEQUSED_CASES = {
    "past_sequence": (
        [64, 200],
        "seqused_k[1] = 200 must be in [0, 100] (the keys cu_seqlens_k gives sequence 1)",
    ),
    "negative": ([-3, 100], "seqused_k[0] = -3 must be in [0, 100]"),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(SEQUSED_CASES))
def test_varlen_forward_bad_seqused_k(case, causal):
    used, pattern = SEQUSED_CASES[case]
    q, k, v = _packed(256)
    cu = _int32([0, 100, 200])
    kwargs = dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=128,
        max_seqlen_k=128,
        causal=causal,
        seqused_k=_int32(used),
    )
    _expect_cuda_error(_varlen_call, kwargs, pattern)


@pytest.mark.parametrize("case", sorted(SEQUSED_CASES))
def test_varlen_backward_bad_seqused_k(case):
    used, pattern = SEQUSED_CASES[case]
    q, k, v = _packed(256)

    def backward(q, k, v, out, lse, dout, cu_seqlens, seqused_k):
        return torch.ops.flash_attn.varlen_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens,
            cu_seqlens,
            None,
            128,
            128,
            0.0,
            HEAD_DIM**-0.5,
            False,
            -1,
            -1,
            0.0,
            False,
            None,
            seqused_k=seqused_k,
        )

    lse = torch.randn(q.shape[1], q.shape[0], device="cuda", dtype=torch.float32)
    kwargs = dict(
        q=q,
        k=k,
        v=v,
        out=torch.randn_like(q),
        lse=lse,
        dout=torch.randn_like(q),
        cu_seqlens=_int32([0, 100, 200]),
        seqused_k=_int32(used),
    )
    _expect_cuda_error(backward, kwargs, pattern)


# seqused_q[b] must lie in [0, cu_seqlens_q[b + 1] - cu_seqlens_q[b]]: recorded by
# BlockInfo's guard in every kernel that reads it, as seqused_k.
SEQUSED_Q_CASES = {
    "past_sequence": (
        [64, 200],
        "seqused_q[1] = 200 must be in [0, 100] (the query rows cu_seqlens_q gives sequence 1)",
    ),
    "negative": ([-3, 100], "seqused_q[0] = -3 must be in [0, 100]"),
}


def _varlen_call_seqused_q(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, seqused_q):
    return flash_attn_cuda.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, 128, 128, causal=causal, seqused_q=seqused_q
    )


@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(SEQUSED_Q_CASES))
def test_varlen_forward_bad_seqused_q(case, causal, kernel, monkeypatch):
    if kernel == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", kernel)
    used, pattern = SEQUSED_Q_CASES[case]
    q, k, v = _packed(256)
    cu = _int32([0, 100, 200])
    kwargs = dict(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal, seqused_q=_int32(used)
    )
    _expect_cuda_error(_varlen_call_seqused_q, kwargs, pattern)


@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("case", sorted(SEQUSED_Q_CASES))
def test_varlen_backward_bad_seqused_q(case, kernel, monkeypatch):
    if kernel == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    monkeypatch.setenv("FLASH_ATTN_BWD_KERNEL", kernel)
    used, pattern = SEQUSED_Q_CASES[case]
    q, k, v = _packed(256)

    def backward(q, k, v, out, lse, dout, cu_seqlens, seqused_q):
        return torch.ops.flash_attn.varlen_bwd(
            dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, None, 128, 128, 0.0,
            HEAD_DIM**-0.5, False, -1, -1, 0.0, False, None, seqused_q=seqused_q,
        )  # fmt: skip

    lse = torch.randn(q.shape[1], q.shape[0], device="cuda", dtype=torch.float32)
    kwargs = dict(
        q=q,
        k=k,
        v=v,
        out=torch.randn_like(q),
        lse=lse,
        dout=torch.randn_like(q),
        cu_seqlens=_int32([0, 100, 200]),
        seqused_q=_int32(used),
    )
    _expect_cuda_error(backward, kwargs, pattern)


def _paged_varlen(table, cu_k, max_k, pages=4, page_size=16):
    (q,) = _packed(64)[:1]
    k_cache = torch.randn(pages, page_size, 2, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    return dict(
        q=q,
        k=k_cache,
        v=v_cache,
        cu_seqlens_q=_int32([0, 32, 64]),
        cu_seqlens_k=_int32(cu_k),
        max_seqlen_q=32,
        max_seqlen_k=max_k,
        block_table=_int32(table),
    )


@pytest.mark.parametrize("case", ["entry_past_pool", "negative_entry", "table_too_narrow"])
def test_paged_varlen_bad_block_table(case):
    if case == "entry_past_pool":
        kwargs, pattern = (
            _paged_varlen([[0, 1], [2, 1000]], [0, 32, 64], 32),
            "block_table[1, 1] = 1000 is not a valid block index in [0, 4)",
        )
    elif case == "negative_entry":
        kwargs, pattern = (
            _paged_varlen([[0, -3], [2, 3]], [0, 32, 64], 32),
            "block_table[0, 1] = -3 is not a valid block index",
        )
    else:
        kwargs, pattern = (
            _paged_varlen([[0, 1], [2, 3]], [0, 32, 80], 48),
            "sequence 1 has 48 keys, which need 3 blocks of page_size 16, but block_table has only 2",
        )
    _expect_cuda_error(_varlen_call, kwargs, pattern)


@pytest.mark.parametrize("case", ["past_table", "negative", "past_max_seqlen"])
def test_paged_varlen_bad_seqused_k(case):
    # With block_table, seqused_k[b] is sequence b's keys: at most what its row of
    # pages addresses (2 x 16 here) and max_seqlen_k.
    max_k = {"past_table": 48, "negative": 32, "past_max_seqlen": 20}[case]
    kwargs = _paged_varlen([[0, 1], [2, 3]], [0, 0, 0], max_k)
    used, pattern = {
        "past_table": ([40, 5], "seqused_k[0] = 40 must be in [0, 32] (with block_table"),
        "negative": ([1, -1], "seqused_k[1] = -1 must be in [0, 32]"),
        "past_max_seqlen": ([21, 5], "seqused_k[0] = 21 must be in [0, 20]"),
    }[case]
    kwargs["seqused_k"] = _int32(used)
    _expect_cuda_error(_varlen_call, kwargs, pattern)


# ----------------------------------------------------------------------------- KV cache


def _guarded_cache(shape, sentinel=7.0):
    """A cache that is a view into a larger buffer: the rows around it hold a
    sentinel that a write outside the cache would change."""
    buffer = torch.full((shape[0] + 2,) + tuple(shape[1:]), sentinel, device="cuda", dtype=DTYPE)
    cache = buffer[1:-1]
    cache.normal_()
    return buffer, cache


def _kvcache_call(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    cache_seqlens=None,
    block_table=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    rotary_cos=None,
    rotary_sin=None,
    causal=False,
    num_splits=0,
    rotary_seqlens=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
):
    return flash_attn_cuda.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        causal=causal,
        num_splits=num_splits,
        rotary_seqlens=rotary_seqlens,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=cu_seqlens_k_new,
        max_seqlen_q=max_seqlen_q,
    )


def _rotary_tables(rows):
    angle = torch.rand(rows, HEAD_DIM // 4, device="cuda") * math.pi
    return dict(rotary_cos=angle.cos().to(DTYPE), rotary_sin=angle.sin().to(DTYPE))


def _kvcache_case(case):
    """(kwargs, the sentinel buffers, expected message part) of one issue case."""
    q = torch.randn(1, 1, 2, HEAD_DIM, device="cuda", dtype=DTYPE)
    paged_cases = (
        "table_entry_1000",
        "seqlens_past_table",
        "append_past_table",
        "paged_batch_idx_past_table",
        "paged_batch_idx_negative_with_append",
    )
    if case.startswith("varlen_"):
        # FA3's varlen form: q (6 rows) and new keys (3 rows) split among 2
        # sequences by their offsets, over a paged cache of 2 rows of 2 pages.
        k_buf, k_cache = _guarded_cache((4, 64, 1, HEAD_DIM))
        v_buf, v_cache = _guarded_cache((4, 64, 1, HEAD_DIM))
        q = torch.randn(6, 2, HEAD_DIM, device="cuda", dtype=DTYPE)
        new = torch.randn(3, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
        kwargs = dict(
            block_table=_int32([[0, 1], [2, 3]]),
            cache_seqlens=_int32([10, 20]),
            k=new,
            v=new.clone(),
            causal=True,
            cu_seqlens_q=_int32([0, 2, 6]),
            cu_seqlens_k_new=_int32([0, 1, 3]),
            max_seqlen_q=4,
        )
        if case == "varlen_cu_q_past_rows":
            kwargs["cu_seqlens_q"] = _int32([0, 3, 7])
            pattern = "cu_seqlens_q[2] = 7 exceeds the number of rows of its tensor (6)"
        elif case == "varlen_cu_q_decreasing":
            kwargs["cu_seqlens_q"] = _int32([0, 4, 2])
            pattern = (
                "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[1] = 4 > cu_seqlens_q[2] = 2"
            )
        elif case == "varlen_cu_q_longer_than_max":
            kwargs["max_seqlen_q"] = 3
            pattern = "sequence 1 has length 4 according to cu_seqlens_q, more than the max_seqlen"
        elif case == "varlen_cu_new_negative":
            kwargs["cu_seqlens_k_new"] = _int32([-5, 1, 3])
            pattern = "cu_seqlens_k_new[0] must be >= 0, got -5"
        elif case == "varlen_cu_new_past_rows":
            kwargs["cu_seqlens_k_new"] = _int32([0, 1, 1000])
            pattern = "cu_seqlens_k_new[2] = 1000 exceeds the number of rows of its tensor (3)"
        elif case == "varlen_append_past_cache":
            kwargs["cache_seqlens"] = _int32([10, 127])
            pattern = "cache_seqlens[1] + seqlen_new = 127 + 2 must fit in the cache"
        else:
            raise AssertionError(case)
    elif case in paged_cases:
        k_buf, k_cache = _guarded_cache((4, 256, 1, HEAD_DIM))
        v_buf, v_cache = _guarded_cache((4, 256, 1, HEAD_DIM))
        if case == "table_entry_1000":
            kwargs = dict(block_table=_int32([[0, 1000]]), cache_seqlens=_int32([300]))
            pattern = "block_table[0, 1] = 1000 is not a valid block index in [0, 4)"
        elif case == "seqlens_past_table":
            kwargs = dict(block_table=_int32([[0]]), cache_seqlens=_int32([257]))
            pattern = (
                "cache_seqlens[0] = 257 must be in [0, 256] (the cache length: the rows "
                "block_table addresses"
            )
        elif case == "append_past_table":
            new = torch.randn(1, 1, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
            kwargs = dict(
                block_table=_int32([[0]]), cache_seqlens=_int32([256]), k=new, v=new.clone()
            )
            pattern = "cache_seqlens[0] + seqlen_new = 256 + 1 must fit in the cache"
        elif case == "paged_batch_idx_past_table":
            # With a paged cache cache_batch_idx picks a row of block_table (FA3's
            # rule): its bound is the table's rows (2), not the pool's pages (4).
            kwargs = dict(
                block_table=_int32([[0], [1]]),
                cache_seqlens=_int32([10]),
                cache_batch_idx=_int32([2]),
            )
            pattern = (
                "cache_batch_idx[0] = 2 must be in [0, 2) (the rows of block_table, "
                "which it selects with a paged cache)"
            )
        else:
            new = torch.randn(1, 1, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
            kwargs = dict(
                block_table=_int32([[0], [1]]),
                cache_seqlens=_int32([10]),
                cache_batch_idx=_int32([-1]),
                k=new,
                v=new.clone(),
            )
            pattern = "cache_batch_idx[0] = -1 must be in [0, 2) (the rows of block_table"
    else:
        batch = 2
        q = torch.randn(batch, 1, 2, HEAD_DIM, device="cuda", dtype=DTYPE)
        k_buf, k_cache = _guarded_cache((batch, 128, 1, HEAD_DIM))
        v_buf, v_cache = _guarded_cache((batch, 128, 1, HEAD_DIM))
        new = torch.randn(batch, 4, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
        if case == "append_past_contiguous":
            kwargs = dict(cache_seqlens=_int32([126, 3]), k=new, v=new.clone())
            pattern = "cache_seqlens[0] + seqlen_new = 126 + 4 must fit in the cache"
        elif case == "seqlens_past_cache":
            kwargs = dict(cache_seqlens=_int32([3, 129]))
            pattern = "cache_seqlens[1] = 129 must be in [0, 128] (the cache length)"
        elif case == "seqlens_negative":
            kwargs = dict(cache_seqlens=_int32([-5, 3]))
            pattern = "cache_seqlens[0] = -5 must be in [0, 128]"
        elif case == "batch_idx_7":
            kwargs = dict(cache_seqlens=_int32([3, 5]), cache_batch_idx=_int32([7, 0]))
            pattern = "cache_batch_idx[0] = 7 must be in [0, 2)"
        elif case == "batch_idx_negative_with_append":
            kwargs = dict(
                cache_seqlens=_int32([3, 5]), cache_batch_idx=_int32([0, -1]), k=new, v=new.clone()
            )
            pattern = "cache_batch_idx[1] = -1 must be in [0, 2)"
        elif case == "leftpad_past_seqlens":
            kwargs = dict(cache_seqlens=_int32([10, 5]), cache_leftpad=_int32([0, 6]))
            pattern = "cache_leftpad[1] = 6 must be in [0, cache_seqlens[1] = 5]"
        elif case == "rotary_past_tables":
            # Causal rotary turns query row i at position cache_seqlens + i: with
            # cache_seqlens 124 the 8 query rows reach position 131, past the 128 table
            # rows, though the 4 new keys (positions 124..127) fit.
            q = torch.randn(batch, 8, 2, HEAD_DIM, device="cuda", dtype=DTYPE)
            angle = torch.rand(128, HEAD_DIM // 4, device="cuda") * math.pi
            kwargs = dict(
                cache_seqlens=_int32([124, 0]),
                k=new,
                v=new.clone(),
                rotary_cos=angle.cos().to(DTYPE),
                rotary_sin=angle.sin().to(DTYPE),
                causal=True,
            )
            pattern = "rotary_cos / rotary_sin have 128 rows, but batch 0 needs position 131"
        elif case == "rotary_seqlens_negative":
            kwargs = dict(
                cache_seqlens=_int32([3, 5]),
                k=new,
                v=new.clone(),
                rotary_seqlens=_int32([0, -2]),
                **_rotary_tables(128),
            )
            pattern = "rotary_seqlens[1] = -2 must be >= 0"
        elif case == "rotary_seqlens_past_tables":
            # The cache rows (3..6) fit; the rotary positions of the 4 new keys,
            # 125..128, do not fit the 128 table rows.
            kwargs = dict(
                cache_seqlens=_int32([3, 5]),
                k=new,
                v=new.clone(),
                rotary_seqlens=_int32([125, 0]),
                **_rotary_tables(128),
            )
            pattern = (
                "rotary_cos / rotary_sin have 128 rows, but batch 0 needs position 128 "
                "(its positions start at rotary_seqlens[0] = 125)"
            )
        else:
            raise AssertionError(case)
    kwargs.update(q=q, k_cache=k_cache, v_cache=v_cache)
    return kwargs, (k_buf, v_buf), pattern


KVCACHE_CASES = [
    "table_entry_1000",
    "seqlens_past_table",
    "append_past_table",
    "append_past_contiguous",
    "seqlens_past_cache",
    "seqlens_negative",
    "batch_idx_7",
    "batch_idx_negative_with_append",
    "leftpad_past_seqlens",
    "rotary_past_tables",
    "rotary_seqlens_negative",
    "rotary_seqlens_past_tables",
    "paged_batch_idx_past_table",
    "paged_batch_idx_negative_with_append",
    "varlen_cu_q_past_rows",
    "varlen_cu_q_decreasing",
    "varlen_cu_q_longer_than_max",
    "varlen_cu_new_negative",
    "varlen_cu_new_past_rows",
    "varlen_append_past_cache",
]


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("case", KVCACHE_CASES)
def test_kvcache_bad_index_values(case, num_splits):
    kwargs, buffers, pattern = _kvcache_case(case)
    kwargs["num_splits"] = num_splits
    _expect_cuda_error(_kvcache_call, kwargs, pattern)
    for buffer in buffers:
        # The rows around the cache (first and last) were never written.
        assert (buffer[0] == 7.0).all() and (buffer[-1] == 7.0).all()


def test_flash_attn_block_table_bounds_message():
    """flash-attn's own check (its issue 2709): the message names block_table."""
    kwargs, _, _ = _kvcache_case("seqlens_past_table")
    set_sync_index_checks(True)
    with pytest.raises(RuntimeError, match="block_table"):
        _kvcache_call(**kwargs)


def test_graph_capture_records_and_a_later_call_raises():
    """Inside capture a bad value is clamped and recorded; replay neither
    corrupts memory nor raises; the next call outside capture raises."""
    kwargs, buffers, pattern = _kvcache_case("seqlens_past_cache")
    good = kwargs["cache_seqlens"].clone()
    kwargs["cache_seqlens"] = good.clone()
    kwargs["cache_seqlens"][1] = 5
    _kvcache_call(**kwargs)  # warm-up outside capture (creates the record)
    torch.cuda.synchronize()
    set_sync_index_checks(True)  # capture must not wait nor raise even so
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _kvcache_call(**kwargs)
    set_sync_index_checks(False)
    kwargs["cache_seqlens"].copy_(_int32([3, 129]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] = 129 must be in \[0, 128\]"):
        check_index_errors()
    kwargs["cache_seqlens"].copy_(_int32([3, 5]))
    graph.replay()
    check_index_errors()
    for buffer in buffers:
        assert (buffer[0] == 7.0).all() and (buffer[-1] == 7.0).all()


def test_good_sequences_unaffected_by_a_bad_one():
    """A bad value costs only its own sequence: the others' rows are right."""
    q, k, v = _packed(256)
    cu = _int32([0, 64, 128, 4096])
    out = flash_attn_cuda.flash_attn_varlen_func(q, k, v, cu, cu, 4096, 4096)
    with pytest.raises(RuntimeError, match="exceeds the number of rows"):
        check_index_errors()
    good = _int32([0, 64, 128])
    ref = flash_attn_cuda.flash_attn_varlen_func(q[:128], k[:128], v[:128], good, good, 64, 64)
    # Same values up to the kernel choice, which may follow max_seqlen.
    torch.testing.assert_close(out[:128], ref, atol=2e-2, rtol=0)
