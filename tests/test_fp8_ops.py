"""FP8 at the op boundary (docs/fp8.md): opcheck and torch.compile of the fp8
calls on the CPU, the errors bad fp8 input gets, and which CUDA devices serve
fp8 (the CUDA results: tests/test_cuda_fp8_attention.py and
tests/test_cuda_fp8_kvcache.py)."""

import pytest
import torch

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

FP8 = torch.float8_e4m3fn
ops = torch.ops.flash_attn
# test_schema cannot run on fp8 tensors: torch's SchemaCheckMode compares
# tensors with arithmetic that float8_e4m3fn lacks. The schemas are those of
# the 16-bit calls (tests/test_opcheck.py runs test_schema on them), and
# assert_inputs_unchanged checks here that an fp8 call writes no input.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def snapshot(tensors):
    return [t.view(torch.uint8).clone() if t.dtype == FP8 else t.clone() for t in tensors]


def assert_inputs_unchanged(before, tensors):
    for saved, t in zip(before, tensors):
        assert torch.equal(saved, t.view(torch.uint8) if t.dtype == FP8 else t)


def fp8_rand(*shape, device="cpu"):
    return (torch.randn(*shape) * 2).clamp(-6, 6).to(FP8).to(device)


def descales(batch, nheads_k, device="cpu"):
    return (torch.rand(batch, nheads_k) * 0.5 + 0.05).to(device)


def fwd_args(q, k, v, causal=False):
    scale = q.shape[-1] ** -0.5
    return (q, k, v, None, 0.0, scale, causal, -1, -1, 0.0, False, 0, 0, None)


def descale_kwargs(batch, nheads_k, device="cpu"):
    return dict(
        q_descale=descales(batch, nheads_k, device),
        k_descale=descales(batch, nheads_k, device),
        v_descale=descales(batch, nheads_k, device),
    )


# ---------------------------------------------------------------------------
# opcheck and fake kernels
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_fwd_fp8(causal):
    q, k, v = fp8_rand(2, 17, 4, 32), fp8_rand(2, 20, 2, 32), fp8_rand(2, 20, 2, 32)
    kwargs = descale_kwargs(2, 2)
    before = snapshot([q, k, v, *kwargs.values()])
    ops.fwd(*fwd_args(q, k, v, causal), **kwargs)
    assert_inputs_unchanged(before, [q, k, v, *kwargs.values()])
    torch.library.opcheck(
        ops.fwd.default, fwd_args(q, k, v, causal), kwargs, test_utils=OPCHECK_UTILS
    )
    out = torch.empty(2, 17, 4, 32, dtype=torch.bfloat16)
    torch.library.opcheck(
        ops.fwd_out.default,
        fwd_args(q, k, v, causal),
        dict(kwargs, out=out),
        test_utils=OPCHECK_UTILS,
    )


def paged_varlen_args(q):
    """varlen_fwd's positional arguments for q (9, 4, 32): two sequences of 4
    and 5 queries over 7 and 12 causal keys in e4m3 pages of 4 rows, through a
    shuffled table."""
    k_pages, v_pages = fp8_rand(6, 4, 2, 32), fp8_rand(6, 4, 2, 32)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 19], dtype=torch.int32)
    table = torch.tensor([[5, 1, 0, 0], [2, 3, 4, 0]], dtype=torch.int32)
    args = (q, k_pages, v_pages, cu_q, cu_k, table, None, 5, 12, 0.0, 0.2, True, -1, -1, 0.0)
    return args + (False, 0, 0, None)


def test_opcheck_varlen_fwd_fp8_paged():
    args = paged_varlen_args(fp8_rand(9, 4, 32))
    before = snapshot(args[:3])
    ops.varlen_fwd(*args, **descale_kwargs(2, 2))
    assert_inputs_unchanged(before, args[:3])
    torch.library.opcheck(
        ops.varlen_fwd.default, args, descale_kwargs(2, 2), test_utils=OPCHECK_UTILS
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_fp8_cache_forms(dtype):
    """fwd, fwd_out, varlen_fwd (paged) and varlen_fwd_out with e4m3 k and v
    under a 16-bit q: out in q's dtype, no input written."""
    q = torch.randn(2, 5, 4, 32, dtype=dtype)
    k, v = fp8_rand(2, 6, 2, 32), fp8_rand(2, 6, 2, 32)
    kwargs = dict(k_descale=descales(2, 2), v_descale=descales(2, 2))
    before = snapshot([q, k, v])
    out, _, _, _ = ops.fwd(*fwd_args(q, k, v, True), **kwargs)
    assert out.dtype == dtype
    assert_inputs_unchanged(before, [q, k, v])
    torch.library.opcheck(
        ops.fwd.default, fwd_args(q, k, v, True), kwargs, test_utils=OPCHECK_UTILS
    )
    torch.library.opcheck(
        ops.fwd_out.default,
        fwd_args(q, k, v),
        dict(kwargs, out=torch.empty(2, 5, 4, 32, dtype=dtype)),
        test_utils=OPCHECK_UTILS,
    )
    args = paged_varlen_args(torch.randn(9, 4, 32, dtype=dtype))
    torch.library.opcheck(ops.varlen_fwd.default, args, kwargs, test_utils=OPCHECK_UTILS)
    torch.library.opcheck(
        ops.varlen_fwd_out.default,
        args,
        dict(kwargs, out=torch.empty(9, 4, 32, dtype=dtype)),
        test_utils=OPCHECK_UTILS,
    )


def test_opcheck_fwd_kvcache_fp8_append():
    k_cache, v_cache = fp8_rand(2, 16, 2, 32), fp8_rand(2, 16, 2, 32)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16)
    k, v = (
        torch.randn(2, 1, 2, 32, dtype=torch.bfloat16),
        torch.randn(2, 1, 2, 32, dtype=torch.bfloat16),
    )
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    args = (q, k_cache, v_cache, k, v, seqlens, None, None, None, None, None, None, 0.18, True)
    args += (-1, -1, 0.0, True, 0)
    kwargs = dict(k_descale=descales(2, 2), v_descale=descales(2, 2))
    torch.library.opcheck(ops.fwd_kvcache.default, args, kwargs, test_utils=OPCHECK_UTILS)


def test_fake_kernels_give_the_output_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = fp8_rand(2, 5, 4, 32), fp8_rand(2, 6, 2, 32), fp8_rand(2, 6, 2, 16)
        out, lse, _, _ = ops.fwd(*fwd_args(q, k, v), **descale_kwargs(2, 2))
        assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 4, 16)
        assert lse.dtype == torch.float32
        q16 = torch.randn(2, 1, 4, 32, dtype=torch.float16)
        k_cache, v_cache = fp8_rand(2, 8, 2, 32), fp8_rand(2, 8, 2, 32)
        args = (q16, k_cache, v_cache, None, None, None, None, None, None, None, None, None, 0.2)
        out, lse = ops.fwd_kvcache(*args, False, -1, -1, 0.0, True, 0, k_descale=descales(2, 2))
        assert out.dtype == torch.float16
        q16 = torch.randn(2, 5, 4, 32, dtype=torch.float16)
        out, _, _, _ = ops.fwd(*fwd_args(q16, k, v), k_descale=descales(2, 2))
        assert out.dtype == torch.float16 and out.shape == (2, 5, 4, 16)


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def test_compile_fp8_func_and_varlen():
    q, k, v = fp8_rand(2, 33, 4, 64), fp8_rand(2, 40, 2, 64), fp8_rand(2, 40, 2, 64)
    scales = descale_kwargs(2, 2)

    def attention(q, k, v, q_descale, k_descale, v_descale):
        return flash_attn_func(
            q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
        )

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    expected = attention(q, k, v, **scales)
    assert torch.equal(compiled(q, k, v, **scales), expected)

    cu = torch.tensor([0, 10, 33], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 40], dtype=torch.int32)

    def varlen(q, k, v, scale):
        return flash_attn_varlen_func(q, k, v, cu, cu_k, 23, 20, k_descale=scale, v_descale=scale)

    compiled = torch.compile(varlen, backend="aot_eager", fullgraph=True)
    q2, k2, v2 = q.flatten(0, 1)[:33], k.flatten(0, 1), v.flatten(0, 1)
    assert torch.equal(
        compiled(q2, k2, v2, scales["k_descale"]), varlen(q2, k2, v2, scales["k_descale"])
    )
    torch._dynamo.reset()


def test_compile_fp8_cache_paged_varlen():
    """The chunked-prefill call over a paged e4m3 cache with a bf16 q traces
    under torch.compile(fullgraph=True) and gives the eager result."""
    q, k_pages, v_pages, cu_q, cu_k, table = paged_varlen_args(
        torch.randn(9, 4, 32, dtype=torch.bfloat16)
    )[:6]
    k_scale, v_scale = descales(2, 2), descales(2, 2)

    def prefill(q, k_pages, v_pages, k_scale, v_scale):
        return flash_attn_varlen_func(
            q, k_pages, v_pages, cu_q, cu_k, 5, 12, causal=True, block_table=table,
            k_descale=k_scale, v_descale=v_scale,
        )  # fmt: skip

    compiled = torch.compile(prefill, backend="aot_eager", fullgraph=True)
    expected = prefill(q, k_pages, v_pages, k_scale, v_scale)
    assert expected.dtype == torch.bfloat16
    assert torch.equal(compiled(q, k_pages, v_pages, k_scale, v_scale), expected)
    torch._dynamo.reset()


def test_compile_fp8_kvcache_decode_step():
    batch, nheads, nheads_k, d = 2, 4, 2, 64
    k_scale, v_scale = descales(batch, nheads_k), descales(batch, nheads_k)

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
            k_descale=k_scale, v_descale=v_scale,
        )  # fmt: skip

    def inputs():
        torch.manual_seed(0)
        q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16)
        k = torch.randn(batch, 1, nheads_k, d, dtype=torch.bfloat16)
        v = torch.randn(batch, 1, nheads_k, d, dtype=torch.bfloat16)
        caches = fp8_rand(batch, 16, nheads_k, d), fp8_rand(batch, 16, nheads_k, d)
        return q, caches[0], caches[1], k, v, torch.tensor([3, 11], dtype=torch.int32)

    eager_in, compiled_in = inputs(), inputs()
    expected = step(*eager_in)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*compiled_in), expected)
    for cache_eager, cache_compiled in zip(eager_in[1:3], compiled_in[1:3]):
        assert torch.equal(cache_eager.view(torch.uint8), cache_compiled.view(torch.uint8))
    # The append happened under compile too: the cache changed.
    assert not torch.equal(compiled_in[1].view(torch.uint8), inputs()[1].view(torch.uint8))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def fp8_call(**overrides):
    q, k, v = fp8_rand(2, 5, 4, 32), fp8_rand(2, 6, 2, 32), fp8_rand(2, 6, 2, 32)
    kwargs = dict(q=q, k=k, v=v)
    kwargs.update(overrides)
    return flash_attn_func(**kwargs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(k_descale=torch.ones(2, 4)), r"k_descale must have shape \(batch, nheads_k\) = \(2, 2\), got \[2, 4\]"),
        (dict(q_descale=torch.ones(2)), r"q_descale must have shape \(batch, nheads_k\) = \(2, 2\), got \[2\]"),
        (dict(v_descale=torch.ones(2, 2, dtype=torch.float16)), "v_descale must have dtype float32, got Half"),
        (dict(v_descale=torch.ones(2, 2, dtype=torch.float64)), "v_descale must have dtype float32, got Double"),
        (dict(k_descale=torch.ones(2, 2, device="meta")), r"k_descale must be on the same device as q \(cpu\), got meta"),
        (dict(dropout_p=0.1), "dropout is not served with float8_e4m3fn inputs.*got 0.1"),
        (dict(alibi_slopes=torch.ones(4)), "alibi_slopes is not served with float8_e4m3fn"),
    ],
)  # fmt: skip
def test_bad_fp8_arguments(overrides, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        fp8_call(**overrides)


def test_descales_without_fp8_inputs():
    q = torch.randn(2, 5, 4, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 6, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q_descale is given but q, k and v are not float8"):
        flash_attn_func(q, k, k, q_descale=torch.ones(2, 2))
    k_cache = torch.randn(2, 8, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="v_descale is given but k_cache and v_cache are not"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), v_descale=torch.ones(2, 2))


def test_mixed_and_e5m2_dtypes():
    q, k = fp8_rand(2, 5, 4, 32), fp8_rand(2, 6, 2, 32)
    v16 = torch.randn(2, 6, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be all float8_e4m3fn .*or none of them; got q"):
        flash_attn_func(q, k, v16)
    with pytest.raises(RuntimeError, match="must be all float8_e4m3fn .*or none of them; got q"):
        flash_attn_func(v16, k, v16)
    with pytest.raises(RuntimeError, match="k has dtype float8_e5m2, which is not served"):
        flash_attn_func(q, k.float().to(torch.float8_e5m2), k)


def test_bad_fp8_kvcache_arguments():
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16)
    k_cache, v_cache = fp8_rand(2, 8, 2, 32), fp8_rand(2, 8, 2, 32)
    with pytest.raises(RuntimeError, match="q_descale is not taken with an FP8 KV cache"):
        flash_attn_with_kvcache(q, k_cache, v_cache, q_descale=torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="q has dtype float8_e4m3fn, which fwd_kvcache does not"):
        flash_attn_with_kvcache(q.to(FP8), k_cache, v_cache)
    with pytest.raises(RuntimeError, match="must have dtype float16 or bfloat16, got Float"):
        flash_attn_with_kvcache(q.float(), k_cache, v_cache)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must both be float8_e4m3fn"):
        flash_attn_with_kvcache(q, k_cache, v_cache.float().to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="v_cache has dtype float8_e5m2"):
        flash_attn_with_kvcache(q, k_cache, v_cache.float().to(torch.float8_e5m2))
    with pytest.raises(
        RuntimeError, match=r"k_descale must have shape \(batch, nheads_k\) = \(2, 2\)"
    ):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="alibi_slopes is not served with float8_e4m3fn"):
        flash_attn_with_kvcache(q, k_cache, v_cache, alibi_slopes=torch.ones(4))


def test_bad_fp8_cache_forms_of_fwd_and_varlen_fwd():
    """e4m3 k and v under a 16-bit q (an FP8 KV cache through the forward):
    no q_descale, a float16 / bfloat16 q, k and v both e4m3, out in q's dtype."""
    q = torch.randn(2, 5, 4, 32, dtype=torch.bfloat16)
    k, v = fp8_rand(2, 6, 2, 32), fp8_rand(2, 6, 2, 32)
    with pytest.raises(RuntimeError, match="q_descale is not taken with float8_e4m3fn k and v"):
        flash_attn_func(q, k, v, q_descale=torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="q must have dtype float16 or bfloat16.*got Float"):
        flash_attn_func(q.float(), k, v)
    with pytest.raises(RuntimeError, match="v has dtype float8_e5m2"):
        flash_attn_func(q, k, v.float().to(torch.float8_e5m2))
    with pytest.raises(RuntimeError, match="dropout is not served with float8_e4m3fn"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"out must have the dtype of q \(torch.bfloat16\)"):
        flash_attn_func(q, k, v, out=torch.empty(2, 5, 4, 32, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="out must have the dtype of q"):
        ops.fwd_out(*fwd_args(q, k, v), out=torch.empty(2, 5, 4, 32, dtype=torch.float16))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32)
    q3, k3, v3 = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    with pytest.raises(RuntimeError, match=r"k_descale must have shape \(batch, nheads_k\)"):
        flash_attn_varlen_func(q3, k3, v3, cu, cu_k, 5, 6, k_descale=torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="q_descale is not taken with float8_e4m3fn k and v"):
        flash_attn_varlen_func(q3, k3, v3, cu, cu_k, 5, 6, q_descale=torch.ones(2, 2))


def test_fp8_cache_forward_is_forward_only():
    q = torch.randn(2, 5, 4, 32, dtype=torch.float16, requires_grad=True)
    k, v = fp8_rand(2, 6, 2, 32), fp8_rand(2, 6, 2, 32)
    out = flash_attn_func(q, k, v)
    assert out.dtype == torch.float16
    with pytest.raises(RuntimeError, match="backward pass does not take float8_e4m3fn inputs"):
        out.sum().backward()


def test_fp8_out_must_be_bfloat16():
    q, k = fp8_rand(2, 5, 4, 32), fp8_rand(2, 6, 2, 32)
    out = torch.empty(2, 5, 4, 32, dtype=torch.float16)
    with pytest.raises(
        ValueError,
        match=r"out must have the output dtype of a torch.float8_e4m3fn q \(torch.bfloat16\)",
    ):
        flash_attn_func(q, k, k, out=out)
    # The op checks it too.
    with pytest.raises(RuntimeError, match="out must have dtype BFloat16"):
        ops.fwd_out(*fwd_args(q, k, k), out=out)


def test_fp8_return_softmax_refused_by_the_op():
    q, k = fp8_rand(2, 5, 4, 32), fp8_rand(2, 6, 2, 32)
    args = list(fwd_args(q, k, k))
    args[10] = True
    with pytest.raises(RuntimeError, match=r"return_softmax \(S_dmask\) is not served"):
        ops.fwd(*args)


# ---------------------------------------------------------------------------
# CUDA: FP8 attention and an FP8 KV cache served on sm89 and newer
# (tests/test_cuda_fp8_attention.py, tests/test_cuda_fp8_kvcache.py), refused
# by name on older GPUs
# ---------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_serves_fp8_on_sm89_and_refuses_it_before():
    q, k = fp8_rand(2, 5, 4, 32, device="cuda"), fp8_rand(2, 6, 2, 32, device="cuda")
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda")
    q16 = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16, device="cuda")
    k_cache = fp8_rand(2, 8, 2, 32, device="cuda")
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(RuntimeError, match="FP8 attention .* compute capability 8.9 or newer"):
            flash_attn_func(q, k, k, k_descale=descales(2, 2, "cuda"))
        with pytest.raises(RuntimeError, match="FP8 attention .* compute capability 8.9 or newer"):
            flash_attn_varlen_func(
                q.flatten(0, 1), k.flatten(0, 1)[:10], k.flatten(0, 1)[:10], cu, cu, 5, 5
            )
        with pytest.raises(RuntimeError, match="FP8 KV cache .* compute capability 8.9 or newer"):
            flash_attn_with_kvcache(q16, k_cache, k_cache.clone())
    else:
        out = flash_attn_func(q, k, k, k_descale=descales(2, 2, "cuda"))
        assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 4, 32)
        assert torch.isfinite(out).all()
    # The shared checks come first: the same message as on the CPU.
    with pytest.raises(RuntimeError, match="q_descale is given but q, k and v are not float8"):
        flash_attn_func(q16, q16, q16, q_descale=torch.ones(2, 4, device="cuda"))


def test_packed_forms_take_fp8_with_unit_descales():
    """docs/fp8.md: the packed forms have no descale arguments; fp8 inputs run
    with descales of 1, the same as flash_attn_func without descales."""
    from flash_attn_cuda import flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    qkv = fp8_rand(2, 17, 3, 4, 32)
    q, k, v = qkv.unbind(2)
    expected = flash_attn_func(q, k, v, causal=True)
    assert expected.dtype == torch.bfloat16
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=True), expected)
    assert torch.equal(flash_attn_kvpacked_func(q, qkv[:, :, 1:], causal=True), expected)
