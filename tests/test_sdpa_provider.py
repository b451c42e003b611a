"""The "FLASH_ATTN_CUDA" provider of torch.nn.attention's flash-attention registry.

CPU tests (run everywhere): the provider is registered and never active on its
own; activate / restore put our kernels into the dispatcher and take them out;
each override (flash_attn_cuda.integrations.sdpa) is called directly on CPU
tensors and compared with attention in float64 (tests/reference.py) under the
project's criterion (docs/architecture.md); torch's own autograd formulas and varlen_attn
run on the overrides registered for the CPU key (where these aten ops have no
kernel of their own); dropout state round-trips through torch's uint64
rng_state; calls the ops cannot serve raise UnsupportedAttentionCall.

CUDA tests (skipped without a GPU): with the provider active,
F.scaled_dot_product_attention under the FLASH backend, torch.compile and
varlen_attn run our kernels and match torch's built-in FLASH backend within the
criterion; restore gives the built-in kernels back.
"""

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import reference as ref
from provider_spy import spy

import flash_attn_cuda
from flash_attn_cuda.integrations import sdpa
from flash_attn_cuda.integrations.sdpa import UnsupportedAttentionCall

needs_registry = pytest.mark.skipif(
    not sdpa.registry_available(),
    reason="torch.nn.attention.register_flash_attention_impl needs torch >= 2.10",
)
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without varlen_attn
    varlen_attn = None
needs_varlen = pytest.mark.skipif(
    varlen_attn is None, reason="torch.nn.attention.varlen.varlen_attn is missing in this torch"
)

NAME = sdpa.PROVIDER_NAME

# The CPU tests activate the provider on purpose where it serves no GPU; one test checks
# the warning that gives.
pytestmark = pytest.mark.filterwarnings(
    "ignore:FLASH_ATTN_CUDA provider activated, but no CUDA GPU:UserWarning"
)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _bhsd(batch, nheads, seqlen, head_dim, dtype, device="cpu"):
    return torch.randn(batch, nheads, seqlen, head_dim, dtype=dtype, device=device)


def _ref_bhsd(q, k, v, causal, scale=None, dtype=torch.float64, keep_mask=None, dropout_p=0.0):
    """attention_ref on BHSD tensors; returns (out BHSD, lse (B, H, Sq))."""
    out, lse = ref.attention_ref(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        softmax_scale=scale,
        causal=causal,
        compute_dtype=dtype,
        keep_mask=keep_mask,
        dropout_p=dropout_p,
    )
    return out.transpose(1, 2), lse


def _ref_grads(q, k, v, dout, causal, dtype, **kwargs):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = _ref_bhsd(*leaves, causal, dtype=dtype, **kwargs)
    out.backward(dout.to(dtype))
    return out.detach(), [t.grad for t in leaves]


def _seed_offset(rng_state):
    pair = rng_state.view(torch.int64).cpu().tolist()
    return pair[0], pair[1]


@pytest.fixture
def cpu_kernels():
    """The overrides registered for the CPU key of the aten ops (test only)."""
    handle = sdpa._install(("CPU",))
    yield
    handle.remove()


@pytest.fixture
def provider():
    torch.nn.attention.activate_flash_attention_impl(NAME)
    yield
    torch.nn.attention.restore_flash_attention_impl()


def _varlen_kwargs(window, gqa, nheads=4):
    """varlen_attn's keywords for a window and GQA, as far as this torch's
    varlen_attn takes them (torch 2.11's has is_causal, not window_size, and no
    enable_gqa); returns them with the K/V head count to use."""
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = window
    elif window == (-1, 0) and "is_causal" in params:
        kwargs["is_causal"] = True
    elif window != (-1, -1):
        pytest.skip(f"this torch's varlen_attn takes no window_size (window {window})")
    nheads_k = nheads
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
        nheads_k = nheads // 4 if nheads >= 8 else nheads // 2
    return kwargs, nheads_k


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


@needs_registry
def test_registered_and_not_active_on_import():
    assert NAME in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() != NAME


def test_import_works_without_registry(monkeypatch):
    # An older torch: register_provider does nothing and says so.
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl", raising=False)
    assert not sdpa.registry_available()
    assert sdpa.register_provider() is False


def _cuda_kernel_source(op):
    dump = torch._C._dispatch_dump(f"aten::{op}")
    return "\n".join(line for line in dump.splitlines() if line.startswith("CUDA:"))


@needs_registry
def test_activate_restore_round_trip():
    before = {op: _cuda_kernel_source(op) for op in sdpa.overridden_ops()}
    torch.nn.attention.activate_flash_attention_impl(NAME)
    try:
        assert torch.nn.attention.current_flash_attention_impl() == NAME
        for op in sdpa.overridden_ops():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA")
            assert _cuda_kernel_source(op) != before[op], op
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert torch.nn.attention.current_flash_attention_impl() is None
    assert {op: _cuda_kernel_source(op) for op in sdpa.overridden_ops()} == before
    # Activating twice in a row (the registry restores first) is fine too.
    torch.nn.attention.activate_flash_attention_impl(NAME)
    torch.nn.attention.activate_flash_attention_impl(NAME)
    torch.nn.attention.restore_flash_attention_impl()
    assert {op: _cuda_kernel_source(op) for op in sdpa.overridden_ops()} == before


@needs_registry
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_activation_without_a_gpu_says_it_serves_nothing():
    with pytest.warns(UserWarning, match=r"FLASH_ATTN_CUDA provider activated, but no CUDA GPU"):
        torch.nn.attention.activate_flash_attention_impl(NAME)
    torch.nn.attention.restore_flash_attention_impl()


def _fake_gpus(monkeypatch, *capabilities):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capabilities[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")


@pytest.mark.parametrize(
    "capabilities, archs, reason",
    [
        ([(9, 0)], "sm_80,sm_90a", None),
        ([(8, 6), (8, 9)], "sm_80", None),
        ([(9, 0)], "sm_80", r"cuda:0 \(GPU0, sm_90\) has no kernels in this build \(archs sm_80\)"),
        ([(8, 0), (10, 0)], "sm_90a", r"cuda:0 .*sm_80.* has no kernels.*cuda:1"),
        ([(7, 5)], "sm_80", r"cuda:0 \(GPU0, sm_75\) is older than sm80"),
    ],
)
def test_provider_names_the_gpus_a_build_cannot_serve(monkeypatch, capabilities, archs, reason):
    _fake_gpus(monkeypatch, *capabilities)
    monkeypatch.setattr(flash_attn_cuda, "cuda_built", True)
    monkeypatch.setattr(flash_attn_cuda, "build_info", f"cuda 13.0; archs {archs}; hdims 128")
    found = sdpa._cannot_serve()
    if reason is None:
        assert found is None
    else:
        assert found is not None and re.search(reason, found), found


def test_provider_on_a_build_without_cuda_kernels(monkeypatch):
    _fake_gpus(monkeypatch, (9, 0))
    monkeypatch.setattr(flash_attn_cuda, "cuda_built", False)
    monkeypatch.setattr(flash_attn_cuda, "build_info", "cpu-only (no nvcc found); torch 2.15")
    assert "this build of flash_attn_cuda has no CUDA kernels (cpu-only" in sdpa._cannot_serve()


def test_overrides_take_every_argument_of_the_installed_schema():
    """Each override names every argument the installed torch's schema has (the
    keyword arguments differ between torch releases)."""
    assert {"_scaled_dot_product_flash_attention", "_flash_attention_forward"} <= set(
        sdpa.overridden_ops()
    )
    for op in sdpa.overridden_ops():
        schema = getattr(torch.ops.aten, op).default._schema
        params = inspect.signature(sdpa._OVERRIDES[op]).parameters
        takes_any_kwarg = any(p.kind is p.VAR_KEYWORD for p in params.values())
        positional = [a for a in schema.arguments if not a.kwarg_only]
        named = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(named) == len(positional), op
        for arg in schema.arguments:
            if arg.kwarg_only and op != "_flash_attention_forward_no_dropout_inplace":
                assert arg.name in params, f"{op}: {arg.name}"
            else:
                assert arg.name in params or takes_any_kwarg, f"{op}: {arg.name}"


# ---------------------------------------------------------------------------
# Direct calls on CPU tensors against float64
# ---------------------------------------------------------------------------

SDPA_CASES = [
    # batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim, causal
    (2, 4, 4, 17, 17, 64, False),
    (2, 4, 4, 113, 113, 32, True),
    (1, 8, 2, 33, 65, 40, False),  # GQA 4, seqlen_q != seqlen_k, head dim not a multiple of 8
    (1, 6, 1, 64, 31, 72, True),  # MQA, causal with seqlen_q > seqlen_k (bottom-right)
    (3, 2, 2, 1, 129, 96, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_forward_backward_direct(case, dtype):
    batch, h, hk, sq, sk, d, causal = case
    q, k, v = (
        _bhsd(batch, h, sq, d, dtype),
        _bhsd(batch, hk, sk, d, dtype),
        _bhsd(batch, hk, sk, d, dtype),
    )
    res = sdpa.scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    assert len(res) == 9
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug = res
    assert out.shape == q.shape and out.dtype == dtype and out.stride() == q.stride()
    assert lse.shape == (batch, h, sq) and lse.dtype == torch.float32
    assert cum_q is None and cum_k is None and (max_q, max_k) == (sq, sk)
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    assert unused.dtype == torch.uint64 and unused.shape == ()
    assert debug.numel() == 0

    dout = torch.randn_like(out)
    out64, grads64 = _ref_grads(q, k, v, dout, causal, torch.float64)
    out_low, grads_low = _ref_grads(q, k, v, dout, causal, dtype)
    ref.assert_within_criterion(out, out64, out_low)
    _, lse64 = _ref_bhsd(q, k, v, causal)
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], lse64[finite], atol=1e-4, rtol=1e-4)

    grads = sdpa.scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, rng_state, unused
    )
    for name, g, g64, g_low, t in zip("qkv", grads, grads64, grads_low, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
        ref.assert_within_criterion(g, g64, g_low, factor=3.0, atol=1e-4, name=f"d{name}")


def test_sdpa_scale_and_bshd_memory_layout():
    # q, k, v that are transposes of (batch, seqlen, nheads, head_dim) tensors:
    # the op reads them in place and returns outputs in their layout.
    q, k, v = (torch.randn(2, 19, 4, 32).transpose(1, 2) for _ in range(3))
    out, lse, *_ = sdpa.scaled_dot_product_flash_attention(q, k, v, scale=0.3)
    assert out.stride() == torch.empty_like(q).stride()
    out64, _ = _ref_bhsd(q, k, v, False, scale=0.3)
    out_low, _ = _ref_bhsd(q, k, v, False, scale=0.3, dtype=torch.float32)
    ref.assert_within_criterion(out, out64, out_low)


def test_output_layout_strides_match_empty_like():
    # _in_layout_of caches empty_like's strides by (shape, stride): the same
    # answer as empty_like for dense, transposed, sliced (not dense), expanded
    # and channels-last layouts, on the first call and from the cache.
    base = torch.randn(2, 5, 3, 16)
    layouts = [
        base,
        base.transpose(1, 2),
        base[..., :8],
        base.transpose(1, 2)[..., 1:9],
        base[:, :1].expand(2, 5, 3, 16),
        base.contiguous(memory_format=torch.channels_last),
        base[:1],
    ]
    for _ in range(2):
        for t in layouts:
            assert sdpa._empty_like_strides(t) == torch.empty_like(t).stride()
            result = torch.randn(t.shape)
            assert sdpa._in_layout_of(result, t).stride() == torch.empty_like(t).stride()


@pytest.mark.parametrize("head_dim", [40, 64])
def test_flash_attention_forward_dense_window(head_dim):
    q, k, v = (torch.randn(2, 37, 4, head_dim) for _ in range(3))
    out, lse, rng_state, unused, debug = sdpa.flash_attention_forward(
        q, k, v, None, None, 37, 37, 0.0, False, False, window_size_left=5, window_size_right=3
    )
    assert out.shape == q.shape and lse.shape == (2, 4, 37)
    exp64, _ = ref.attention_ref(q, k, v, window_size=(5, 3))
    exp32, _ = ref.attention_ref(q, k, v, window_size=(5, 3), compute_dtype=torch.float32)
    ref.assert_within_criterion(out, exp64, exp32)
    dout = torch.randn_like(out)
    grads = sdpa.flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        37,
        37,
        0.0,
        False,
        rng_state,
        unused,
        window_size_left=5,
        window_size_right=3,
    )
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref.attention_ref(*leaves, window_size=(5, 3))[0].backward(dout.double())
    leaves32 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref.attention_ref(*leaves32, window_size=(5, 3), compute_dtype=torch.float32)[0].backward(dout)
    for g, l64, l32 in zip(grads, leaves, leaves32):
        ref.assert_within_criterion(g, l64.grad, l32.grad, factor=3.0, atol=1e-4)


def _varlen_inputs(lengths_q, lengths_k, h, hk, d, dtype=torch.float32):
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), hk, d, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hk, d, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward_backward_varlen(causal):
    q, k, v, cu_q, cu_k = _varlen_inputs([5, 17, 1, 30], [9, 17, 4, 30], 4, 2, 64)
    out, lse, rng_state, unused, _ = sdpa.flash_attention_forward(
        q, k, v, cu_q, cu_k, 30, 30, 0.0, causal, False
    )
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    exp64, _ = ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    exp32, _ = ref.varlen_attention_ref(
        q, k, v, cu_q, cu_k, causal=causal, compute_dtype=torch.float32
    )
    ref.assert_within_criterion(out, exp64, exp32)
    dout = torch.randn_like(out)
    grads = sdpa.flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, 30, 30, 0.0, causal, rng_state, unused
    )
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref.varlen_attention_ref(*leaves, cu_q, cu_k, causal=causal)[0].backward(dout.double())
    leaves32 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref.varlen_attention_ref(*leaves32, cu_q, cu_k, causal=causal, compute_dtype=torch.float32)[
        0
    ].backward(dout)
    for g, l64, l32 in zip(grads, leaves, leaves32):
        ref.assert_within_criterion(g, l64.grad, l32.grad, factor=3.0, atol=1e-4)


def test_flash_attention_forward_passes_num_splits():
    """torch's num_splits reaches varlen_fwd (None: the op's choice, 1: no split):
    the same result on the CPU, and a bad count is refused naming it."""
    q, k, v, cu_q, cu_k = _varlen_inputs([1, 1, 3], [10, 7, 12], 4, 2, 32)
    plain, *_ = sdpa.flash_attention_forward(q, k, v, cu_q, cu_k, 3, 12, 0.0, True, False)
    for num_splits in (0, 1, 5):
        out, *_ = sdpa.flash_attention_forward(
            q, k, v, cu_q, cu_k, 3, 12, 0.0, True, False, num_splits=num_splits
        )
        assert torch.equal(out, plain), num_splits
    with pytest.raises(RuntimeError, match="num_splits must be in"):
        sdpa.flash_attention_forward(q, k, v, cu_q, cu_k, 3, 12, 0.0, True, False, num_splits=-1)


def test_flash_attention_forward_seqused_k():
    # Only the first seqused_k[b] keys of each sequence take part.
    q, k, v, cu_q, cu_k = _varlen_inputs([4, 6, 3], [10, 7, 12], 2, 2, 32)
    used = torch.tensor([3, 7, 0], dtype=torch.int32)
    out, lse, *_ = sdpa.flash_attention_forward(
        q, k, v, cu_q, cu_k, 6, 12, 0.0, False, False, seqused_k=used
    )
    keep = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(cu_k[:-1], used)])
    new_cu_k = torch.tensor([0, 3, 10, 10], dtype=torch.int32)
    exp64, lse64 = ref.varlen_attention_ref(q, k[keep], v[keep], cu_q, new_cu_k, max_seqlen_k=12)
    exp32, _ = ref.varlen_attention_ref(
        q, k[keep], v[keep], cu_q, new_cu_k, max_seqlen_k=12, compute_dtype=torch.float32
    )
    ref.assert_within_criterion(out, exp64, exp32)
    # The third sequence sees no key: output 0, lse +inf.
    assert torch.all(out[10:] == 0) and torch.all(torch.isinf(lse[:, 10:]))
    with pytest.raises(UnsupportedAttentionCall, match="seqused_k"):
        sdpa.flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            6,
            12,
            0.0,
            False,
            False,
            seqused_k=torch.tensor([3, 8, 0], dtype=torch.int32),
        )


def test_flash_attention_forward_paged():
    page, h, d = 16, 2, 32
    lengths_q, lengths_k = [3, 5], [20, 33]
    q = torch.randn(sum(lengths_q), h, d)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    k_cache, v_cache = torch.randn(8, page, h, d), torch.randn(8, page, h, d)
    block_table = torch.tensor([[5, 2, 0], [1, 7, 3]], dtype=torch.int32)
    used = torch.tensor(lengths_k, dtype=torch.int32)
    out, lse, *_ = sdpa.flash_attention_forward(
        q,
        k_cache,
        v_cache,
        cu_q,
        None,
        5,
        48,
        0.0,
        True,
        False,
        seqused_k=used,
        block_table=block_table,
        num_splits=3,
    )
    keys = [k_cache[block_table[b]].reshape(-1, h, d)[:n] for b, n in enumerate(lengths_k)]
    vals = [v_cache[block_table[b]].reshape(-1, h, d)[:n] for b, n in enumerate(lengths_k)]
    cu_k = torch.tensor([0, 20, 53], dtype=torch.int32)
    exp64, _ = ref.varlen_attention_ref(
        q, torch.cat(keys), torch.cat(vals), cu_q, cu_k, max_seqlen_k=48, causal=True
    )
    exp32, _ = ref.varlen_attention_ref(
        q,
        torch.cat(keys),
        torch.cat(vals),
        cu_q,
        cu_k,
        max_seqlen_k=48,
        causal=True,
        compute_dtype=torch.float32,
    )
    ref.assert_within_criterion(out, exp64, exp32)


def test_no_dropout_inplace_writes_out():
    q, k, v, cu_q, cu_k = _varlen_inputs([5, 9], [5, 9], 2, 2, 32)
    out = torch.full_like(q, float("nan"))
    lse = sdpa.flash_attention_forward_no_dropout_inplace(
        out, q, k, v, cu_q, cu_k, 9, 9, 0.0, True, False, window_size_left=-1, window_size_right=0
    )
    expected, expected_lse, *_ = sdpa.flash_attention_forward(
        q, k, v, cu_q, cu_k, 9, 9, 0.0, True, False
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Dropout: torch's rng_state replays our mask
# ---------------------------------------------------------------------------


def test_dropout_rng_state_replays_mask():
    p, causal = 0.3, True
    q, k, v = (
        _bhsd(2, 4, 23, 32, torch.float32),
        _bhsd(2, 2, 23, 32, torch.float32),
        _bhsd(2, 2, 23, 32, torch.float32),
    )
    out, lse, _, _, _, _, rng_state, unused, _ = sdpa.scaled_dot_product_flash_attention(
        q, k, v, p, causal
    )
    seed, offset = _seed_offset(rng_state)
    keep = ref.dropout_keep_mask_batch(seed, offset, 2, 4, 23, 23, p)
    dout = torch.randn_like(out)
    out64, grads64 = _ref_grads(q, k, v, dout, causal, torch.float64, keep_mask=keep, dropout_p=p)
    out32, grads32 = _ref_grads(q, k, v, dout, causal, torch.float32, keep_mask=keep, dropout_p=p)
    ref.assert_within_criterion(out, out64, out32)
    grads = sdpa.scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, 23, 23, p, causal, rng_state, unused
    )
    for g, g64, g32 in zip(grads, grads64, grads32):
        ref.assert_within_criterion(g, g64, g32, factor=3.0, atol=1e-4)


def test_dropout_matches_our_own_op_with_the_same_seed():
    """Same torch seed: the override draws the same [seed, offset] as
    flash_attn_func, so forward and gradients agree with autograd through it."""
    p = 0.2
    q, k, v = (
        _bhsd(1, 4, 31, 64, torch.float32),
        _bhsd(1, 4, 40, 64, torch.float32),
        _bhsd(1, 4, 40, 64, torch.float32),
    )
    torch.manual_seed(1234)
    out, lse, _, _, _, _, rng_state, unused, _ = sdpa.scaled_dot_product_flash_attention(q, k, v, p)
    dout = torch.randn_like(out)
    grads = sdpa.scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, 31, 40, p, False, rng_state, unused
    )
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(1234)
    expected = flash_attn_cuda.flash_attn_func(*leaves, dropout_p=p)
    expected.backward(dout.transpose(1, 2))
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
    for g, leaf in zip(grads, leaves):
        torch.testing.assert_close(g, leaf.grad.transpose(1, 2), rtol=1e-6, atol=1e-6)
    # A different draw gives a different mask.
    other = sdpa.scaled_dot_product_flash_attention(q, k, v, p)
    assert not torch.equal(other[6], rng_state) and not torch.equal(other[0], out)


def test_backward_accepts_int64_and_split_seed_offset():
    q, k, v = (_bhsd(1, 2, 9, 32, torch.float32) for _ in range(3))
    out, lse, _, _, _, _, rng_state, unused, _ = sdpa.scaled_dot_product_flash_attention(
        q, k, v, 0.5
    )
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, None, None, 9, 9, 0.5, False)
    expected = sdpa.scaled_dot_product_flash_attention_backward(*args, rng_state, unused)
    seed, offset = rng_state.view(torch.int64)
    for state in [(rng_state.view(torch.int64), unused), (seed, offset)]:
        got = sdpa.scaled_dot_product_flash_attention_backward(*args, *state)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# torch's autograd formulas and varlen_attn on the overrides (CPU key)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_autograd_through_aten_sdpa_op(cpu_kernels, dropout_p):
    q, k, v = (_bhsd(2, 4, 21, 32, torch.float32).requires_grad_() for _ in range(3))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True)
    out, rng_state = res[0], res[6]
    dout = torch.randn_like(out)
    out.backward(dout)
    keep = None
    if dropout_p:
        seed, offset = _seed_offset(rng_state)
        keep = ref.dropout_keep_mask_batch(seed, offset, 2, 4, 21, 21, dropout_p)
    out64, grads64 = _ref_grads(
        q, k, v, dout, True, torch.float64, keep_mask=keep, dropout_p=dropout_p
    )
    out32, grads32 = _ref_grads(
        q, k, v, dout, True, torch.float32, keep_mask=keep, dropout_p=dropout_p
    )
    ref.assert_within_criterion(out.detach(), out64, out32)
    for t, g64, g32 in zip((q, k, v), grads64, grads32):
        ref.assert_within_criterion(t.grad, g64, g32, factor=3.0, atol=1e-4)


def test_compile_fullgraph_through_aten_sdpa_op(cpu_kernels):
    # Inductor checks the strides of the op's outputs against torch's meta
    # function: the overrides must return torch's layouts.
    def f(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True
        )[0]
        return out.sum(1)

    q, k, v = (torch.randn(2, 33, 4, 32, requires_grad=True) for _ in range(3))
    eager = f(q, k, v)
    eager.sum().backward()
    eager_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    compiled.sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager)
    for t, g in zip((q, k, v), eager_grads):
        torch.testing.assert_close(t.grad, g)


def _bshd_view(batch, heads, seqlen, head_dim):
    # transformers' layout: (batch, heads, seqlen, head_dim) views of (b, s, h, d).
    return torch.randn(batch, seqlen, heads, head_dim).transpose(1, 2)


@pytest.mark.parametrize(
    "layout, heads_k, seqlen_q, causal, scale",
    [
        ("bshd", 4, 5, True, None),
        ("bshd", 2, 1, False, None),  # GQA decode: unit dims in the output's strides
        ("bhsd", 4, 9, True, 0.3),  # contiguous query: the output is copied to its layout
        ("bhsd", 1, 1, False, None),
    ],
)
def test_cpp_kernel_matches_python_override(cpu_kernels, layout, heads_k, seqlen_q, causal, scale):
    # The forward's C++ kernel (csrc/ops/sdpa_flash_override.cpp) serves the call
    # and returns what the Python override returns, bit for bit, in the same layout.
    if layout == "bshd":
        q = _bshd_view(2, 4, seqlen_q, 64)
    else:
        q = torch.randn(2, 4, seqlen_q, 64)
    k, v = torch.randn(2, heads_k, 11, 64), torch.randn(2, heads_k, 11, 64)
    before = torch.ops.flash_attn._sdpa_flash_served_calls()
    got = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    assert torch.ops.flash_attn._sdpa_flash_served_calls() == before + 1
    want = sdpa.scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
            if w.dtype != torch.uint64:  # the uninitialised `unused` scalar aside
                assert torch.equal(g, w)
        else:
            assert g == w


@pytest.mark.parametrize(
    "case",
    ["head_dim_20", "dropout", "debug_mask", "strided_last_dim"],
)
def test_cpp_kernel_hands_other_calls_to_the_python_override(cpu_kernels, case):
    q, k, v = (torch.randn(2, 4, 6, 64) for _ in range(3))
    kwargs = {}
    if case == "head_dim_20":
        q, k, v = (t[..., :20].contiguous() for t in (q, k, v))
    elif case == "dropout":
        kwargs["dropout_p"] = 0.25
    elif case == "debug_mask":
        kwargs["return_debug_mask"] = True
    else:
        q = torch.randn(2, 4, 6, 128)[..., ::2]
    before = torch.ops.flash_attn._sdpa_flash_served_calls()
    if case == "debug_mask":
        with pytest.raises(UnsupportedAttentionCall, match="return_debug_mask"):
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, **kwargs)
    else:
        torch.manual_seed(0)
        got = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, **kwargs)
        torch.manual_seed(0)
        want = sdpa.scaled_dot_product_flash_attention(q, k, v, **kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.ops.flash_attn._sdpa_flash_served_calls() == before


def test_python_override_only_when_asked(monkeypatch):
    # FLASH_ATTN_CUDA_SDPA_PYTHON=1 registers the Python override for the forward
    # too (an A/B of the two, or a way around the C++ kernel).
    monkeypatch.setenv("FLASH_ATTN_CUDA_SDPA_PYTHON", "1")
    calls = spy(monkeypatch)
    handle = sdpa._install(("CPU",))
    try:
        assert handle.cpp_keys == []
        q, k, v = (torch.randn(1, 2, 3, 32) for _ in range(3))
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    finally:
        handle.remove()
    assert dict.get(calls, "_scaled_dot_product_flash_attention") == 1


@needs_varlen
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0)])
def test_varlen_attn_runs_on_the_overrides(monkeypatch, window):
    calls = spy(monkeypatch)
    # Installed once, after the spy (a second registration of the same op and
    # key raises in torch.library).
    handle = sdpa._install(("CPU",))
    try:
        kwargs, nheads_k = _varlen_kwargs(window, gqa=True)
        q, k, v, cu_q, cu_k = _varlen_inputs([7, 1, 26, 12], [7, 1, 26, 12], 4, nheads_k, 32)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = varlen_attn(*leaves, cu_q, cu_k, 26, 26, **kwargs)
        dout = torch.randn_like(out)
        out.backward(dout)
    finally:
        handle.remove()
    assert calls.get("_flash_attention_forward") and calls.get("_flash_attention_backward")
    causal = window == (-1, 0)
    kwargs = dict(causal=causal, window_size=window)
    l64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exp64 = ref.varlen_attention_ref(*l64, cu_q, cu_k, **kwargs)[0]
    exp64.backward(dout.double())
    l32 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    exp32 = ref.varlen_attention_ref(*l32, cu_q, cu_k, compute_dtype=torch.float32, **kwargs)[0]
    exp32.backward(dout)
    ref.assert_within_criterion(out.detach(), exp64, exp32)
    for t, a, b in zip(leaves, l64, l32):
        ref.assert_within_criterion(t.grad, a.grad, b.grad, factor=3.0, atol=1e-4)


# ---------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------


def test_errors_name_the_argument():
    q, k, v = (_bhsd(1, 2, 8, 32, torch.float32) for _ in range(3))
    with pytest.raises(UnsupportedAttentionCall, match="return_debug_mask"):
        sdpa.scaled_dot_product_flash_attention(q, k, v, 0.0, False, True)
    with pytest.raises(UnsupportedAttentionCall, match="dropout_p"):
        sdpa.scaled_dot_product_flash_attention(q, k, v, 1.0)
    with pytest.raises(UnsupportedAttentionCall, match="head dim"):
        sdpa.scaled_dot_product_flash_attention(q, k, v[..., :16])
    big = _bhsd(1, 2, 8, 264, torch.float32)
    with pytest.raises(UnsupportedAttentionCall, match="at most 256"):
        sdpa.scaled_dot_product_flash_attention(big, big, big)
    with pytest.raises(UnsupportedAttentionCall, match="future_arg"):
        sdpa.scaled_dot_product_flash_attention(q, k, v, future_arg=3)
    # An unknown keyword argument left at None is harmless.
    sdpa.scaled_dot_product_flash_attention(q, k, v, future_arg=None)
    with pytest.raises(UnsupportedAttentionCall, match="4-D"):
        sdpa.scaled_dot_product_flash_attention(q[0], k[0], v[0])
    out, lse, *_ = sdpa.scaled_dot_product_flash_attention(q, k, v)
    with pytest.raises(UnsupportedAttentionCall, match="rng_state"):
        sdpa.scaled_dot_product_flash_attention_backward(
            out, q, k, v, out, lse, None, None, 8, 8, 0.5, False, None, None
        )
    with pytest.raises(UnsupportedAttentionCall, match="rng_state"):
        sdpa.scaled_dot_product_flash_attention_backward(
            out, q, k, v, out, lse, None, None, 8, 8, 0.5, False, torch.zeros(3), torch.zeros(())
        )

    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(UnsupportedAttentionCall, match="block_table"):
        sdpa.flash_attention_forward(
            qs,
            ks,
            vs,
            None,
            None,
            8,
            8,
            0.0,
            False,
            False,
            block_table=torch.zeros(1, 1, dtype=torch.int32),
        )
    slopes = torch.rand(2)
    grad_q = qs.detach().requires_grad_()
    with pytest.raises(UnsupportedAttentionCall, match="alibi_slopes"):
        sdpa.flash_attention_forward(
            grad_q, ks, vs, None, None, 8, 8, 0.0, False, False, alibi_slopes=slopes
        )
    # Without gradients ALiBi is served.
    with torch.no_grad():
        got = sdpa.flash_attention_forward(
            grad_q, ks, vs, None, None, 8, 8, 0.0, False, False, alibi_slopes=slopes
        )[0]
    exp64, _ = ref.attention_ref(qs, ks, vs, alibi_slopes=slopes)
    exp32, _ = ref.attention_ref(qs, ks, vs, alibi_slopes=slopes, compute_dtype=torch.float32)
    ref.assert_within_criterion(got, exp64, exp32)


def test_op_checks_reach_the_caller():
    # What the flash_attn ops refuse (here: a head count that is not a multiple
    # of the key heads) comes back with the op's message.
    q, k = _bhsd(1, 3, 8, 32, torch.float32), _bhsd(1, 2, 8, 32, torch.float32)
    with pytest.raises(RuntimeError, match="number of heads"):
        sdpa.scaled_dot_product_flash_attention(q, k, k)


# ---------------------------------------------------------------------------
# CUDA: the provider behind F.scaled_dot_product_attention
# ---------------------------------------------------------------------------

CUDA_CASES = [
    # batch, nheads, nheads_k, seqlen, head_dim, causal
    (2, 4, 4, 128, 64, False),
    (1, 8, 8, 257, 128, True),
    (2, 8, 2, 113, 64, True),  # GQA
    (1, 4, 1, 65, 96, False),  # MQA
]


def _sdpa_flash(q, k, v, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _fwd_bwd(q, k, v, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = _sdpa_flash(*leaves, **kwargs)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.cuda
@needs_registry
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CUDA_CASES)
def test_cuda_sdpa_matches_builtin_flash(case, dtype, monkeypatch):
    batch, h, hk, s, d, causal = case
    q = _bhsd(batch, h, s, d, dtype, "cuda")
    k, v = _bhsd(batch, hk, s, d, dtype, "cuda"), _bhsd(batch, hk, s, d, dtype, "cuda")
    dout = torch.randn_like(q)
    kwargs = dict(is_causal=causal, enable_gqa=hk != h)
    builtin_out, builtin_grads = _fwd_bwd(q, k, v, dout, **kwargs)
    calls = spy(monkeypatch)
    torch.nn.attention.activate_flash_attention_impl(NAME)
    try:
        out, grads = _fwd_bwd(q, k, v, dout, **kwargs)
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert calls.get("_scaled_dot_product_flash_attention") == 1
    assert calls.get("_scaled_dot_product_flash_attention_backward") == 1
    exp, exp_grads = _ref_grads(q, k, v, dout, causal, torch.float32)
    ref.assert_within_criterion(out, exp, builtin_out)
    for g, e, b in zip(grads, exp_grads, builtin_grads):
        ref.assert_within_criterion(g, e, b, factor=3.0, atol=1e-4)
    # Restored: the built-in kernel serves the op again, untouched by the spy.
    again = _sdpa_flash(q, k, v, **kwargs)
    assert calls["_scaled_dot_product_flash_attention"] == 1
    torch.testing.assert_close(again, builtin_out, rtol=0, atol=0)


@pytest.mark.cuda
@needs_registry
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_sdpa_dropout_matches_our_op(provider, dtype):
    p = 0.17
    q, k, v = (_bhsd(2, 4, 96, 64, dtype, "cuda") for _ in range(3))
    dout = torch.randn_like(q)
    torch.manual_seed(7)
    out, grads = _fwd_bwd(q, k, v, dout, dropout_p=p, is_causal=True)
    leaves = [t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    expected = flash_attn_cuda.flash_attn_func(*leaves, dropout_p=p, causal=True)
    expected.backward(dout.transpose(1, 2))
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
    for g, leaf in zip(grads, leaves):
        torch.testing.assert_close(g, leaf.grad.transpose(1, 2), rtol=2e-2, atol=2e-3)
    # About a fraction p of the probabilities is dropped: with v = ones the
    # output of a row is (kept probability mass) / (1 - p), mean 1.
    ones = torch.ones_like(v)
    mean = _sdpa_flash(q, k, ones, dropout_p=p).float().mean().item()
    assert abs(mean - 1.0) < 0.05


@pytest.mark.cuda
@needs_registry
def test_cuda_compile_fullgraph_matches_eager(provider, monkeypatch):
    calls = spy(monkeypatch)
    torch.nn.attention.activate_flash_attention_impl(NAME)  # reinstall the spied functions

    class Attention(torch.nn.Module):
        def __init__(self, dim=256, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(o.transpose(1, 2).reshape(b, s, -1))

    torch._dynamo.reset()
    model = Attention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
    # The provider replaces SDPA's FLASH backend; which backend SDPA picks by
    # default is torch's choice (it may be cuDNN), so the test selects FLASH.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        eager = model(x)
        eager.float().pow(2).sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        n_eager = calls.get("_scaled_dot_product_flash_attention", 0)
        assert n_eager == 1
        compiled = torch.compile(model, fullgraph=True)
        out = compiled(x)
        out.float().pow(2).sum().backward()
    assert calls["_scaled_dot_product_flash_attention"] > n_eager
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=5e-2, atol=5e-2)
    torch._dynamo.reset()


@pytest.mark.cuda
@needs_registry
@needs_varlen
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)])
def test_cuda_varlen_attn_matches_builtin(window, dtype, monkeypatch):
    # max_q <= 128 keeps varlen_attn on the FLASH ops (above it torch may pick cuDNN).
    lengths = [7, 1, 100, 33]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    total = sum(lengths)
    kwargs, nheads_k = _varlen_kwargs(window, gqa=True, nheads=8)
    q = torch.randn(total, 8, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, nheads_k, 64, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attn(*leaves, cu, cu, 100, 100, **kwargs)
        out.backward(dout)
        return out.detach(), [t.grad for t in leaves]

    builtin_out, builtin_grads = run()
    calls = spy(monkeypatch)
    torch.nn.attention.activate_flash_attention_impl(NAME)
    try:
        out, grads = run()
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert (
        calls.get("_flash_attention_forward") == 1 and calls.get("_flash_attention_backward") == 1
    )
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    exp = ref.varlen_attention_ref(
        *leaves,
        cu.cpu(),
        cu.cpu(),
        causal=window == (-1, 0),
        window_size=window,
        compute_dtype=torch.float32,
    )[0]
    exp.backward(dout.float())
    ref.assert_within_criterion(out, exp, builtin_out)
    for g, leaf, b in zip(grads, leaves, builtin_grads):
        ref.assert_within_criterion(g, leaf.grad, b, factor=3.0, atol=1e-4)
