"""CUDA forward kernel against an fp32 reference (the criterion of docs/architecture.md).

Every test here needs a GPU and is skipped with a reason without one.
"""

import itertools
import re

import pytest
import torch

import reference
import s_dmask
from reference import assert_within_criterion, attention_ref

import flash_attn_cuda  # registers the ops
from cuda_inputs import (
    DEVICE,
    DTYPES,
    HEAD_DIMS,
    many_short_sequences,
    poison_allocator,
    random_cu_seqlens,
    random_qkv,
    rows_of_sequences_of_length,
)

pytestmark = pytest.mark.cuda

# The Hopper forward draws dropout at every head dim it serves, on a tile that
# leaves registers to spare (plan.h fwd_sm90_dropout_tile: d64 128 x 128,
# d256 128 x 64); d32 has no Hopper forward.
HEAD_DIMS_WITHOUT_HOPPER_DROPOUT = (32,)

SEQLEN_PAIRS = [
    (1, 1),
    (2, 2),
    (1, 129),
    (17, 17),
    (113, 203),
    (127, 128),
    (128, 127),
    (129, 129),
    (255, 17),
    (17, 255),
    (1023, 1024),
    (2049, 2049),
]


@pytest.fixture(params=["sm90", "sm80"])
def fwd_kernel(request, monkeypatch):
    """Which forward kernel runs the plain score rule. On an sm90 GPU the head
    dims with a Hopper tile (csrc/cuda/fwd/fwd_tile_config.h) have two kernels, picked
    by shape; FLASH_ATTN_FWD_KERNEL forces one, so both are checked on every
    shape. Other GPUs run the SM80-design kernel only."""
    if torch.cuda.get_device_capability() != (9, 0):
        if request.param == "sm90":
            pytest.skip("the Hopper forward kernel runs on sm90 GPUs only")
        return request.param
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", request.param)
    return request.param


@pytest.fixture
def sm90_auto_choice(monkeypatch):
    """For the tests of which Hopper forward grid the launcher picks by shape:
    an sm90 GPU, a build with sm_90a machine code, and no
    FLASH_ATTN_FWD_KERNEL forcing a kernel."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward kernel runs on sm90 GPUs only")
    if "sm_90a" not in flash_attn_cuda.build_info:
        pytest.skip("this build has no sm_90a machine code: " + flash_attn_cuda.build_info)
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)


def run_fwd(
    q,
    k,
    v,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    softmax_scale=None,
    return_softmax=False,
    seed=0,
    offset=0,
):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    poison_allocator()
    return torch.ops.flash_attn.fwd(
        q,
        k,
        v,
        alibi_slopes,
        dropout_p,
        softmax_scale,
        causal,
        window[0],
        window[1],
        softcap,
        return_softmax,
        seed,
        offset,
        None,
    )


def forward_kernel_names(q, k, v, **kwargs):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_fwd(q, k, v, **kwargs)
        torch.cuda.synchronize()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize(
    "head_dim,min_keys_sm90,min_blocks_per_sm",
    [(64, 512, 8), (96, 512, 4), (128, 256, 4), (256, 0, 0)],
)
def test_fwd_kernel_choice_on_sm90(
    head_dim, min_keys_sm90, min_blocks_per_sm, sm90_auto_choice, monkeypatch
):
    uses_sm90 = lambda names: any("flash_fwd_sm90_kernel" in name for name in names)
    q, k, v = random_qkv(1, 256, 512, 2, 2, head_dim, torch.bfloat16)
    _, k_short, v_short = random_qkv(1, 256, 128, 2, 2, head_dim, torch.bfloat16)
    # By shape: the Hopper kernel from the table's key count on (fwd_tile_config.h)
    # for a call of few query blocks.
    assert uses_sm90(forward_kernel_names(q, k, v, causal=True))
    assert uses_sm90(forward_kernel_names(q, k_short, v_short)) == (128 >= min_keys_sm90)
    # Below it, calls of many query blocks of 128 rows (the table's
    # kMinBlocksPerSmSm90 per SM; fwd_sm90_by_shape in fwd_tile_schedule.h)
    # take the Hopper kernel too: here 12 and 4 per SM.
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    q_many, k_many, v_many = random_qkv(3 * sms, 256, 128, 2, 2, head_dim, torch.bfloat16)
    assert uses_sm90(forward_kernel_names(q_many, k_many, v_many))
    assert uses_sm90(forward_kernel_names(q_many, k_many, v_many, causal=True))
    q_four, k_four, v_four = random_qkv(sms, 256, 128, 2, 2, head_dim, torch.bfloat16)
    assert uses_sm90(forward_kernel_names(q_four, k_four, v_four)) == (
        128 >= min_keys_sm90 or min_blocks_per_sm <= 4
    )
    # Softcap, ALiBi and dropout take the Hopper kernel by the same rule.
    slopes = torch.rand(2, device=DEVICE) * 0.3
    assert uses_sm90(forward_kernel_names(q, k, v, softcap=5.0))
    assert uses_sm90(forward_kernel_names(q, k, v, causal=True, alibi_slopes=slopes))
    assert uses_sm90(forward_kernel_names(q_many, k_many, v_many, softcap=5.0))
    assert uses_sm90(forward_kernel_names(q, k_short, v_short, softcap=5.0)) == (
        128 >= min_keys_sm90
    )
    # ... and dropout, on a tile that draws it (plan.h fwd_sm90_dropout_tile).
    draws = head_dim not in HEAD_DIMS_WITHOUT_HOPPER_DROPOUT
    assert uses_sm90(forward_kernel_names(q, k, v, softcap=5.0, dropout_p=0.1)) == draws
    assert uses_sm90(forward_kernel_names(q, k, v, causal=True, dropout_p=0.1)) == draws
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", "sm90")
    assert uses_sm90(forward_kernel_names(q, k_short, v_short))
    # Inputs TMA cannot describe (a head stride of 0) run the SM80 kernel.
    k_shared = k[:, :, :1].expand(-1, -1, 2, -1)
    assert not uses_sm90(forward_kernel_names(q, k_shared, v))
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", "sm80")
    assert not uses_sm90(forward_kernel_names(q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fwd_broadcast_kv_head(dtype, head_dim, fwd_kernel):
    """K / V of one kv head broadcast over the kv heads (stride 0), which the
    Hopper kernel's TMA copies cannot describe."""
    q, k, v = random_qkv(2, 300, 700, 4, 2, head_dim, dtype)
    k, v = k[:, :, :1].expand(-1, -1, 2, -1), v[:, :, 1:].expand(-1, -1, 2, -1)
    out, lse, _, _ = run_fwd(q, k, v, causal=True)
    check_against_reference(q, k, v, out, lse, causal=True)


def check_against_reference(q, k, v, out, lse, **ref_kwargs):
    ref_out, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float32, **ref_kwargs)
    same_out, _ = attention_ref(q, k, v, compute_dtype=q.dtype, **ref_kwargs)
    assert not out.isnan().any(), "output has NaN (unwritten or poisoned element)"
    assert_within_criterion(out, ref_out, same_out, name="out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite), "lse +inf rows differ from the reference"
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_shapes(dtype, head_dim, seqlen_q, seqlen_k, causal, fwd_kernel):
    batch = 2 if seqlen_q * seqlen_k < 1 << 20 else 1
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
    out, lse, _, _ = run_fwd(q, k, v, causal=causal)
    check_against_reference(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(0, 0), (16, 0), (63, 17), (-1, 40), (100, -1)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (256, 256), (300, 129)])
def test_fwd_local(dtype, head_dim, window, seqlen_q, seqlen_k, fwd_kernel):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 4, head_dim, dtype)
    out, lse, _, _ = run_fwd(q, k, v, window=window)
    check_against_reference(q, k, v, out, lse, window_size=window)


def splitkv_fwd_names(q, k, v, **kwargs):
    names = forward_kernel_names(q, k, v, **kwargs)
    assert any("flash_fwd_splitkv_kernel" in n for n in names), names
    assert not any("flash_fwd_sm90_kernel" in n or "flash_fwd_kernel" in n for n in names), names
    return names


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 77), (1, 3000), (3, 700), (4, 2)])
@pytest.mark.parametrize("nheads,nheads_k", [(32, 8), (6, 6), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_decode_shapes_on_splitkv(
    dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, causal, monkeypatch
):
    """A fixed-length call whose query rows of a kv head fit one split-KV
    query block runs the split-KV kernel (plan_fwd_split): one split or
    several with the combine, rows that see no key (causal, more queries
    than keys) included."""
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    if head_dim == 128 and nheads == 32:
        splitkv_fwd_names(q, k, v, causal=causal)
    out, lse, _, _ = run_fwd(q, k, v, causal=causal)
    check_against_reference(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "feature", ["window", "softcap", "alibi", "negative_scale", "strided", "out", "sink"]
)
def test_fwd_decode_shape_features_on_splitkv(head_dim, feature, monkeypatch):
    """The score features, strided inputs, out= and sinks of a decode-shaped
    fwd call on the split-KV kernel, against the reference."""
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    batch, nheads, nheads_k = 3, 16, 4
    q, k, v = random_qkv(batch, 2, 1500, nheads, nheads_k, head_dim, torch.bfloat16)
    kwargs, ref = {}, {}
    if feature == "window":
        kwargs, ref = dict(window=(300, 0)), dict(window_size=(300, 0))
    elif feature == "softcap":
        kwargs = ref = dict(softcap=20.0, causal=True)
    elif feature == "alibi":
        slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
        kwargs = ref = dict(alibi_slopes=slopes, causal=True)
    elif feature == "negative_scale":
        kwargs = ref = dict(softmax_scale=-0.1)
    elif feature == "strided":
        q = torch.randn(batch, nheads, 2, head_dim, device=DEVICE).bfloat16().transpose(1, 2)
        k, v = (
            torch.randn(batch, 2 * nheads_k, 1500, head_dim, device=DEVICE)
            .bfloat16()[:, ::2]
            .transpose(1, 2)
            for _ in range(2)
        )
    splitkv_fwd_names(q, k, v, **kwargs)
    if feature == "out":
        out = torch.full_like(q, float("nan"))
        lse, _, _ = torch.ops.flash_attn.fwd_out(
            q, k, v, None, 0.0, head_dim**-0.5, True, -1, 0, 0.0, False, 0, 0, None, out=out
        )
        check_against_reference(q, k, v, out, lse, causal=True)
        return
    if feature == "sink":
        sink = torch.randn(nheads, device=DEVICE) * 2.0
        out, lse, _, _ = torch.ops.flash_attn.fwd(
            q,
            k,
            v,
            None,
            0.0,
            head_dim**-0.5,
            True,
            -1,
            0,
            0.0,
            False,
            0,
            0,
            None,
            learnable_sink=sink,
        )
        ref_out, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
        same_out, _ = attention_ref(
            q, k, v, causal=True, learnable_sink=sink, compute_dtype=q.dtype
        )
        assert_within_criterion(out, ref_out, same_out, name="out")
        torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3)
        return
    out, lse, _, _ = run_fwd(q, k, v, **kwargs)
    check_against_reference(q, k, v, out, lse, **ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("softcap", [0.0, 5.0, 30.0])
@pytest.mark.parametrize("alibi", [None, "heads", "batch_heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_softcap_alibi(dtype, head_dim, softcap, alibi, causal, fwd_kernel):
    batch, nheads = 2, 4
    q, k, v = random_qkv(batch, 129, 257, nheads, 2, head_dim, dtype)
    slopes = None
    if alibi == "heads":
        slopes = torch.rand(nheads, device=DEVICE) * 0.3
    elif alibi == "batch_heads":
        slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
    out, lse, _, _ = run_fwd(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)
    check_against_reference(q, k, v, out, lse, causal=causal, softcap=softcap, alibi_slopes=slopes)


@pytest.mark.parametrize("head_dim", [32, 96, 160, 192, 224, 256])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (70, 20)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 421), (1100, 700)])
def test_fwd_softcap_alibi_other_head_dims(head_dim, window, seqlen_q, seqlen_k, fwd_kernel):
    """Softcap and ALiBi together at the remaining head dims (each has its own
    Hopper tile), under causal and local masks, over several query and key
    blocks; the longer call has more query blocks than an H100 has SMs, so
    the Hopper kernel's persistent grid runs it where the head dim has one."""
    batch, nheads = 2, 4
    if seqlen_q > 1000:
        batch, nheads = 4, 8
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, 2, head_dim, torch.bfloat16)
    slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
    out, lse, _, _ = run_fwd(q, k, v, window=window, softcap=15.0, alibi_slopes=slopes)
    check_against_reference(
        q, k, v, out, lse, window_size=window, softcap=15.0, alibi_slopes=slopes
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", ["plain", "softcap", "alibi"])
@pytest.mark.parametrize("spread", [1.0, 10.0])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (70, 20)])
def test_fwd_negative_softmax_scale(head_dim, features, spread, window, fwd_kernel):
    """A negative scale (legal, if odd) flips which raw score is a row's max:
    the plain kernels, which fold the scale into exp2, track the max of the
    raw scores, so such a call runs a variant that does not: SM80's, which
    scales each score first, or the Hopper score-mods one, which keeps the
    scores negated in units of |scale| (score_mods.h)."""
    q, k, v = random_qkv(2, 256, 600, 4, 2, head_dim, torch.bfloat16)
    q, k = (q.float() * spread).bfloat16(), (k.float() * spread).bfloat16()
    softcap = 30.0 if features == "softcap" else 0.0
    slopes = torch.rand(4, device=DEVICE) * 0.3 if features == "alibi" else None
    out, lse, _, _ = run_fwd(
        q, k, v, window=window, softcap=softcap, alibi_slopes=slopes, softmax_scale=-0.1
    )
    check_against_reference(
        q,
        k,
        v,
        out,
        lse,
        softmax_scale=-0.1,
        window_size=window,
        softcap=softcap,
        alibi_slopes=slopes,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads,nheads_k", [(8, 8), (8, 4), (8, 1), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_gqa(dtype, nheads, nheads_k, causal, fwd_kernel):
    q, k, v = random_qkv(3, 200, 333, nheads, nheads_k, 128, dtype)
    out, lse, _, _ = run_fwd(q, k, v, causal=causal)
    check_against_reference(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fwd_strided_views_of_packed_qkv(dtype, head_dim, fwd_kernel):
    qkv = torch.randn(2, 177, 3, 6, head_dim, device=DEVICE, dtype=dtype)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out, lse, _, _ = run_fwd(q, k, v, causal=True)
    check_against_reference(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap,alibi", [(0.0, False), (10.0, True)])
def test_varlen_fwd(dtype, head_dim, causal, softcap, alibi, fwd_kernel):
    batch, nheads, nheads_k = 5, 4, 2
    cu_q, max_q = random_cu_seqlens(batch, 150)
    cu_k, max_k = random_cu_seqlens(batch, 300)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3 if alibi else None
    scale = head_dim**-0.5
    poison_allocator()
    out, lse, _, _ = torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q.to(DEVICE),
        cu_k.to(DEVICE),
        None,
        slopes,
        max_q,
        max_k,
        0.0,
        scale,
        causal,
        -1,
        -1,
        softcap,
        False,
        0,
        0,
        None,
    )
    assert not out.isnan().any()
    for b in range(batch):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke]
        sb = slopes[b] if alibi else None
        ref_out, ref_lse = attention_ref(
            qb, kb, vb, causal=causal, softcap=softcap, alibi_slopes=sb, compute_dtype=torch.float32
        )
        same_out, _ = attention_ref(
            qb, kb, vb, causal=causal, softcap=softcap, alibi_slopes=sb, compute_dtype=dtype
        )
        assert_within_criterion(out[None, qs:qe], ref_out, same_out, name=f"out[batch {b}]")
        lse_b = lse[:, qs:qe]
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isinf(lse_b), ~finite)
        torch.testing.assert_close(lse_b[finite], ref_lse[0][finite].float(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fwd_ignores_rows_outside_sequences(dtype, head_dim, causal, fwd_kernel):
    """A sequence's last key tile reaches into the next sequence's rows, and
    the last sequence's into rows past cu_seqlens_k[-1]; rows that are not
    finite there must not reach the sequence's output."""
    nheads, nheads_k = 4, 2
    cu_q = torch.tensor([0, 50, 127, 257], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 177, 377], dtype=torch.int32)
    total_k = int(cu_k[-1]) + 64  # 64 rows of padding after the last sequence
    q = torch.randn(int(cu_q[-1]), nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    for t in (k, v):
        t[100:177] = float("nan")  # all of sequence 1
        t[377:] = float("inf")  # the padding
    poison_allocator()
    out, lse, _, _ = torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q.to(DEVICE),
        cu_k.to(DEVICE),
        None,
        None,
        130,
        200,
        0.0,
        head_dim**-0.5,
        causal,
        -1,
        -1,
        0.0,
        False,
        0,
        0,
        None,
    )
    for b in (0, 2):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke]
        ref_out, ref_lse = attention_ref(qb, kb, vb, causal=causal, compute_dtype=torch.float32)
        same_out, _ = attention_ref(qb, kb, vb, causal=causal, compute_dtype=dtype)
        assert not out[qs:qe].isnan().any(), f"sequence {b}: NaN from rows outside it"
        assert_within_criterion(out[None, qs:qe], ref_out, same_out, name=f"out[batch {b}]")
        torch.testing.assert_close(lse[:, qs:qe], ref_lse[0].float(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 224, 256])
def test_fwd_more_query_blocks_than_sms(dtype, head_dim, fwd_kernel):
    """Without a causal or local bound the Hopper kernel runs one block per SM,
    each walking several query blocks (fwd_launch.h), in fixed shares
    at fixed length and taken from a counter in a varlen batch (where many
    blocks of the grid lie past their sequence's end): a grid of more query
    blocks than any GPU has SMs."""
    q, k, v = random_qkv(4, 1000, 777, 8, 2, head_dim, dtype)  # 256 query blocks
    out, lse, _, _ = run_fwd(q, k, v)
    check_against_reference(q, k, v, out, lse)

    cu_q, max_q = random_cu_seqlens(40, 300)
    cu_k, max_k = random_cu_seqlens(40, 400)
    check_varlen_against_reference(cu_q, cu_k, max_q, max_k, 4, 2, head_dim, dtype)


def check_varlen_against_reference(
    cu_q, cu_k, max_q, max_k, nheads, nheads_k, head_dim, dtype, causal=False
):
    """The varlen forward on random inputs of these sequence lengths, each
    sequence against the reference on its own rows."""
    q = torch.randn(int(cu_q[-1]), nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    poison_allocator()
    out, lse, _, _ = torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q.to(DEVICE),
        cu_k.to(DEVICE),
        None,
        None,
        max_q,
        max_k,
        0.0,
        head_dim**-0.5,
        causal,
        -1,
        -1,
        0.0,
        False,
        0,
        0,
        None,
    )
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke]
        ref_out, ref_lse = attention_ref(qb, kb, vb, causal=causal, compute_dtype=torch.float32)
        same_out, _ = attention_ref(qb, kb, vb, causal=causal, compute_dtype=dtype)
        assert_within_criterion(out[None, qs:qe], ref_out, same_out, name=f"out[batch {b}]")
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isinf(lse[:, qs:qe]), ~finite)
        torch.testing.assert_close(
            lse[:, qs:qe][finite], ref_lse[0][finite].float(), atol=2e-3, rtol=1e-3
        )


def counter_kernel_ran(names):
    """Whether the Hopper forward ran on the persistent grid that takes its
    tiles from a counter (the kernel's second template argument, after the
    traits; the bools after it are the score mods and the paged keys)."""
    grids = (
        re.search(r"flash_fwd_sm90_kernel<flash::FwdSm90KernelTraits<[^>]*>, (true|false)", name)
        for name in names
    )
    return any(grid is not None and grid.group(1) == "true" for grid in grids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 224, 256])
def test_fwd_tiles_from_counter(dtype, head_dim, fwd_kernel):
    """With a causal or local bound and more query blocks than SMs, the Hopper
    kernel's blocks take their query blocks from a counter, one at a time
    (fwd_tile_schedule.h): causal with more or fewer keys than queries (whole
    query blocks that see no key), a window, and a varlen batch with empty
    sequences (tiles past a sequence's end)."""
    q, k, v = random_qkv(4, 1000, 1500, 8, 2, head_dim, dtype)  # 256 query blocks of 128
    out, lse, _, _ = run_fwd(q, k, v, causal=True)
    check_against_reference(q, k, v, out, lse, causal=True)
    out, lse, _, _ = run_fwd(q, k, v, window=(300, 40))
    check_against_reference(q, k, v, out, lse, window_size=(300, 40))
    q, k, v = random_qkv(4, 1000, 300, 8, 2, head_dim, dtype)
    out, lse, _, _ = run_fwd(q, k, v, causal=True)
    check_against_reference(q, k, v, out, lse, causal=True)

    batch = 40
    lengths_q, lengths_k = torch.randint(0, 701, (batch,)), torch.randint(0, 901, (batch,))
    lengths_q[0], lengths_k[0] = 700, 900
    lengths_q[5] = 0  # no queries
    lengths_k[7] = 0  # queries that see no key
    cu_q = torch.zeros(batch + 1, dtype=torch.int32)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32)
    cu_q[1:], cu_k[1:] = torch.cumsum(lengths_q, 0), torch.cumsum(lengths_k, 0)
    check_varlen_against_reference(cu_q, cu_k, 700, 900, 8, 2, head_dim, dtype, causal=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fwd_counter_grid_choice_on_sm90(head_dim, sm90_auto_choice):
    """The counter grid runs for causal / local / varlen shapes of more query
    blocks than SMs whose query blocks see at most 2048 keys, and not
    otherwise (nor at d256, whose kernel walks one query block per block)."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    batch = sms // 8 + 1  # 16 query blocks x 8 heads x batch > SMs
    q, k, v = random_qkv(batch, 2048, 2048, 8, 8, head_dim, torch.bfloat16)
    takes_counter = head_dim != 256
    assert counter_kernel_ran(forward_kernel_names(q, k, v, causal=True)) == takes_counter
    assert counter_kernel_ran(forward_kernel_names(q, k, v, window=(500, 0))) == takes_counter
    assert not counter_kernel_ran(forward_kernel_names(q, k, v))  # fixed shares
    _, k_long, v_long = random_qkv(batch, 2048, 2049, 8, 8, head_dim, torch.bfloat16)
    assert not counter_kernel_ran(forward_kernel_names(q, k_long, v_long, causal=True))
    assert (
        counter_kernel_ran(forward_kernel_names(q, k_long, v_long, window=(1000, 0)))
        == takes_counter
    )
    q_few, k_few, v_few = random_qkv(1, 2048, 2048, 8, 8, head_dim, torch.bfloat16)
    assert not counter_kernel_ran(forward_kernel_names(q_few, k_few, v_few, causal=True))
    # A varlen batch's sequences differ in length: the counter, non-causal too.
    cu = torch.arange(0, (batch + 1) * 2048, 2048, dtype=torch.int32, device=DEVICE)
    packed = [t.reshape(-1, 8, head_dim) for t in (q, k, v)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.ops.flash_attn.varlen_fwd(
            *packed,
            cu,
            cu,
            None,
            None,
            2048,
            2048,
            0.0,
            head_dim**-0.5,
            False,
            -1,
            -1,
            0.0,
            False,
            0,
            0,
            None,
        )
        torch.cuda.synchronize()
    assert counter_kernel_ran({event.name for event in prof.events()}) == takes_counter


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_fwd_zeroes_a_tile_counter_only_for_the_counter_grid(head_dim, sm90_auto_choice):
    """Causal calls of more query blocks than SMs and at most 2048 keys may
    take their tiles from a counter. The launcher zeroes it only when the grid
    it picks does: one memset beside the counter kernel, and none at d32 /
    d256 (no counter grid) or for d64 at 256 keys (the SM80 kernel's). Every
    call also zeroes its returned rng_state (no dropout) by one memset
    (rng_state_for in op_common.cpp)."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    batch = sms // 8 + 1  # at least 2 query blocks x 8 heads x batch > SMs
    for seqlen in (256, 2048):
        q, k, v = random_qkv(batch, seqlen, seqlen, 8, 8, head_dim, torch.bfloat16)
        torch.ops.flash_attn.fwd(
            q, k, v, None, 0.0, head_dim**-0.5, True, -1, -1, 0.0, False, 0, 0, None
        )  # warm-up: first-call allocations stay out
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.flash_attn.fwd(
                q, k, v, None, 0.0, head_dim**-0.5, True, -1, -1, 0.0, False, 0, 0, None
            )
            torch.cuda.synchronize()
        on_gpu = [
            event.name
            for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
        ]
        counter_ran = counter_kernel_ran(on_gpu)
        counter_grid_lengths = {64: (2048,), 128: (256, 2048)}.get(head_dim, ())
        assert counter_ran == (seqlen in counter_grid_lengths), on_gpu
        memsets = [name for name in on_gpu if "memset" in name.lower()]
        assert len(memsets) == 1 + int(counter_ran), on_gpu


def sm90_block_rows(names):
    """The query rows of the Hopper forward kernels that ran (the second
    argument of their traits)."""
    found = set()
    for name in names:
        match = re.search(r"flash_fwd_sm90_kernel<.*?FwdSm90KernelTraits<(\d+), (\d+),", name)
        if match:
            found.add(int(match.group(2)))
    return found


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fwd_block_rows_on_sm90(head_dim, sm90_auto_choice):
    """The tile table's query block (192 rows, three MMA warpgroups, at head
    dim 64) runs every Hopper grid but the counter's, which keeps 128 rows:
    one block per query block, fixed shares of a persistent grid (checked
    against the reference too) and the counter grid."""
    table_rows = 192 if head_dim == 64 else 128
    q, k, v = random_qkv(2, 700, 900, 4, 2, head_dim, torch.bfloat16)
    assert sm90_block_rows(forward_kernel_names(q, k, v)) == {table_rows}
    assert sm90_block_rows(forward_kernel_names(q, k, v, causal=True)) == {table_rows}
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    batch = sms // 8 + 1  # more query blocks than SMs at 8 heads and 2048 rows
    q, k, v = random_qkv(batch, 2048, 2048, 8, 2, head_dim, torch.bfloat16)
    assert sm90_block_rows(forward_kernel_names(q, k, v)) == {table_rows}
    out, lse, _, _ = run_fwd(q, k, v)
    check_against_reference(q, k, v, out, lse)
    assert sm90_block_rows(forward_kernel_names(q, k, v, causal=True)) == {128}
    _, k_long, v_long = random_qkv(batch, 2048, 2049, 8, 2, head_dim, torch.bfloat16)
    assert sm90_block_rows(forward_kernel_names(q, k_long, v_long, causal=True)) == {table_rows}
    out, lse, _, _ = run_fwd(q, k_long, v_long, causal=True)
    check_against_reference(q, k_long, v_long, out, lse, causal=True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fwd_more_tiles_than_grid_x(head_dim, causal, sm90_auto_choice):
    """A varlen batch of 2^22 + 1 sequences, all empty but the first (long)
    and the last: the grid counts the longest sequence's 16 query blocks (of
    the tile table's 192 rows at d64, 128 at d128) in every sequence and 32
    heads, 2^31 + 512 tiles, more than a grid's x dimension holds, so the
    Hopper kernel walks them in fixed shares of its persistent grid
    (fwd_launch.h). The last sequence's tiles are the ones past 2^31,
    found by the 64-bit fallback of fwd_tile_coord (fwd_block_order.h)."""
    batch, nheads, seqlen_k = (1 << 22) + 1, 32, 4096
    seqlen_q = 16 * (192 if head_dim == 64 else 128)
    last_q, last_k = 300, 500
    cu_q = torch.full((batch + 1,), seqlen_q, dtype=torch.int32, device=DEVICE)
    cu_k = torch.full((batch + 1,), seqlen_k, dtype=torch.int32, device=DEVICE)
    cu_q[0] = cu_k[0] = 0
    cu_q[-1], cu_k[-1] = seqlen_q + last_q, seqlen_k + last_k
    q = torch.randn(seqlen_q + last_q, nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(seqlen_k + last_k, nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    poison_allocator()
    out, lse, _, _ = torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        None,
        None,
        seqlen_q,
        seqlen_k,
        0.0,
        head_dim**-0.5,
        causal,
        -1,
        -1,
        0.0,
        False,
        0,
        0,
        None,
    )
    first = (slice(0, seqlen_q), slice(0, seqlen_k), slice(0, 4))  # all 32 heads: 1 GB of scores
    last = (slice(seqlen_q, None), slice(seqlen_k, None), slice(None))
    for rows, keys, heads in (first, last):
        qb, kb, vb = q[None, rows, heads], k[None, keys, heads], v[None, keys, heads]
        ref_out, ref_lse = attention_ref(qb, kb, vb, causal=causal, compute_dtype=torch.float32)
        same_out, _ = attention_ref(qb, kb, vb, causal=causal, compute_dtype=torch.bfloat16)
        assert_within_criterion(out[None, rows, heads], ref_out, same_out, name="out")
        torch.testing.assert_close(lse[heads, rows], ref_lse[0].float(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("features", ["plain", "softcap", "paged", "return_softmax"])
def test_varlen_fwd_more_sequences_than_grid_yz(causal, features, fwd_kernel):
    """70000 sequences of 1 to 8 rows and two heads: 140000 (head, sequence)
    pairs, more than CUDA's grid y or z holds (65535), as a packed batch of
    short sequences has. The kernels whose grids give each pair its blocks
    (the SM80 forward, which softcap and short keys take; the paged gather;
    the returned probabilities) carry the pairs on y and z together
    (csrc/cuda/core/grid_heads_batch.h). Every sequence is checked."""
    batch, nheads, nheads_k, head_dim, max_len = 70000, 2, 1, 64, 8
    dtype = torch.bfloat16
    cu, q, k, v = many_short_sequences(batch, nheads, nheads_k, head_dim, dtype, max_len)
    softcap = 5.0 if features == "softcap" else 0.0
    k_in, v_in, table = k, v, None
    if features == "paged":
        # One 16-row page per sequence, pages in random order.
        num_pages = batch + 3
        pages = torch.randperm(num_pages, device=DEVICE)[:batch]
        lengths = (cu[1:] - cu[:-1]).to(DEVICE)
        seq_of_row = torch.repeat_interleave(torch.arange(batch, device=DEVICE), lengths)
        row_in_seq = torch.arange(len(q), device=DEVICE) - cu.to(DEVICE).long()[seq_of_row]
        k_in = torch.randn(num_pages, 16, nheads_k, head_dim, device=DEVICE, dtype=dtype)
        v_in = torch.randn_like(k_in)
        k_in[pages[seq_of_row], row_in_seq] = k
        v_in[pages[seq_of_row], row_in_seq] = v
        table = torch.full((batch, 2), -1, dtype=torch.int32, device=DEVICE)
        table[:, 0] = pages.int()
    poison_allocator()
    out, lse, probs, _ = torch.ops.flash_attn.varlen_fwd(
        q,
        k_in,
        v_in,
        cu.to(DEVICE),
        cu.to(DEVICE),
        table,
        None,
        max_len,
        max_len,
        0.0,
        head_dim**-0.5,
        causal,
        -1,
        -1,
        softcap,
        features == "return_softmax",
        0,
        0,
        None,
    )
    for length in range(1, max_len + 1):
        rows = rows_of_sequences_of_length(cu, length, max_len)
        qb, kb, vb = q[rows], k[rows], v[rows]
        check_against_reference(
            qb, kb, vb, out[rows], lse[:, rows].permute(1, 0, 2), causal=causal, softcap=softcap
        )
        if features == "return_softmax":
            # Numerators of flash-attn's convention (tests/s_dmask.py): these
            # rows fit one key block, so exp(s - row max); 0 where masked.
            scores = torch.einsum(
                "bqhd,bkhd->bhqk",
                qb.float(),
                kb.float().repeat_interleave(nheads // nheads_k, dim=2),
            )
            visible = reference.visible_mask(length, length, -1, 0 if causal else -1, DEVICE)
            scores = (scores * head_dim**-0.5).masked_fill(~visible, float("-inf"))
            assert length <= flash_attn_cuda._get_block_size_n(DEVICE, head_dim, False, causal)
            ref_numerators = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            seqs = torch.arange(length - 1, batch, max_len, device=DEVICE)
            torch.testing.assert_close(
                probs[seqs, :, :length, :length].float(), ref_numerators, atol=1e-2, rtol=1e-2
            )


def scatter_into_pages(k, v, cu_k, page_size, spare_blocks=3):
    """A paged copy of packed varlen keys/values: pages in random order, unused
    table entries -1 (never read), a spare table column."""
    batch = len(cu_k) - 1
    lengths = [int(cu_k[b + 1] - cu_k[b]) for b in range(batch)]
    blocks_per_seq = [(n + page_size - 1) // page_size for n in lengths]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, page_size) + tuple(k.shape[1:])
    k_cache = torch.randn(shape, device=k.device, dtype=k.dtype)
    v_cache = torch.randn(shape, device=k.device, dtype=k.dtype)
    table = torch.full((batch, max(blocks_per_seq, default=0) + 1), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(lengths):
        for i in range(blocks_per_seq[b]):
            block = free.pop()
            table[b, i] = block
            start = int(cu_k[b]) + i * page_size
            count = min(page_size, n - i * page_size)
            k_cache[block, :count] = k[start : start + count]
            v_cache[block, :count] = v[start : start + count]
    return k_cache, v_cache, table


def check_paged_matches_contiguous(q, k, v, cu_q, cu_k, page_size, args):
    """varlen_fwd(*args after block_table) over k / v scattered into pages of
    page_size rows: bitwise the contiguous call's out and lse on the same
    kernel, no row left unwritten (outputs land in NaN-poisoned memory), and
    the CPU path's out within rounding. Returns (paged lse, CPU lse)."""
    k_cache, v_cache, table = scatter_into_pages(k, v, cu_k, page_size)
    poison_allocator()
    out, lse, _, _ = torch.ops.flash_attn.varlen_fwd(
        q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), None, *args
    )
    poison_allocator()
    out_paged, lse_paged, _, _ = torch.ops.flash_attn.varlen_fwd(
        q, k_cache, v_cache, cu_q.to(DEVICE), cu_k.to(DEVICE), table.to(DEVICE), *args
    )
    assert not out_paged.isnan().any(), "an output row was left unwritten"
    assert torch.equal(out_paged, out)
    assert torch.equal(lse_paged, lse)
    out_cpu, lse_cpu, _, _ = torch.ops.flash_attn.varlen_fwd(
        q.cpu(), k_cache.cpu(), v_cache.cpu(), cu_q, cu_k, table, *args
    )
    torch.testing.assert_close(out_paged.cpu(), out_cpu, atol=2e-2, rtol=2e-2)
    return lse_paged, lse_cpu


# Pages that give TMA boxes of 64 rows or more go to the Hopper producer's
# boxes, the others to its row gather (plan.h FwdKeys, paged_box_rows.h);
# 48 and 24 rows do not divide a key tile, 3 and 5 rows no power of two.
PAGE_SIZES = [1, 2, 3, 5, 8, 16, 24, 48, 64, 256]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(
    "causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (40, 7), 5.0)]
)
def test_varlen_fwd_paged_matches_contiguous(
    dtype, head_dim, page_size, causal, window, softcap, fwd_kernel
):
    """Paged K/V (block_table) in the varlen forward, read in place by both
    kernels at every page size: the same output and lse as the contiguous
    keys on the same kernel, bitwise, and the CPU path's within rounding.
    Outputs land in memory poisoned with NaN, so a row left unwritten shows.
    Unused table entries are -1: reading one would raise."""
    batch, nheads, nheads_k = 4, 4, 2
    cu_q, max_q = random_cu_seqlens(batch, 90)
    cu_k, max_k = random_cu_seqlens(batch, 333)
    cu_k[1:] += 5  # packed keys need not start at row 0
    cu_k[0] = 5
    q = torch.randn(int(cu_q[-1]), nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    args = (
        None,
        max_q,
        max_k,
        0.0,
        head_dim**-0.5,
        causal,
        window[0],
        window[1],
        softcap,
        False,
        0,
        0,
        None,
    )
    lse_paged, lse_cpu = check_paged_matches_contiguous(q, k, v, cu_q, cu_k, page_size, args)
    finite = torch.isfinite(lse_cpu)
    assert torch.equal(torch.isinf(lse_paged.cpu()), ~finite)
    torch.testing.assert_close(lse_paged.cpu()[finite], lse_cpu[finite], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fwd_paged_dropout_matches_contiguous(head_dim, page_size, causal, fwd_kernel):
    """Dropout over paged keys: the mask is a function of (batch, head, row,
    col), not of where a key lives, so the paged forward equals the contiguous
    one bit for bit on either kernel (on sm90 the Hopper kernel's dropout tiles,
    plan.h fwd_sm90_dropout_tile, in their paged instantiation: boxes at 64-row
    pages, the row gather below), and the CPU path's within rounding."""
    batch, nheads, nheads_k, dropout_p = 3, 4, 2, 0.23
    cu_q, max_q = random_cu_seqlens(batch, 150)
    cu_k, max_k = random_cu_seqlens(batch, 300)
    q = torch.randn(int(cu_q[-1]), nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), nheads_k, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # (alibi, max_q, max_k, p, scale, causal, window left / right, softcap,
    # return_softmax, seed, offset, generator)
    args = (None, max_q, max_k, dropout_p, head_dim**-0.5, causal, -1, -1, 0.0, False, 77, 5, None)
    check_paged_matches_contiguous(q, k, v, cu_q, cu_k, page_size, args)


@pytest.mark.parametrize("page_size", [1, 3, 5, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fwd_paged_never_reads_unused_rows(page_size, head_dim, causal, fwd_kernel):
    """NaN and Inf in every cache row that is not a used key (the tail of each
    sequence's last page, the spare pages) and past seqused_k: the output and
    lse are bitwise those of a clean cache, on both kernels (FA3's issue
    1745)."""
    batch, nheads, nheads_k, dtype = 5, 8, 2, torch.bfloat16
    cu_q, max_q = random_cu_seqlens(batch, 200)
    cu_k, max_k = random_cu_seqlens(batch, 700)
    q = torch.randn(int(cu_q[-1]), nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    k_cache, v_cache, table = scatter_into_pages(k, v, cu_k, page_size)
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    used = torch.tensor([max(n - 3, 0) for n in lengths], dtype=torch.int32)
    bad_k, bad_v = k_cache.clone(), v_cache.clone()
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(used.tolist()):
        for key in range(n):
            owned[int(table[b, key // page_size]), key % page_size] = True
    for cache in (bad_k, bad_v):
        cache[~owned.to(DEVICE)] = float("nan")
        cache[~owned.to(DEVICE) & (torch.rand(owned.shape, device=DEVICE) < 0.5)] = float("inf")
    results = []
    for kc, vc in ((k_cache, v_cache), (bad_k, bad_v)):
        poison_allocator()
        results.append(
            torch.ops.flash_attn.varlen_fwd(
                q,
                kc,
                vc,
                cu_q.to(DEVICE),
                cu_k.to(DEVICE),
                table.to(DEVICE),
                None,
                max_q,
                max_k,
                0.0,
                head_dim**-0.5,
                causal,
                -1,
                -1,
                0.0,
                False,
                0,
                0,
                None,
                seqused_k=used.to(DEVICE),
            )[:2]
        )
    assert torch.isfinite(results[1][0]).all()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_varlen_fwd_paged_cuda_graph_replay():
    """The paged varlen forward reads the table and lengths on the device: a
    captured call replays with new table contents."""
    nheads, head_dim, page_size = 4, 64, 16  # two sequences
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 64], dtype=torch.int32, device=DEVICE)
    q = torch.randn(7, nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k_cache = torch.randn(8, page_size, nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1]], dtype=torch.int32, device=DEVICE)

    def call():
        return torch.ops.flash_attn.varlen_fwd(
            q,
            k_cache,
            v_cache,
            cu_q,
            cu_k,
            table,
            None,
            4,
            40,
            0.0,
            head_dim**-0.5,
            True,
            -1,
            0,
            0.0,
            False,
            0,
            0,
            None,
        )[0]

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    table.copy_(torch.tensor([[7, 6, 5, -1], [1, 0, -1, -1]], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.17, 0.5])
def test_fwd_dropout_matches_reference_mask(dtype, causal, dropout_p):
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 97, 133
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads, 64, dtype)
    seed, offset = 1234567891234, 77
    out, lse, probs, rng_state = run_fwd(
        q, k, v, causal=causal, dropout_p=dropout_p, return_softmax=True, seed=seed, offset=offset
    )
    assert rng_state.tolist() == [seed, offset]
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
    ).to(DEVICE)
    check_against_reference(q, k, v, out, lse, causal=causal, dropout_p=dropout_p, keep_mask=keep)
    # return_softmax encodes dropped entries as negative probabilities.
    visible = reference.visible_mask(seqlen_q, seqlen_k, -1, 0 if causal else -1, DEVICE)
    dropped_visible = (probs < 0) & visible
    assert torch.equal(dropped_visible, (~keep) & visible & (probs != 0))


def check_kernel_keep_mask(
    batch, nheads, seqlen_q, seqlen_k, head_dim, causal, dropout_p, fwd_kernel
):
    """The forward kernel's own keep mask, bit for bit. S_dmask comes from a
    kernel of its own (return_probs.cu) and does not show it; out does: with
    q = 0 every visible score is equal, and with V the identity from key
    columns [part * d, part * d + d) onto the head dim, out[i, t] is nonzero
    exactly where key part * d + t is visible and kept, and equals
    1 / ((1 - p) * visible keys): the row sum is of the undropped P, the
    rescale 1 / (1 - p)."""
    dtype = torch.bfloat16
    seed, offset = 0x123456789ABCDEF, 991
    q = torch.zeros(batch, seqlen_q, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads, head_dim, device=DEVICE, dtype=dtype)
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
    ).to(DEVICE)
    visible = reference.visible_mask(seqlen_q, seqlen_k, -1, 0 if causal else -1, DEVICE)
    # (sq, 1); a row that sees no key (causal, seqlen_q > seqlen_k) has none to keep
    kept_value = 1.0 / ((1.0 - dropout_p) * visible.sum(-1, keepdim=True).clamp(min=1).double())
    for part in range((seqlen_k + head_dim - 1) // head_dim):
        cols = torch.arange(part * head_dim, min((part + 1) * head_dim, seqlen_k), device=DEVICE)
        v = torch.zeros(batch, seqlen_k, nheads, head_dim, device=DEVICE, dtype=dtype)
        v[:, cols, :, cols - part * head_dim] = 1
        if fwd_kernel == "sm90" and part == 0 and head_dim not in HEAD_DIMS_WITHOUT_HOPPER_DROPOUT:
            names = forward_kernel_names(q, k, v, causal=causal, dropout_p=dropout_p)
            assert any("flash_fwd_sm90_kernel" in name for name in names), names
        out, _, _, _ = run_fwd(
            q, k, v, causal=causal, dropout_p=dropout_p, seed=seed, offset=offset
        )
        got = out[..., : len(cols)].permute(0, 2, 1, 3).double()  # (b, h, sq, cols)
        want = (keep & visible)[..., cols]
        assert torch.equal(got != 0, want), "keep mask differs from the contract's"
        expected = (kept_value * want).expand_as(got)
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=0)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.17, 0.5])
def test_fwd_dropout_kernel_mask_bit_exact(head_dim, causal, dropout_p, fwd_kernel):
    """check_kernel_keep_mask over several query and key tiles and a partial
    last one of each. On sm90 (fwd_kernel sm90) this is the Hopper kernel's
    PairedDropoutMask (dropout.h) at every head dim from d64 (plan.h
    fwd_sm90_dropout_tile)."""
    check_kernel_keep_mask(2, 3, 300, 333, head_dim, causal, dropout_p, fwd_kernel)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_dropout_kernel_mask_many_tiles(head_dim, causal, fwd_kernel):
    """More query blocks than an H200 has SMs (40 heads x 6 blocks): without a
    causal bound the Hopper grid is persistent, fixed shares, so one block
    walks several query blocks and the draw warps' keep buffers and their
    mbarrier phases run on across them; with it, one block per tile of
    differing key counts."""
    check_kernel_keep_mask(1, 40, 768, 300, head_dim, causal, 0.3, fwd_kernel)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_dropout_varlen_kernel_mask(head_dim, causal, fwd_kernel):
    """The varlen forward's keep mask, bit for bit, as check_kernel_keep_mask:
    sequences shorter than a query block, an empty one (its tiles are skipped
    by the draw warps as by the MMA warpgroups) and several blocks long, each
    its own batch index of the contract."""
    nheads, dropout_p = 3, 0.27
    seed, offset = 77, 5
    lens_q = [130, 0, 7, 300, 64]
    lens_k = [200, 5, 140, 129, 64]
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=DEVICE)
    q = torch.zeros(int(cu_q[-1]), nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    keeps = reference.dropout_keep_masks_varlen(seed, offset, cu_q, cu_k, nheads, dropout_p)
    for part in range((max(lens_k) + head_dim - 1) // head_dim):
        v = torch.zeros(int(cu_k[-1]), nheads, head_dim, device=DEVICE, dtype=torch.bfloat16)
        for b, len_k in enumerate(lens_k):
            cols = torch.arange(part * head_dim, (part + 1) * head_dim, device=DEVICE)
            cols = cols[cols < len_k]
            v[int(cu_k[b]) + cols, :, cols - part * head_dim] = 1
        poison_allocator()
        out = torch.ops.flash_attn.varlen_fwd(
            q,
            k,
            v,
            cu_q,
            cu_k,
            None,
            None,
            max(lens_q),
            max(lens_k),
            dropout_p,
            head_dim**-0.5,
            causal,
            -1,
            -1,
            0.0,
            False,
            seed,
            offset,
            None,
        )[0]
        for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
            if len_q == 0:
                continue
            cols = torch.arange(part * head_dim, (part + 1) * head_dim, device=DEVICE)
            cols = cols[cols < len_k]
            got = out[int(cu_q[b]) : int(cu_q[b]) + len_q, :, : len(cols)].permute(1, 0, 2)
            visible = reference.visible_mask(len_q, len_k, -1, 0 if causal else -1, DEVICE)
            want = (keeps[b].to(DEVICE) & visible)[..., cols]
            assert torch.equal(got != 0, want), f"sequence {b}, key part {part}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", [False, True])
def test_fwd_dropout_hopper_matches_sm80_and_reference(dtype, head_dim, causal, mods, monkeypatch):
    """The Hopper forward with dropout (score-mods variant) against the
    reference with the contract's mask and against the SM80 forward
    (FLASH_ATTN_FWD_KERNEL=sm80), with softcap and ALiBi on too (mods);
    S_dmask, written after either forward, encodes the same dropped entries."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward kernel runs on sm90 GPUs only")
    if "sm_90a" not in flash_attn_cuda.build_info:
        pytest.skip("this build has no sm_90a machine code: " + flash_attn_cuda.build_info)
    batch, nheads, seqlen_q, seqlen_k, dropout_p = 2, 4, 333, 517, 0.23
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads, head_dim, dtype)
    seed, offset = 987654321, 3
    kwargs = dict(causal=causal, dropout_p=dropout_p, seed=seed, offset=offset)
    if mods:
        kwargs.update(softcap=12.0, alibi_slopes=torch.rand(nheads, device=DEVICE) * 0.3)
    results = {}
    for kernel in ("sm90", "sm80"):
        monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", kernel)
        uses_sm90 = any(
            "flash_fwd_sm90_kernel" in n for n in forward_kernel_names(q, k, v, **kwargs)
        )
        assert uses_sm90 == (kernel == "sm90")
        results[kernel] = run_fwd(q, k, v, return_softmax=True, **kwargs)
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
    ).to(DEVICE)
    ref_kwargs = dict(causal=causal, dropout_p=dropout_p, keep_mask=keep)
    if mods:
        ref_kwargs.update(softcap=kwargs["softcap"], alibi_slopes=kwargs["alibi_slopes"])
    visible = reference.visible_mask(seqlen_q, seqlen_k, -1, 0 if causal else -1, DEVICE)
    for kernel, (out, lse, probs, rng_state) in results.items():
        assert rng_state.tolist() == [seed, offset]
        check_against_reference(q, k, v, out, lse, **ref_kwargs)
        assert torch.equal((probs < 0) & visible, (~keep) & visible & (probs != 0)), kernel
    (out90, lse90, probs90, _), (out80, lse80, probs80, _) = results["sm90"], results["sm80"]
    torch.testing.assert_close(lse90, lse80, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out90.float(), out80.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(probs90 < 0, probs80 < 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_dropout_same_mask_as_cpu(dtype):
    q, k, v = random_qkv(2, 65, 80, 2, 2, 64, dtype)
    args = (None, 0.3, 0.125, False, -1, -1, 0.0, True, 42, 5, None)
    _, _, probs_cuda, _ = torch.ops.flash_attn.fwd(q, k, v, *args)
    _, _, probs_cpu, _ = torch.ops.flash_attn.fwd(q.cpu(), k.cpu(), v.cpu(), *args)
    assert torch.equal(probs_cuda.cpu() < 0, probs_cpu < 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_return_softmax_probabilities(dtype, causal):
    """S_dmask in flash-attn's convention (tests/s_dmask.py; more cases in
    test_attn_probs.py): numerators against the running max over key blocks,
    from which the probabilities are recovered."""
    q, k, v = random_qkv(2, 70, 190, 4, 2, 64, dtype)
    _, lse, probs, _ = run_fwd(q, k, v, causal=causal, return_softmax=True)
    scores = s_dmask.final_scores(q.cpu(), k.cpu(), window=(-1, 0 if causal else -1))
    width = flash_attn_cuda._get_block_size_n(q.device, 64, False, causal)
    for b in range(2):
        s_dmask.check_entry(probs[b].cpu(), scores[b], width)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_deterministic_and_matches_cpu(dtype):
    q, k, v = random_qkv(2, 300, 257, 4, 2, 128, dtype)
    first = run_fwd(q, k, v, causal=True)
    second = run_fwd(q, k, v, causal=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    cpu_out, cpu_lse, _, _ = torch.ops.flash_attn.fwd(
        q.cpu(), k.cpu(), v.cpu(), None, 0.0, 128**-0.5, True, -1, -1, 0.0, False, 0, 0, None
    )
    ref_out, _ = attention_ref(q, k, v, causal=True, compute_dtype=torch.float32)
    # Both paths accumulate in fp32 from the same rounded inputs: they agree to
    # within the output's own rounding.
    torch.testing.assert_close(first[0].cpu().float(), cpu_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first[1].cpu(), cpu_lse, atol=1e-3, rtol=1e-3)
    assert (first[0].float() - ref_out).abs().max() < 5e-2


@pytest.mark.parametrize(
    "batch,seqlen,nheads,nheads_k,head_dim", [(2, 256, 4, 4, 64), (4, 1000, 8, 2, 128)]
)
def test_fwd_cuda_graph_replay(batch, seqlen, nheads, nheads_k, head_dim):
    """A captured causal forward replays on new inputs. The second shape runs
    on sm90 the grid that takes its query blocks from a counter, which each
    call zeroes on the stream, so every replay starts a fresh count."""
    q, k, v = random_qkv(batch, seqlen, seqlen, nheads, nheads_k, head_dim, torch.bfloat16)
    static_q = q.clone()
    eager_out = run_fwd(q, k, v, causal=True)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run_fwd(static_q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = torch.ops.flash_attn.fwd(
            static_q, k, v, None, 0.0, head_dim**-0.5, True, -1, -1, 0.0, False, 0, 0, None
        )[0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager_out)
    for _ in range(2):
        new_q = torch.randn_like(q)
        static_q.copy_(new_q)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, run_fwd(new_q, k, v, causal=True)[0])


def test_fwd_torch_compile_matches_eager():
    from flash_attn_cuda import flash_attn_func

    q, k, v = random_qkv(2, 128, 128, 4, 4, 64, torch.bfloat16)
    compiled = torch.compile(lambda a, b, c: flash_attn_func(a, b, c, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_batch_heads_over_65535(causal, fwd_kernel):
    batch, nheads = 17000, 4  # batch * heads = 68000 thread-block columns
    q, k, v = random_qkv(batch, 3, 5, nheads, nheads, 32, torch.float16)
    out, lse, _, _ = run_fwd(q, k, v, causal=causal)
    for b in (0, batch // 2, batch - 1):
        check_against_reference(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], out[b : b + 1], lse[b : b + 1], causal=causal
        )


def test_fwd_tensor_over_2_pow_31_elements():
    free, _ = torch.cuda.mem_get_info()
    # q, k, v, out at 4 GiB each plus the reference of a few slices.
    if free < 20 * (1 << 30):
        pytest.skip("needs about 20 GiB of free GPU memory")
    seqlen, nheads, head_dim = 128, 16, 128
    batch = (1 << 31) // (seqlen * nheads * head_dim) + 1
    q, k, v = random_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, torch.bfloat16)
    assert q.numel() > 1 << 31
    out, lse, _, _ = torch.ops.flash_attn.fwd(
        q, k, v, None, 0.0, head_dim**-0.5, True, -1, -1, 0.0, False, 0, 0, None
    )
    for b in (0, batch - 1):
        check_against_reference(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], out[b : b + 1], lse[b : b + 1], causal=True
        )


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 10), (10, 0), (0, 0)])
def test_fwd_empty_sequences(seqlen_q, seqlen_k, fwd_kernel):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2, 2, 64, torch.bfloat16)
    out, lse, _, _ = run_fwd(q, k, v)
    assert out.shape == q.shape and lse.shape == (2, 2, seqlen_q)
    if seqlen_q > 0:
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isinf(lse).all() and (lse > 0).all()
