"""CUDA tests of flash_attn_with_kvcache over an FP8 (float8_e4m3fn) KV cache.

The split-KV kernel stages the cache's e4m3 bytes and converts each tile to
q's dtype before the products (exact: every e4m3 value is a float16 and a
bfloat16 value), folds k_descale into the scores' scale and v_descale into
the merge (docs/fp8.md, "The split-KV kernel over an e4m3 cache"). So the
result meets the usual criterion against the float64 attention of the
dequantised cache (tests/test_cpu_fp8.py's kvcache_reference), and agrees
with the CPU op, which computes the same function. Descales differ per
(batch entry, kv head), so a descale read for the wrong entry or head fails.

An append quantises into the cache as the CPU op does, bit for bit. Every
test here needs a GPU of compute capability 8.9 or newer and an fp8 build
(FLASH_ATTN_CUDA_DTYPES with fp8); each is skipped with a reason otherwise.
"""

import pytest
import torch

import reference as ref
from flash_attn_cuda import flash_attn_with_kvcache
from test_cpu_fp8 import (
    skip_below_sm89,
    check_append_quantises_what_a_16_bit_cache_holds,
    descales,
    kvcache_reference,
    make_cache,
)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _needs_sm89():
    skip_below_sm89("an FP8 KV cache")


def on(t, device):
    """t on device; None stays None."""
    return None if t is None else t.to(device)


def run_cuda_and_cpu(q, k_cache, v_cache, table, seqlens, k_s, v_s, num_splits=0, **features):
    """The same call on CUDA and on the CPU; both (out, lse)."""
    results = []
    for device in (DEVICE, "cpu"):
        results.append(
            flash_attn_with_kvcache(
                on(q, device),
                on(k_cache, device),
                on(v_cache, device),
                cache_seqlens=on(seqlens, device),
                block_table=on(table, device),
                k_descale=on(k_s, device),
                v_descale=on(v_s, device),
                num_splits=num_splits if device == DEVICE else 0,
                return_softmax_lse=True,
                **{
                    k: on(v, device) if isinstance(v, torch.Tensor) else v
                    for k, v in features.items()
                },
            )
        )
    return results


def check(out, lse, q, k_cache, v_cache, k_s, v_s, seqlens, table, cpu_out, **features):
    assert out.dtype == q.dtype and out.device.type == "cuda"
    ref_out, ref_lse, same_out = kvcache_reference(
        q, k_cache, v_cache, k_s, v_s, seqlens, table, **features
    )
    ref.assert_within_criterion(out.cpu(), ref_out, same_out)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    # The CPU op computes the same function in fp32: within the criterion of each other.
    ref.assert_within_criterion(out.cpu(), cpu_out.double(), same_out.to(out.dtype), factor=3.0)


@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "features",
    [dict(), dict(causal=True), dict(softcap=4.0, sink=True), dict(window_size=(5, 0))],
    ids=["plain", "causal", "softcap_sink", "window"],
)
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_matches_float64_of_the_dequantised_cache(page_size, dtype, features, seqlen_q):
    features = dict(features)
    batch, capacity, nheads, nheads_k, d = 3, 192, 8, 2, 128
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, page_size)
    seqlens = torch.tensor([1, 77, capacity], dtype=torch.int32)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype)
    k_s, v_s = descales(batch, nheads_k), descales(batch, nheads_k)
    sink = torch.randn(nheads) if features.pop("sink", False) else None
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(
        q, k_cache, v_cache, table, seqlens, k_s, v_s, **features, learnable_sink=sink
    )
    check(
        out,
        lse,
        q,
        k_cache,
        v_cache,
        k_s,
        v_s,
        seqlens,
        table,
        cpu_out,
        **features,
        learnable_sink=sink,
    )


@pytest.mark.parametrize("d", [64, 96, 256])
def test_head_dims(d):
    batch, capacity, nheads, nheads_k = 2, 130, 4, 1
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, None)
    seqlens = torch.tensor([130, 45], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16)
    k_s, v_s = descales(batch, nheads_k), descales(batch, nheads_k)
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(q, k_cache, v_cache, table, seqlens, k_s, v_s)
    check(out, lse, q, k_cache, v_cache, k_s, v_s, seqlens, table, cpu_out)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_q_past_float16_range(page_size, d):
    """With bfloat16 q the e4m3 decode variant at d64 / d128 runs Q K^T in
    float16, Q scaled by a power of two a block (docs/fp8.md, "Q K^T in
    float16"): heads far above float16's range (2^20) and far below it (2^-30)
    share a block with ordinary ones, and a head with an infinity leaves the
    others as they are."""
    batch, capacity, nheads, nheads_k = 2, 150, 8, 2
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, page_size)
    seqlens = torch.tensor([150, 37], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, d)
    q[:, :, 0] *= 2.0**20
    q[:, :, 1] *= 2.0**-30
    q = q.to(torch.bfloat16)
    k_s, v_s = descales(batch, nheads_k), descales(batch, nheads_k)
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(q, k_cache, v_cache, table, seqlens, k_s, v_s)
    check(out, lse, q, k_cache, v_cache, k_s, v_s, seqlens, table, cpu_out)

    q_inf = q.clone()
    q_inf[:, :, 3, 5] = float("inf")
    (out_inf, _), _ = run_cuda_and_cpu(q_inf, k_cache, v_cache, table, seqlens, k_s, v_s)
    others = [h for h in range(nheads) if h != 3]
    assert torch.equal(out_inf[:, :, others], out[:, :, others])


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_counts_agree(num_splits):
    """Splits change only the fp32 merge order: each split count meets the criterion."""
    batch, capacity, nheads, nheads_k, d = 2, 1000, 16, 4, 128
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, 16)
    seqlens = torch.tensor([1000, 613], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16)
    k_s, v_s = descales(batch, nheads_k), descales(batch, nheads_k)
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(
        q, k_cache, v_cache, table, seqlens, k_s, v_s, num_splits=num_splits
    )
    check(out, lse, q, k_cache, v_cache, k_s, v_s, seqlens, table, cpu_out)


def test_many_rows_per_kv_head():
    """32 packed rows per kv head (8 queries x 4 heads): the 64-row variant."""
    batch, capacity, nheads, nheads_k, d = 2, 300, 8, 2, 128
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, None)
    seqlens = torch.tensor([300, 120], dtype=torch.int32)
    q = torch.randn(batch, 8, nheads, d, dtype=torch.float16)
    k_s, v_s = descales(batch, nheads_k), descales(batch, nheads_k)
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(
        q, k_cache, v_cache, table, seqlens, k_s, v_s, causal=True
    )
    check(out, lse, q, k_cache, v_cache, k_s, v_s, seqlens, table, cpu_out, causal=True)


def test_descales_default_to_one_and_broadcast():
    """No descales: 1; vLLM's expanded (stride 0) descales: read as their values."""
    batch, capacity, nheads, nheads_k, d = 2, 64, 4, 2, 64
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, 16)
    seqlens = torch.tensor([64, 33], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16)
    ones = torch.ones(batch, nheads_k)
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(q, k_cache, v_cache, table, seqlens, None, None)
    check(out, lse, q, k_cache, v_cache, ones, ones, seqlens, table, cpu_out)
    k_s = torch.tensor([0.3]).expand(batch, nheads_k)
    v_s = torch.tensor([0.7]).expand(batch, nheads_k)
    assert k_s.stride() == (0, 0)
    (out, lse), (cpu_out, _) = run_cuda_and_cpu(q, k_cache, v_cache, table, seqlens, k_s, v_s)
    check(out, lse, q, k_cache, v_cache, k_s, v_s, seqlens, table, cpu_out)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary", [False, True])
def test_append_quantises_as_the_cpu_op(page_size, dtype, rotary):
    """k / v appended into an e4m3 cache are stored as the CPU op stores them,
    bit for bit (the rotation in q's dtype, then value / descale in fp32,
    saturated to +-448, rounded to nearest even); the attention over the
    result meets the criterion. Some new values saturate."""
    batch, capacity, nheads, nheads_k, d, seqlen_new = 3, 64, 8, 2, 128, 3
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, page_size)
    cache_seqlens = torch.tensor([0, 17, 61], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, d, dtype=dtype)
    k_new = (torch.randn(batch, seqlen_new, nheads_k, d) * 40).to(dtype)
    v_new = (torch.randn(batch, seqlen_new, nheads_k, d) * 40).to(dtype)
    k_s, v_s = descales(batch, nheads_k) * 0.2, descales(batch, nheads_k) * 0.2
    extra = {}
    if rotary:
        angles = torch.rand(capacity, d // 4) * 6.28
        extra = dict(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype))
    caches, outs = [], []
    for device in (DEVICE, "cpu"):
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)

        out, lse = flash_attn_with_kvcache(
            on(q, device),
            kc,
            vc,
            on(k_new, device),
            on(v_new, device),
            cache_seqlens=on(cache_seqlens, device),
            block_table=on(table, device),
            k_descale=on(k_s, device),
            v_descale=on(v_s, device),
            return_softmax_lse=True,
            **{k: on(v, device) for k, v in extra.items()},
        )
        caches.append((kc.cpu(), vc.cpu()))
        outs.append((out.cpu(), lse.cpu()))
    (k_gpu, v_gpu), (k_cpu, v_cpu) = caches
    assert torch.equal(k_gpu.view(torch.uint8), k_cpu.view(torch.uint8))
    assert torch.equal(v_gpu.view(torch.uint8), v_cpu.view(torch.uint8))
    assert int((k_cpu.float().abs() == 448).sum()) > 0
    (out_gpu, lse_gpu), (out_cpu, lse_cpu) = outs
    if rotary:
        # Both attend with q rotated by the same rule over the same cache bytes:
        # they differ by the order of the fp32 sums and P's rounding only.
        torch.testing.assert_close(out_gpu.float(), out_cpu.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse_gpu, lse_cpu, atol=1e-3, rtol=1e-4)
        return
    seqlens_k = cache_seqlens + seqlen_new
    ref_out, ref_lse, same_out = kvcache_reference(q, k_cpu, v_cpu, k_s, v_s, seqlens_k, table)
    ref.assert_within_criterion(out_gpu, ref_out, same_out)
    torch.testing.assert_close(lse_gpu.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_append_quantises_what_a_16_bit_cache_holds():
    """FA3's varlen new keys with cache_batch_idx and rotary: the e4m3 cache's
    new rows are the bf16 cache's new rows (the same call) quantised, bit for
    bit, a NaN kept as NaN: tests/test_cpu_fp8.py's check, on CUDA."""
    check_append_quantises_what_a_16_bit_cache_holds(DEVICE)


@pytest.mark.parametrize("page_size", [None, 1, 64])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_absorbed_mla_over_an_e4m3_latent_cache(page_size, num_splits):
    """Absorbed MLA (576 / 512, 128 query heads over one latent head) over an
    e4m3 latent cache, v_cache = k_cache[..., :512]: the kernel reads V in the
    K tile it converted, k_descale on the scores and v_descale on O."""
    batch, capacity, nheads, d_qk, d_v = 2, 128, 128, 576, 512
    k_cache, _, table = make_cache(batch, capacity, 1, d_qk, page_size)
    v_cache = k_cache[..., :d_v]
    seqlens = torch.tensor([77, capacity], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, d_qk, dtype=torch.bfloat16)
    k_s, v_s = descales(batch, 1), descales(batch, 1)
    kc = k_cache.to(DEVICE)
    out, lse = flash_attn_with_kvcache(
        q.to(DEVICE),
        kc,
        kc[..., :d_v],
        cache_seqlens=seqlens.to(DEVICE),
        block_table=None if table is None else table.to(DEVICE),
        k_descale=k_s.to(DEVICE),
        v_descale=v_s.to(DEVICE),
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    assert out.shape == (batch, 1, nheads, d_v)
    ref_out, ref_lse, same_out = kvcache_reference(q, k_cache, v_cache, k_s, v_s, seqlens, table)
    ref.assert_within_criterion(out.cpu(), ref_out, same_out)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=1e-5)
