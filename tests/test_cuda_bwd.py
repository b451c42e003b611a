"""CUDA backward kernel against an fp32 reference (the criterion of
docs/architecture.md: dq, dk, dv within 3x of the same-dtype torch error), against the
CPU path, and for reproducibility.

Every test here needs a GPU and is skipped with a reason without one.
"""

import pytest
import torch

import reference
from reference import assert_within_criterion, attention_ref, varlen_attention_ref

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
]
GRAD_FACTOR = 3.0
# Absolute slack for gradients that are exactly zero in exact arithmetic (a
# single visible key gives dS = 0), where the same-dtype baseline can be 0 too.
GRAD_ATOL = 1e-4


@pytest.fixture(params=["sm90", "sm80"])
def bwd_kernel(request, monkeypatch):
    """Which backward main kernel runs the plain score rule. On an sm90 GPU the
    head dims with a Hopper tile (kBlockMSm90 in csrc/cuda/bwd/bwd_tile_config.h:
    all of them) have two, the Hopper one by default; FLASH_ATTN_BWD_KERNEL
    forces one, so both are checked on every shape. Other GPUs run the
    SM80-design kernel only."""
    if torch.cuda.get_device_capability() != (9, 0):
        if request.param == "sm90":
            pytest.skip("the Hopper backward kernel runs on sm90 GPUs only")
        return request.param
    monkeypatch.setenv("FLASH_ATTN_BWD_KERNEL", request.param)
    return request.param


def run_fwd_bwd(
    q,
    k,
    v,
    dout,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    softmax_scale=None,
    seed=0,
    offset=0,
    deterministic=False,
):
    """The forward op, then the backward op on its out / lse / rng_state."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse, _, rng_state = torch.ops.flash_attn.fwd(
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
        False,
        seed,
        offset,
        None,
    )
    poison_allocator()
    dq, dk, dv = torch.ops.flash_attn.bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        alibi_slopes,
        dropout_p,
        softmax_scale,
        causal,
        window[0],
        window[1],
        softcap,
        deterministic,
        rng_state,
    )
    return (dq, dk, dv), (out, lse, rng_state)


def backward_kernel_names(q, k, v, dout, **kwargs):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_fwd_bwd(q, k, v, dout, **kwargs)
        torch.cuda.synchronize()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_bwd_kernel_choice_on_sm90(head_dim, monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward kernel runs on sm90 GPUs only")
    if "sm_90a" not in flash_attn_cuda.build_info:
        pytest.skip("this build has no sm_90a machine code: " + flash_attn_cuda.build_info)
    uses_sm90 = lambda names: any("flash_bwd_sm90_kernel" in name for name in names)
    q, k, v = random_qkv(1, 200, 300, 2, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    monkeypatch.delenv("FLASH_ATTN_BWD_KERNEL", raising=False)
    assert uses_sm90(backward_kernel_names(q, k, v, dout, causal=True))
    assert uses_sm90(backward_kernel_names(q, k, v, dout, deterministic=True))
    # Softcap, ALiBi and dropout run the Hopper kernel too (dropout at d64 on
    # 64-row query blocks: plan.h bwd_sm90_dropout_block_m, deterministic or
    # not) and a negative scale (score_mods.h keeps its scores negated); a zero
    # scale stays on the SM80 kernel.
    slopes = torch.rand(2, device=DEVICE) * 0.3
    assert uses_sm90(backward_kernel_names(q, k, v, dout, softcap=5.0))
    assert uses_sm90(backward_kernel_names(q, k, v, dout, causal=True, alibi_slopes=slopes))
    dropout_names = backward_kernel_names(q, k, v, dout, softcap=5.0, dropout_p=0.1)
    assert uses_sm90(dropout_names)
    deterministic_dropout = backward_kernel_names(q, k, v, dout, dropout_p=0.1, deterministic=True)
    assert uses_sm90(deterministic_dropout)
    assert uses_sm90(backward_kernel_names(q, k, v, dout, softmax_scale=-0.1))
    assert not uses_sm90(backward_kernel_names(q, k, v, dout, softmax_scale=0.0))
    # So do inputs TMA cannot describe (a kv head stride of 0).
    k_shared = k[:, :, :1].expand(-1, -1, 2, -1)
    assert not uses_sm90(backward_kernel_names(q, k_shared, v, dout))
    monkeypatch.setenv("FLASH_ATTN_BWD_KERNEL", "sm80")
    assert not uses_sm90(backward_kernel_names(q, k, v, dout))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bwd_broadcast_kv_head(dtype, head_dim, bwd_kernel):
    """K / V of one kv head broadcast over the kv heads (stride 0), which the
    Hopper kernel's TMA copies cannot describe."""
    q, k, v = random_qkv(2, 300, 700, 4, 2, head_dim, dtype)
    k, v = k[:, :, :1].expand(-1, -1, 2, -1), v[:, :, 1:].expand(-1, -1, 2, -1)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=True)
    check_grads(q, k, v, dout, grads, causal=True)


def reference_grads(q, k, v, dout, compute_dtype, ref_fn=attention_ref, **ref_kwargs):
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, _ = ref_fn(*leaves, compute_dtype=compute_dtype, **ref_kwargs)
    return torch.autograd.grad(out, leaves, dout.to(compute_dtype))


def check_grads(q, k, v, dout, grads, ref_fn=attention_ref, **ref_kwargs):
    exact = reference_grads(q, k, v, dout, torch.float32, ref_fn, **ref_kwargs)
    same = reference_grads(q, k, v, dout, q.dtype, ref_fn, **ref_kwargs)
    for name, ours, ref_exact, ref_same in zip(("dq", "dk", "dv"), grads, exact, same):
        assert ours.shape == ref_exact.shape, f"{name}: shape {ours.shape} != {ref_exact.shape}"
        assert ours.dtype == q.dtype
        assert not ours.isnan().any(), f"{name} has NaN (unwritten or poisoned element)"
        assert_within_criterion(
            ours, ref_exact, ref_same, factor=GRAD_FACTOR, atol=GRAD_ATOL, name=name
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_shapes(dtype, head_dim, seqlen_q, seqlen_k, causal, bwd_kernel):
    batch = 2 if seqlen_q * seqlen_k < 1 << 18 else 1
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=causal)
    check_grads(q, k, v, dout, grads, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(0, 0), (16, 0), (63, 17), (-1, 40), (100, -1)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (256, 256), (300, 129)])
def test_bwd_local(dtype, head_dim, window, seqlen_q, seqlen_k, bwd_kernel):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 4, head_dim, dtype)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, window=window)
    check_grads(q, k, v, dout, grads, window_size=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("softcap", [0.0, 5.0, 30.0])
@pytest.mark.parametrize("alibi", [None, "heads", "batch_heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_softcap_alibi(dtype, head_dim, softcap, alibi, causal, bwd_kernel):
    batch, nheads = 2, 4
    q, k, v = random_qkv(batch, 129, 257, nheads, 2, head_dim, dtype)
    dout = torch.randn_like(q)
    slopes = None
    if alibi == "heads":
        slopes = torch.rand(nheads, device=DEVICE) * 0.3
    elif alibi == "batch_heads":
        slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=causal, softcap=softcap, alibi_slopes=slopes)
    check_grads(q, k, v, dout, grads, causal=causal, softcap=softcap, alibi_slopes=slopes)


@pytest.mark.parametrize("head_dim", [32, 96, 160, 192, 224])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (70, 20)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_softcap_alibi_other_head_dims(head_dim, window, deterministic, bwd_kernel):
    """Softcap and ALiBi together at the remaining head dims (each has its own
    Hopper tile), under causal and local masks, over several key and query
    blocks, in both backward modes."""
    batch, nheads = 2, 4
    q, k, v = random_qkv(batch, 300, 421, nheads, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
    kwargs = dict(window=window, softcap=15.0, alibi_slopes=slopes)
    grads, _ = run_fwd_bwd(q, k, v, dout, deterministic=deterministic, **kwargs)
    check_grads(q, k, v, dout, grads, window_size=window, softcap=15.0, alibi_slopes=slopes)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", ["plain", "softcap", "alibi"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (70, 20)])
def test_bwd_negative_softmax_scale(head_dim, features, window, bwd_kernel):
    """A negative scale (legal, if odd) turns a masked -inf score into +inf
    if the scale multiplies it inside exp2: such a call runs a variant that
    does not (SM80's, which tests for masked scores, or the Hopper score-mods
    one, which keeps the scores negated in units of |scale| and masks them
    after), and its gradients match the reference under causal and local
    masks."""
    batch, nheads = 2, 4
    q, k, v = random_qkv(batch, 300, 421, nheads, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    softcap = 15.0 if features == "softcap" else 0.0
    slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3 if features == "alibi" else None
    kwargs = dict(softmax_scale=-0.1, softcap=softcap, alibi_slopes=slopes)
    grads, _ = run_fwd_bwd(q, k, v, dout, window=window, **kwargs)
    check_grads(q, k, v, dout, grads, window_size=window, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads,nheads_k", [(8, 8), (8, 4), (8, 1), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_gqa(dtype, nheads, nheads_k, causal, deterministic, bwd_kernel):
    q, k, v = random_qkv(3, 200, 333, nheads, nheads_k, 128, dtype)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=causal, deterministic=deterministic)
    check_grads(q, k, v, dout, grads, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_strided_views_of_packed_qkv(dtype, head_dim, bwd_kernel):
    qkv = torch.randn(2, 177, 3, 6, head_dim, device=DEVICE, dtype=dtype)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    # dout a strided view as well (a slice of a wider tensor).
    dout = torch.randn(2, 177, 6, head_dim + 16, device=DEVICE, dtype=dtype)[..., :head_dim]
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=True)
    check_grads(q, k, v, dout, grads, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.17, 0.5, 0.9])
@pytest.mark.parametrize("nheads_k", [3, 1])
def test_bwd_dropout_matches_reference_mask(
    dtype, head_dim, causal, dropout_p, nheads_k, bwd_kernel
):
    """Both backward kernels replay the contract's mask (csrc/common/philox.h):
    the Hopper one draws it in its score-mods variant wherever
    bwd_sm90_dropout_block_m names a tile (d64 at 64 rows);
    sequence lengths that are not multiples of any tile, GQA and MQA."""
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 97, 133
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    seed, offset = 1234567891234, 77
    grads, (_, _, rng_state) = run_fwd_bwd(
        q, k, v, dout, causal=causal, dropout_p=dropout_p, seed=seed, offset=offset
    )
    assert rng_state.tolist() == [seed, offset]
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
    ).to(DEVICE)
    check_grads(q, k, v, dout, grads, causal=causal, dropout_p=dropout_p, keep_mask=keep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [96, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_dropout_after_hopper_forward(dtype, head_dim, causal, bwd_kernel, monkeypatch):
    """The Hopper forward draws dropout's mask; either backward replays it
    from rng_state alone (csrc/common/philox.h), on the forward's out and
    lse, so the gradients match the reference with the contract's mask."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward kernel runs on sm90 GPUs only")
    if "sm_90a" not in flash_attn_cuda.build_info:
        pytest.skip("this build has no sm_90a machine code: " + flash_attn_cuda.build_info)
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", "sm90")
    batch, nheads, seqlen_q, seqlen_k, dropout_p = 2, 3, 257, 391, 0.3
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads, head_dim, dtype)
    dout = torch.randn_like(q)
    seed, offset = 42424242, 9
    kwargs = dict(causal=causal, dropout_p=dropout_p, seed=seed, offset=offset)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        grads, _ = run_fwd_bwd(q, k, v, dout, **kwargs)
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    assert any("flash_fwd_sm90_kernel" in name for name in names), names
    hopper_bwd = any("flash_bwd_sm90_kernel" in name for name in names)
    assert hopper_bwd == (bwd_kernel == "sm90"), names
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
    ).to(DEVICE)
    check_grads(q, k, v, dout, grads, causal=causal, dropout_p=dropout_p, keep_mask=keep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_bwd_dropout_with_softcap_alibi_window(dtype, head_dim, bwd_kernel):
    batch, nheads, seqlen_q, seqlen_k = 2, 4, 150, 170
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, 2, head_dim, dtype)
    dout = torch.randn_like(q)
    slopes = torch.rand(batch, nheads, device=DEVICE) * 0.2
    seed, offset = 99, 3
    kwargs = dict(window=(40, 7), softcap=8.0, alibi_slopes=slopes, dropout_p=0.25)
    grads, _ = run_fwd_bwd(q, k, v, dout, seed=seed, offset=offset, **kwargs)
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, 0.25
    ).to(DEVICE)
    check_grads(
        q,
        k,
        v,
        dout,
        grads,
        window_size=(40, 7),
        softcap=8.0,
        alibi_slopes=slopes,
        dropout_p=0.25,
        keep_mask=keep,
    )


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_dropout_hopper_matches_sm80(head_dim, causal, dropout_p, deterministic, monkeypatch):
    """The Hopper backward with dropout against the SM80 one on the same
    forward (out, lse, rng_state): the same mask and the same math
    (bwd_pointwise.h scores_to_p_and_ds), so they differ by about the
    gradients' own rounding; and both within the criterion of the reference
    with the contract's mask."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward kernel runs on sm90 GPUs only")
    if "sm_90a" not in flash_attn_cuda.build_info:
        pytest.skip("this build has no sm_90a machine code: " + flash_attn_cuda.build_info)
    batch, nheads, nheads_k, seqlen_q, seqlen_k = 2, 4, 2, 211, 301
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    seed, offset = 31337, 5
    kwargs = dict(
        causal=causal, dropout_p=dropout_p, seed=seed, offset=offset, deterministic=deterministic
    )
    grads = {}
    for kernel in ("sm90", "sm80"):
        monkeypatch.setenv("FLASH_ATTN_BWD_KERNEL", kernel)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            grads[kernel], _ = run_fwd_bwd(q, k, v, dout, **kwargs)
            torch.cuda.synchronize()
        hopper_bwd = any("flash_bwd_sm90_kernel" in event.name for event in prof.events())
        assert hopper_bwd == (kernel == "sm90")
    keep = reference.dropout_keep_mask_batch(
        seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
    ).to(DEVICE)
    ref_kwargs = dict(causal=causal, dropout_p=dropout_p, keep_mask=keep)
    exact = reference_grads(q, k, v, dout, torch.float32, **ref_kwargs)
    same = reference_grads(q, k, v, dout, torch.bfloat16, **ref_kwargs)
    for name, hopper, sm80, ref_exact, ref_same in zip(
        ("dq", "dk", "dv"), grads["sm90"], grads["sm80"], exact, same
    ):
        assert not hopper.isnan().any(), name
        baseline = reference.max_abs_err(ref_same, ref_exact)
        diff = reference.max_abs_err(hopper, sm80)
        assert diff <= 2 * baseline + GRAD_ATOL, f"{name}: Hopper vs SM80 differ by {diff:.3e}"
        assert_within_criterion(
            hopper, ref_exact, ref_same, factor=GRAD_FACTOR, atol=GRAD_ATOL, name=name
        )


def run_varlen_fwd_bwd(
    q,
    k,
    v,
    dout,
    cu_q,
    cu_k,
    max_q,
    max_k,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    seed=0,
    offset=0,
    deterministic=False,
):
    scale = q.shape[-1] ** -0.5
    cu_q_dev, cu_k_dev = cu_q.to(DEVICE), cu_k.to(DEVICE)
    out, lse, _, rng_state = torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q_dev,
        cu_k_dev,
        None,
        alibi_slopes,
        max_q,
        max_k,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        False,
        seed,
        offset,
        None,
    )
    poison_allocator()
    return torch.ops.flash_attn.varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q_dev,
        cu_k_dev,
        alibi_slopes,
        max_q,
        max_k,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        deterministic,
        rng_state,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("features", ["plain", "softcap_alibi", "dropout", "dropout_0.9", "window"])
def test_varlen_bwd(dtype, head_dim, causal, features, bwd_kernel):
    check_varlen_bwd(dtype, head_dim, causal, features)


def check_varlen_bwd(dtype, head_dim, causal, features):
    """Five varlen sequences (empty ones among them) through varlen_fwd and
    varlen_bwd, against the reference with the features' arguments."""
    batch, nheads, nheads_k = 5, 4, 2
    cu_q, max_q = random_cu_seqlens(batch, 150)
    cu_k, max_k = random_cu_seqlens(batch, 300)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    dout = torch.randn_like(q)
    kwargs, ref_kwargs = {}, {}
    if features == "softcap_alibi":
        slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
        kwargs = dict(softcap=10.0, alibi_slopes=slopes)
        ref_kwargs = dict(kwargs)
    elif features.startswith("dropout"):
        seed, offset = 5, 11
        p = 0.9 if features == "dropout_0.9" else 0.3
        kwargs = dict(dropout_p=p, seed=seed, offset=offset)
        keep = reference.dropout_keep_masks_varlen(seed, offset, cu_q, cu_k, nheads, p)
        ref_kwargs = dict(dropout_p=p, keep_masks=[m.to(DEVICE) for m in keep])
    elif features == "window":
        kwargs = dict(window=(33, 20))
        ref_kwargs = dict(window_size=(33, 20))
    grads = run_varlen_fwd_bwd(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal=causal, **kwargs)
    check_grads(
        q,
        k,
        v,
        dout,
        grads,
        ref_fn=varlen_attention_ref,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_k=max_k,
        causal=causal,
        **ref_kwargs,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_bwd_rows_outside_sequences_are_zero(dtype, bwd_kernel):
    # cu_seqlens that leave rows before the first and after the last sequence.
    cu_q = torch.tensor([3, 40, 40, 90], dtype=torch.int32)
    cu_k = torch.tensor([5, 60, 61, 130], dtype=torch.int32)
    q = torch.randn(100, 4, 64, device=DEVICE, dtype=dtype)
    k = torch.randn(140, 1, 64, device=DEVICE, dtype=dtype)
    v = torch.randn(140, 1, 64, device=DEVICE, dtype=dtype)
    dout = torch.randn_like(q)
    dq, dk, dv = run_varlen_fwd_bwd(q, k, v, dout, cu_q, cu_k, 50, 69, causal=True)
    for grad, cu in ((dq, cu_q), (dk, cu_k), (dv, cu_k)):
        assert torch.equal(grad[: int(cu[0])], torch.zeros_like(grad[: int(cu[0])]))
        assert torch.equal(grad[int(cu[-1]) :], torch.zeros_like(grad[int(cu[-1]) :]))
    check_grads(
        q,
        k,
        v,
        dout,
        (dq, dk, dv),
        ref_fn=varlen_attention_ref,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_k=69,
        causal=True,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bwd_ignores_rows_outside_sequences(dtype, head_dim, causal, bwd_kernel):
    """A sequence's last query and key tiles reach into the next sequence's
    rows, and the last sequence's into rows past cu_seqlens[-1]; rows that
    are not finite there must not reach the sequence's gradients."""
    nheads, nheads_k = 4, 2
    cu_q = torch.tensor([0, 50, 127, 257], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 177, 377], dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]) + 40, int(cu_k[-1]) + 64  # padding after the last
    q = torch.randn(total_q, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    dout = torch.randn_like(q)
    for t, cu, total in (
        (q, cu_q, total_q),
        (dout, cu_q, total_q),
        (k, cu_k, total_k),
        (v, cu_k, total_k),
    ):
        t[int(cu[1]) : int(cu[2])] = float("nan")  # all of sequence 1
        t[int(cu[-1]) : total] = float("inf")  # the padding
    dq, dk, dv = run_varlen_fwd_bwd(q, k, v, dout, cu_q, cu_k, 130, 200, causal=causal)
    for b in (0, 2):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb, dob = q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], dout[None, qs:qe]
        grads = (dq[None, qs:qe], dk[None, ks:ke], dv[None, ks:ke])
        check_grads(qb, kb, vb, dob, grads, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("nheads_k", [4, 2])
def test_bwd_matches_cpu(dtype, dropout_p, nheads_k, bwd_kernel):
    q, k, v = random_qkv(2, 150, 193, 4, nheads_k, 64, dtype)
    dout = torch.randn_like(q)
    slopes = torch.rand(4, device=DEVICE) * 0.2
    kwargs = dict(
        causal=True, softcap=20.0, alibi_slopes=slopes, dropout_p=dropout_p, seed=777, offset=4
    )
    cuda_grads, (out, lse, rng_state) = run_fwd_bwd(q, k, v, dout, **kwargs)
    cpu_grads = torch.ops.flash_attn.bwd(
        dout.cpu(),
        q.cpu(),
        k.cpu(),
        v.cpu(),
        out.cpu(),
        lse.cpu(),
        slopes.cpu(),
        dropout_p,
        64**-0.5,
        True,
        -1,
        -1,
        20.0,
        False,
        rng_state.cpu(),
    )
    keep = None
    if dropout_p > 0:
        keep = reference.dropout_keep_mask_batch(777, 4, 2, 4, 150, 193, dropout_p).to(DEVICE)
    ref_kwargs = dict(
        causal=True, softcap=20.0, alibi_slopes=slopes, dropout_p=dropout_p, keep_mask=keep
    )
    exact = reference_grads(q, k, v, dout, torch.float32, **ref_kwargs)
    same = reference_grads(q, k, v, dout, dtype, **ref_kwargs)
    for name, ours, cpu, ref_exact, ref_same in zip(
        ("dq", "dk", "dv"), cuda_grads, cpu_grads, exact, same
    ):
        baseline = reference.max_abs_err(ref_same, ref_exact)
        # Both paths accumulate in fp32 from the same rounded inputs (and the
        # same dropout mask): they differ by about the output's own rounding.
        diff = reference.max_abs_err(ours.cpu(), cpu)
        assert diff <= 2 * baseline + GRAD_ATOL, f"{name}: CUDA vs CPU differ by {diff:.3e}"


@pytest.mark.parametrize("nheads,nheads_k", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_deterministic_is_bitwise_reproducible(nheads, nheads_k, causal, bwd_kernel):
    check_deterministic_bwd(700, 900, nheads, nheads_k, 128, causal)


def check_deterministic_bwd(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal):
    """deterministic=True: three runs bitwise equal, within the criterion, and
    within rounding of the default (atomic) path."""
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    first, _ = run_fwd_bwd(q, k, v, dout, causal=causal, deterministic=True)
    for _ in range(2):
        again, _ = run_fwd_bwd(q, k, v, dout, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    check_grads(q, k, v, dout, first, causal=causal)
    # The default (atomic) path agrees with it to within rounding.
    default, _ = run_fwd_bwd(q, k, v, dout, causal=causal)
    for a, b in zip(first, default):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_deterministic_key_blocks_without_queries(head_dim, bwd_kernel):
    """Deterministic mode gives a thread block several key blocks (one per
    dQ split, 2 x SM count splits over all heads); with 16 queries and a
    window most key blocks are seen by none, and empty and busy ones follow
    each other in a block's walk."""
    q, k, v = random_qkv(4, 16, 1500, 16, 16, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, window=(600, 0), deterministic=True)
    check_grads(q, k, v, dout, grads, window_size=(600, 0))


def test_varlen_bwd_deterministic_is_bitwise_reproducible(bwd_kernel):
    cu_q, max_q = random_cu_seqlens(4, 500, allow_empty=False)
    cu_k, max_k = random_cu_seqlens(4, 600, allow_empty=False)
    q = torch.randn(int(cu_q[-1]), 8, 64, device=DEVICE, dtype=torch.float16)
    k = torch.randn(int(cu_k[-1]), 2, 64, device=DEVICE, dtype=torch.float16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    first = run_varlen_fwd_bwd(
        q, k, v, dout, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True
    )
    second = run_varlen_fwd_bwd(
        q, k, v, dout, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True
    )
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    check_grads(
        q,
        k,
        v,
        dout,
        first,
        ref_fn=varlen_attention_ref,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_k=max_k,
        causal=True,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_bwd_sequences_around_a_query_block(dtype, head_dim, deterministic, bwd_kernel):
    # The dQ accumulator pads every sequence to whole query blocks of the main
    # kernel (64 or 128 rows; csrc/cuda/bwd/bwd_accum_layout.h) and stores a block's
    # values in fragment order. Lengths on both sides of a block, and empty
    # ones, side by side: a block's values landing in a neighbour's stretch, or
    # read back at the wrong row, would show here.
    lengths_q = torch.tensor([1, 63, 64, 65, 0, 127, 128, 129, 3, 200])
    lengths_k = torch.tensor([5, 70, 64, 1, 9, 130, 128, 140, 2, 199])
    cu_q = torch.zeros(len(lengths_q) + 1, dtype=torch.int32)
    cu_k = torch.zeros_like(cu_q)
    cu_q[1:], cu_k[1:] = torch.cumsum(lengths_q, 0), torch.cumsum(lengths_k, 0)
    max_q, max_k = int(lengths_q.max()), int(lengths_k.max())
    q = torch.randn(int(cu_q[-1]), 4, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), 2, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    grads = run_varlen_fwd_bwd(
        q, k, v, dout, cu_q, cu_k, max_q, max_k, causal=True, deterministic=deterministic
    )
    check_grads(
        q,
        k,
        v,
        dout,
        grads,
        ref_fn=varlen_attention_ref,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_k=max_k,
        causal=True,
    )


def test_bwd_default_path_repeats_within_rounding(bwd_kernel):
    q, k, v = random_qkv(2, 1023, 1024, 4, 4, 64, torch.float16)
    dout = torch.randn_like(q)
    first, _ = run_fwd_bwd(q, k, v, dout)
    second, _ = run_fwd_bwd(q, k, v, dout)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    # dK and dV never use atomics when nheads == nheads_k.
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 10), (10, 0), (0, 0)])
def test_bwd_empty_sequences(seqlen_q, seqlen_k, bwd_kernel):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2, 2, 64, torch.bfloat16)
    dout = torch.randn_like(q)
    (dq, dk, dv), _ = run_fwd_bwd(q, k, v, dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for grad in (dq, dk, dv):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_bwd_rows_that_see_no_key_get_zero_gradient(bwd_kernel):
    # Window (0, 0) with seqlen_q > seqlen_k: the first rows sit left of key 0.
    q, k, v = random_qkv(1, 200, 64, 2, 2, 64, torch.bfloat16)
    dout = torch.randn_like(q)
    (dq, dk, dv), (_, lse, _) = run_fwd_bwd(q, k, v, dout, window=(0, 0))
    empty_rows = torch.isinf(lse[0, 0])
    assert empty_rows.any()
    assert torch.equal(dq[0, empty_rows], torch.zeros_like(dq[0, empty_rows]))
    check_grads(q, k, v, dout, (dq, dk, dv), window_size=(0, 0))


def test_bwd_batch_heads_over_65535(bwd_kernel):
    batch, nheads = 17000, 4
    q, k, v = random_qkv(batch, 3, 5, nheads, nheads, 32, torch.float16)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout)
    for b in (0, batch // 2, batch - 1):
        sl = slice(b, b + 1)
        check_grads(q[sl], k[sl], v[sl], dout[sl], tuple(g[sl] for g in grads))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("features", ["plain", "softcap", "deterministic"])
def test_varlen_bwd_more_sequences_than_grid_yz(causal, features, bwd_kernel):
    """70000 sequences of 1 to 8 rows, two query heads on one kv head: 140000
    (head, sequence) pairs, more than CUDA's grid y or z holds (65535). Every
    backward kernel (D, the main kernel of either design, the dQ conversion,
    the kv heads' sums or, deterministic, their reduction) carries the pairs
    on y and z together (csrc/cuda/core/grid_heads_batch.h). Every sequence is
    checked."""
    batch, nheads, nheads_k, head_dim, max_len = 70000, 2, 1, 64, 8
    cu, q, k, v = many_short_sequences(batch, nheads, nheads_k, head_dim, torch.bfloat16, max_len)
    dout = torch.randn_like(q)
    softcap = 5.0 if features == "softcap" else 0.0
    grads = run_varlen_fwd_bwd(
        q,
        k,
        v,
        dout,
        cu,
        cu,
        max_len,
        max_len,
        causal=causal,
        softcap=softcap,
        deterministic=features == "deterministic",
    )
    for length in range(1, max_len + 1):
        rows = rows_of_sequences_of_length(cu, length, max_len)
        check_grads(
            q[rows],
            k[rows],
            v[rows],
            dout[rows],
            tuple(g[rows] for g in grads),
            causal=causal,
            softcap=softcap,
        )


def test_bwd_tensor_over_2_pow_31_elements():
    free, _ = torch.cuda.mem_get_info()
    # q, k, v, out, dout, dq, dk, dv at 4 GiB each plus the 8 GiB fp32 dQ accumulator.
    if free < 48 * (1 << 30):
        pytest.skip("needs about 48 GiB of free GPU memory")
    seqlen, nheads, head_dim = 128, 16, 128
    batch = (1 << 31) // (seqlen * nheads * head_dim) + 1
    q, k, v = random_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, torch.bfloat16)
    assert q.numel() > 1 << 31
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=True)
    for b in (0, batch - 1):
        sl = slice(b, b + 1)
        check_grads(q[sl], k[sl], v[sl], dout[sl], tuple(g[sl] for g in grads), causal=True)


def test_bwd_through_autograd_api():
    from flash_attn_cuda import flash_attn_func

    q, k, v = random_qkv(2, 130, 150, 4, 2, 72, torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_()
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_grads(q.detach(), k.detach(), v.detach(), dout, grads, causal=True)


def test_bwd_torch_compile_training_matches_eager():
    from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func

    torch._dynamo.reset()
    nheads, head_dim, width = 4, 64, 256
    proj = torch.nn.Linear(width, 3 * width, device=DEVICE, dtype=torch.bfloat16)
    cu = torch.tensor([0, 50, 51, 128], dtype=torch.int32, device=DEVICE)

    def loss_fn(x):
        batch, seqlen, _ = x.shape
        q, k, v = proj(x).view(batch, seqlen, 3, nheads, head_dim).unbind(2)
        dense = flash_attn_func(q, k, v, causal=True, deterministic=True)
        tq, tk, tv = (t.reshape(-1, nheads, head_dim) for t in (q, k, v))
        varlen = flash_attn_varlen_func(
            tq, tk, tv, cu, cu, 77, 77, window_size=(9, 3), deterministic=True
        )
        return dense.float().square().mean() + varlen.float().square().mean()

    x = torch.randn(1, 128, width, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    eager_loss = loss_fn(x)
    eager_grads = torch.autograd.grad(eager_loss, (x, proj.weight))
    compiled = torch.compile(loss_fn, fullgraph=True)
    compiled_loss = compiled(x)
    compiled_grads = torch.autograd.grad(compiled_loss, (x, proj.weight))
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-3, rtol=1e-3)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
