"""torch.library.opcheck for every op of the flash_attn library.

opcheck runs each op with real inputs and checks that the schema describes
what the kernel does (test_schema: no undeclared mutation or aliasing), that
the fake kernel of flash_attn_cuda/ops.py agrees with the real one on shapes,
dtypes, strides and devices (test_faketensor), that the op traces under
AOTAutograd with dynamic shapes (test_aot_dispatch_dynamic), and how autograd
sees it (test_autograd_registration).

No input here requires grad: the ops have no autograd formula of their own.
Gradients come from the autograd.Functions of flash_attn_cuda/interface.py,
whose backward calls the backward ops, as in flash-attn; the backward ops are
checked here as ops in their own right. (With inputs requiring grad,
test_autograd_registration would report exactly that design.)
"""

import math

import pytest
import torch

import flash_attn_cuda  # noqa: F401  (registers the ops and their fake kernels)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ALL_TEST_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)

ops = torch.ops.flash_attn


def opcheck(op, args, test_utils=ALL_TEST_UTILS, kwargs=None):
    torch.library.opcheck(op, args, kwargs, test_utils=test_utils)


def rand(*shape, device, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype, device=device)


def fwd_args(
    device,
    *,
    alibi=False,
    dropout_p=0.0,
    rng_state=None,
    return_softmax=False,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    packed=False,
):
    batch, nheads = 2, 4
    if packed:
        # Strided views of one packed tensor: the outputs are still contiguous.
        q, k, v = rand(batch, 17, 3, nheads, 32, device=device).unbind(2)
    else:
        q = rand(batch, 17, nheads, 32, device=device)
        k = rand(batch, 23, 2, 32, device=device)
        v = rand(batch, 23, 2, 32, device=device)
    slopes = torch.rand(batch, nheads, device=device) if alibi else None
    return (
        q,
        k,
        v,
        slopes,
        dropout_p,
        32**-0.5,
        causal,
        window[0],
        window[1],
        softcap,
        return_softmax,
        1234,
        7,
        rng_state,
    )


FWD_CASES = {
    "plain": {},
    "causal_alibi_softcap": {"causal": True, "alibi": True, "softcap": 4.0},
    "local_window": {"window": (4, 3)},
    "strided_views_of_packed_qkv": {"packed": True, "causal": True},
    "dropout_seed_values_probs": {"dropout_p": 0.2, "return_softmax": True},
    "dropout_rng_state_tensor": {"dropout_p": 0.2, "rng_state": "tensor"},
}


def _resolve(case, device):
    case = dict(case)
    if case.get("rng_state") == "tensor":
        case["rng_state"] = torch.tensor([99, 3], dtype=torch.int64, device=device)
    return case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(FWD_CASES))
def test_fwd(device, case):
    opcheck(ops.fwd.default, fwd_args(device, **_resolve(FWD_CASES[case], device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    ["plain", "causal_alibi_softcap", "dropout_rng_state_tensor", "strided_views_of_packed_qkv"],
)
def test_bwd(device, case):
    args = fwd_args(device, **_resolve(FWD_CASES[case], device))
    q, k, v, slopes, dropout_p, scale, causal, left, right, softcap = args[:10]
    out, softmax_lse, _, rng_state = ops.fwd(*args)
    dout = torch.randn_like(out)
    opcheck(
        ops.bwd.default,
        (
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            slopes,
            dropout_p,
            scale,
            causal,
            left,
            right,
            softcap,
            False,
            rng_state if dropout_p > 0 else None,
        ),
    )


def varlen_inputs(device, paged=False):
    lengths_q, lengths_k = [5, 1, 19], [9, 14, 19]
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = rand(sum(lengths_q), 4, 32, device=device)
    if paged:
        page_size = 8
        blocks_per_seq = math.ceil(max(lengths_k) / page_size)
        num_blocks = 3 * blocks_per_seq + 2
        k = rand(num_blocks, page_size, 2, 32, device=device)
        v = rand(num_blocks, page_size, 2, 32, device=device)
        block_table = torch.randperm(num_blocks)[: 3 * blocks_per_seq].reshape(3, -1)
        block_table = block_table.to(torch.int32).to(device)
    else:
        k = rand(sum(lengths_k), 2, 32, device=device)
        v = rand(sum(lengths_k), 2, 32, device=device)
        block_table = None
    return q, k, v, cu_q.to(device), cu_k.to(device), block_table, max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "paged", "alibi_causal", "dropout_probs"])
def test_varlen_fwd(device, case):
    q, k, v, cu_q, cu_k, block_table, max_q, max_k = varlen_inputs(device, paged=case == "paged")
    slopes = torch.rand(4, device=device) if case == "alibi_causal" else None
    dropout_p = 0.3 if case == "dropout_probs" else 0.0
    opcheck(
        ops.varlen_fwd.default,
        (
            q,
            k,
            v,
            cu_q,
            cu_k,
            block_table,
            slopes,
            max_q,
            max_k,
            dropout_p,
            32**-0.5,
            case == "alibi_causal",
            -1,
            -1,
            0.0,
            case == "dropout_probs",
            5,
            0,
            None,
        ),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_varlen_fwd_num_splits(device, paged):
    """FA3's num_splits: on CUDA the split-KV run of the varlen forward."""
    q, k, v, cu_q, cu_k, block_table, max_q, max_k = varlen_inputs(device, paged=paged)
    args = (q, k, v, cu_q, cu_k, block_table, None, max_q, max_k, 0.0, 32**-0.5, True, -1, -1)
    args += (0.0, False, 0, 0, None)
    opcheck(ops.varlen_fwd.default, args, kwargs={"num_splits": 3})
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    opcheck(ops.varlen_fwd_out.default, args, kwargs={"num_splits": 3, "out": out})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "alibi_causal_dropout"])
def test_varlen_bwd(device, case):
    q, k, v, cu_q, cu_k, _, max_q, max_k = varlen_inputs(device)
    slopes = torch.rand(3, 4, device=device) if case != "plain" else None
    dropout_p = 0.1 if case != "plain" else 0.0
    causal = case != "plain"
    out, softmax_lse, _, rng_state = ops.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        None,
        slopes,
        max_q,
        max_k,
        dropout_p,
        0.2,
        causal,
        -1,
        -1,
        0.0,
        False,
        11,
        0,
        None,
    )
    opcheck(
        ops.varlen_bwd.default,
        (
            torch.randn_like(out),
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_q,
            cu_k,
            slopes,
            max_q,
            max_k,
            dropout_p,
            0.2,
            causal,
            -1,
            -1,
            0.0,
            True,
            rng_state if dropout_p > 0 else None,
        ),
    )


def kvcache_args(device, *, append=False, rotary=False, paged=False, optional_indices=False):
    batch, seqlen_q, nheads, nheads_k, head_dim = 2, 3, 4, 2, 32
    # Pages of 8 rows on the CPU, 5 on CUDA (any size runs on both).
    seqlen_cache, page_size = (16, 8) if device == "cpu" else (30, 5)
    q = rand(batch, seqlen_q, nheads, head_dim, device=device)
    if paged:
        num_blocks = batch * seqlen_cache // page_size + 1
        k_cache = rand(num_blocks, page_size, nheads_k, head_dim, device=device)
        v_cache = rand(num_blocks, page_size, nheads_k, head_dim, device=device)
        block_table = torch.randperm(num_blocks)[: num_blocks - 1].reshape(batch, -1)
        block_table = block_table.to(torch.int32).to(device)
    else:
        k_cache = rand(batch + 1, seqlen_cache, nheads_k, head_dim, device=device)
        v_cache = rand(batch + 1, seqlen_cache, nheads_k, head_dim, device=device)
        block_table = None
    k = rand(batch, 2, nheads_k, head_dim, device=device) if append else None
    v = rand(batch, 2, nheads_k, head_dim, device=device) if append else None
    cache_seqlens = torch.tensor([4, 9], dtype=torch.int32, device=device)
    rotary_cos = rotary_sin = None
    if rotary:
        angles = torch.rand(seqlen_cache, 8, device=device)
        rotary_cos, rotary_sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cache_batch_idx = cache_leftpad = alibi_slopes = None
    if optional_indices:
        cache_batch_idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
        cache_leftpad = torch.tensor([1, 0], dtype=torch.int32, device=device)
        alibi_slopes = torch.rand(nheads, device=device)
    return (
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        rotary_cos,
        rotary_sin,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        alibi_slopes,
        head_dim**-0.5,
        True,
        -1,
        -1,
        0.0,
        True,
        0,
    )


KVCACHE_CASES = {
    "read_only": {},
    "indices_leftpad_alibi": {"optional_indices": True},
    "append": {"append": True},
    "append_rotary_paged": {"append": True, "rotary": True, "paged": True},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(KVCACHE_CASES))
def test_fwd_kvcache(device, case):
    # With k / v given the op writes k_cache / v_cache in place, which its schema
    # declares ((a!) / (b!)); test_schema verifies nothing else is mutated.
    # Appending is idempotent (the same rows get the same values), so opcheck's
    # repeated calls on the same inputs see the same results.
    opcheck(ops.fwd_kvcache.default, kvcache_args(device, **KVCACHE_CASES[case]))


# seqused_k (keyword-only, default None): sequence b uses its first seqused_k[b] keys.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "paged"])
def test_varlen_fwd_seqused_k(device, case):
    q, k, v, cu_q, cu_k, block_table, max_q, max_k = varlen_inputs(device, paged=case == "paged")
    used = torch.tensor([4, 0, 19], dtype=torch.int32, device=device)
    opcheck(
        ops.varlen_fwd.default,
        (
            q,
            k,
            v,
            cu_q,
            cu_k,
            block_table,
            None,
            max_q,
            max_k,
            0.0,
            32**-0.5,
            True,
            -1,
            -1,
            0.0,
            False,
            5,
            0,
            None,
        ),
        kwargs={"seqused_k": used},
    )


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_bwd_seqused_k(device):
    q, k, v, cu_q, cu_k, _, max_q, max_k = varlen_inputs(device)
    used = torch.tensor([9, 3, 0], dtype=torch.int32, device=device)
    out, softmax_lse, _, _ = ops.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        None,
        None,
        max_q,
        max_k,
        0.0,
        0.2,
        True,
        -1,
        -1,
        0.0,
        False,
        0,
        0,
        None,
        seqused_k=used,
    )
    opcheck(
        ops.varlen_bwd.default,
        (
            torch.randn_like(out),
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_q,
            cu_k,
            None,
            max_q,
            max_k,
            0.0,
            0.2,
            True,
            -1,
            -1,
            0.0,
            True,
            None,
        ),
        kwargs={"seqused_k": used},
    )


# seqused_q (keyword-only, last, default None): sequence b uses its first
# seqused_q[b] query rows; with seqused_k too, and on the *_out op.
def _varlen_args(q, k, v, cu_q, cu_k, block_table, max_q, max_k):
    return (q, k, v, cu_q, cu_k, block_table, None, max_q, max_k, 0.0, 32**-0.5, True, -1, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "seqused_k", "paged", "out"])
def test_varlen_fwd_seqused_q(device, case):
    q, k, v, cu_q, cu_k, block_table, max_q, max_k = varlen_inputs(device, paged=case == "paged")
    kwargs = {"seqused_q": torch.tensor([3, 0, 19], dtype=torch.int32, device=device)}
    if case in ("seqused_k", "paged"):
        kwargs["seqused_k"] = torch.tensor([4, 1, 11], dtype=torch.int32, device=device)
    args = _varlen_args(q, k, v, cu_q, cu_k, block_table, max_q, max_k) + (0.0, False, 5, 0, None)
    if case == "out":
        kwargs["out"] = torch.zeros_like(q)
        opcheck(ops.varlen_fwd_out.default, args, kwargs=kwargs)
    else:
        opcheck(ops.varlen_fwd.default, args, kwargs=kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_bwd_seqused_q(device):
    q, k, v, cu_q, cu_k, _, max_q, max_k = varlen_inputs(device)
    used_q = torch.tensor([2, 1, 0], dtype=torch.int32, device=device)
    used_k = torch.tensor([9, 3, 0], dtype=torch.int32, device=device)
    args = _varlen_args(q, k, v, cu_q, cu_k, None, max_q, max_k)
    out, softmax_lse, _, _ = ops.varlen_fwd(
        *args, 0.0, False, 0, 0, None, seqused_k=used_k, seqused_q=used_q
    )
    opcheck(
        ops.varlen_bwd.default,
        (torch.randn_like(out), q, k, v, out, softmax_lse, cu_q, cu_k, None, max_q, max_k, 0.0)
        + (32**-0.5, True, -1, -1, 0.0, True, None),
        kwargs={
            "seqused_k": used_k,
            "softmax_d": torch.empty_like(softmax_lse),
            "seqused_q": used_q,
        },
    )


# The *_out ops write the caller's `out` ((a!) / (c!)) and return the other results.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "dropout_seed_values_probs"])
def test_fwd_out(device, case):
    args = fwd_args(device, **_resolve(FWD_CASES[case], device))
    opcheck(ops.fwd_out.default, args, kwargs={"out": torch.empty_like(args[0])})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "paged_seqused_k"])
def test_varlen_fwd_out(device, case):
    q, k, v, cu_q, cu_k, block_table, max_q, max_k = varlen_inputs(device, paged=case != "plain")
    kwargs = {"out": torch.empty_like(q)}
    if case != "plain":
        kwargs["seqused_k"] = torch.tensor([1, 14, 7], dtype=torch.int32, device=device)
    opcheck(
        ops.varlen_fwd_out.default,
        (
            q,
            k,
            v,
            cu_q,
            cu_k,
            block_table,
            None,
            max_q,
            max_k,
            0.0,
            32**-0.5,
            True,
            -1,
            -1,
            0.0,
            False,
            5,
            0,
            None,
        ),
        kwargs=kwargs,
    )


def kvcache_fa3_shapes_args(device):
    """A paged cache with cache_leftpad and cache_batch_idx, and rotary_seqlens (kwargs)."""
    args = list(kvcache_args(device, append=True, rotary=True, paged=True))
    args[8] = torch.tensor([1, 0], dtype=torch.int32, device=device)  # cache_batch_idx
    args[9] = torch.tensor([1, 3], dtype=torch.int32, device=device)  # cache_leftpad
    rotary_seqlens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    return tuple(args), {"rotary_seqlens": rotary_seqlens}


@pytest.mark.parametrize("device", DEVICES)
def test_fwd_kvcache_fa3_shapes(device):
    args, kwargs = kvcache_fa3_shapes_args(device)
    opcheck(ops.fwd_kvcache.default, args, kwargs=kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_fwd_kvcache_out_fa3_shapes(device):
    args, kwargs = kvcache_fa3_shapes_args(device)
    opcheck(ops.fwd_kvcache_out.default, args, kwargs={**kwargs, "out": torch.empty_like(args[0])})


def kvcache_varlen_args(device, varlen_new=True):
    """FA3's varlen form over the paged cache of kvcache_fa3_shapes_args: q
    (total_q, ...) with an empty sequence, varlen new keys (kwargs)."""
    args, kwargs = kvcache_fa3_shapes_args(device)
    args = list(args)
    args[0] = rand(5, 4, 32, device=device)  # sequences of 0 and 5 query rows
    kwargs["cu_seqlens_q"] = torch.tensor([0, 0, 5], dtype=torch.int32, device=device)
    kwargs["max_seqlen_q"] = 5
    if varlen_new:
        args[3] = rand(3, 2, 32, device=device)  # 1 and 2 new keys
        args[4] = rand(3, 2, 32, device=device)
        kwargs["cu_seqlens_k_new"] = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    return tuple(args), kwargs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen_new", [False, True], ids=["fixed_new", "varlen_new"])
def test_fwd_kvcache_varlen(device, varlen_new):
    args, kwargs = kvcache_varlen_args(device, varlen_new)
    opcheck(ops.fwd_kvcache.default, args, kwargs=kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_fwd_kvcache_out_varlen(device):
    args, kwargs = kvcache_varlen_args(device)
    opcheck(ops.fwd_kvcache_out.default, args, kwargs={**kwargs, "out": torch.empty_like(args[0])})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["read_only", "append_rotary_paged"])
def test_fwd_kvcache_out(device, case):
    args = kvcache_args(device, **KVCACHE_CASES[case])
    opcheck(ops.fwd_kvcache_out.default, args, kwargs={"out": torch.empty_like(args[0])})
