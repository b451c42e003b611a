"""A few small backward calls for compute-sanitizer (not a pytest module).

    compute-sanitizer --tool memcheck  python scripts/sanitize_bwd.py
    compute-sanitizer --tool racecheck python scripts/sanitize_bwd.py

Shapes are small and odd so that every partial tile, the padded head dim, a
value head dim below the query / key one (on the Hopper kernel dO, O and V read
and dV written at d_v columns), GQA, varlen, softcap, ALiBi, dropout and the
deterministic path run at least once; the calls without dropout run the Hopper backward kernel on an
sm90 GPU unless FLASH_ATTN_BWD_KERNEL=sm80.
"""

import torch
from sanitize_calls import skips_left_out, summary

import flash_attn_cuda  # noqa: F401  (registers the ops)


@skips_left_out
def fixed(
    batch,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    head_dim,
    dtype,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi=False,
    dropout_p=0.0,
    deterministic=False,
    head_dim_v=None,
):
    d_v = head_dim_v or head_dim
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, d_v, device="cuda", dtype=dtype)
    dout = torch.randn(batch, seqlen_q, nheads, d_v, device="cuda", dtype=dtype)
    slopes = torch.rand(nheads, device="cuda") * 0.3 if alibi else None
    scale = head_dim**-0.5
    out, lse, _, rng = torch.ops.flash_attn.fwd(
        q, k, v, slopes, dropout_p, scale, causal, window[0], window[1], softcap, False, 3, 1, None
    )
    return torch.ops.flash_attn.bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        slopes,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        deterministic,
        rng,
    )


@skips_left_out
def varlen(
    lengths_q,
    lengths_k,
    nheads,
    nheads_k,
    head_dim,
    dtype,
    *,
    causal=False,
    softcap=0.0,
    alibi=False,
    deterministic=False,
    head_dim_v=None,
):
    d_v = head_dim_v or head_dim
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0).int().cuda()
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0).int().cuda()
    q = torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(sum(lengths_k), nheads_k, d_v, device="cuda", dtype=dtype)
    dout = torch.randn(sum(lengths_q), nheads, d_v, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    mq, mk = max(lengths_q), max(lengths_k)
    slopes = torch.rand(len(lengths_q), nheads, device="cuda") * 0.3 if alibi else None
    out, lse, _, rng = torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        None,
        slopes,
        mq,
        mk,
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
    return torch.ops.flash_attn.varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        slopes,
        mq,
        mk,
        0.0,
        scale,
        causal,
        -1,
        -1,
        softcap,
        deterministic,
        rng,
    )


@skips_left_out
def after_cpu_forward(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, *, dropout_p):
    """The CUDA backward after the CPU forward: dropout above head dim 256,
    which the CUDA forward does not serve and the backward does."""
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out, lse, _, rng = torch.ops.flash_attn.fwd(
        q, k, v, None, dropout_p, scale, True, -1, -1, 0.0, False, 3, 1, None
    )
    tensors = [t.cuda() for t in (dout, q, k, v, out, lse)]
    return torch.ops.flash_attn.bwd(
        *tensors, None, dropout_p, scale, True, -1, -1, 0.0, False, rng.cuda()
    )


def main():
    torch.manual_seed(0)
    bf16, fp16 = torch.bfloat16, torch.float16
    fixed(1, 1, 1, 1, 1, 32, bf16)
    fixed(2, 17, 129, 2, 1, 40, fp16, causal=True)
    fixed(1, 130, 70, 4, 2, 64, bf16, softcap=5.0, alibi=True)
    fixed(1, 129, 131, 2, 2, 128, fp16, window=(20, 5), dropout_p=0.2)
    fixed(1, 65, 200, 2, 1, 128, bf16, causal=True, deterministic=True)
    fixed(1, 70, 65, 2, 2, 256, bf16, causal=True)
    fixed(1, 70, 130, 2, 1, 224, bf16, causal=True)
    fixed(1, 200, 260, 2, 2, 128, bf16)
    fixed(1, 129, 131, 2, 2, 64, fp16, window=(20, 5))
    fixed(1, 33, 97, 2, 2, 200, fp16, dropout_p=0.1, deterministic=True)
    varlen([5, 0, 70], [9, 130, 1], 4, 2, 96, bf16, causal=True)
    varlen([50, 77, 130], [100, 77, 200], 2, 2, 128, fp16)
    # Deterministic: a thread block walks several key blocks, most of them
    # seen by no query (the window), with dK / dV staged in shared memory.
    fixed(4, 16, 1500, 16, 16, 64, bf16, window=(600, 0), deterministic=True)
    varlen([40, 3], [77, 150], 2, 2, 160, fp16, deterministic=True)
    # Ordered dQ (deterministic, no left window bound): the dQ writer's turns,
    # non-causal over several key blocks, and causal varlen with an empty
    # sequence and rows that see no key.
    fixed(1, 300, 390, 2, 1, 64, bf16, deterministic=True)
    varlen([130, 0, 65], [70, 9, 200], 2, 2, 128, bf16, causal=True, deterministic=True)
    # Softcap and ALiBi: the Hopper kernel's other variant on sm90.
    fixed(2, 300, 421, 4, 2, 64, bf16, causal=True, softcap=10.0, alibi=True)
    fixed(1, 200, 260, 2, 1, 128, fp16, window=(70, 20), alibi=True, deterministic=True)
    fixed(1, 130, 200, 2, 2, 256, bf16, softcap=10.0)
    varlen([50, 7, 130], [100, 77, 201], 4, 2, 96, bf16, causal=True, softcap=5.0, alibi=True)
    # Dropout at d64: the Hopper backward's 64-row tile of its own
    # (plan.h bwd_sm90_dropout_block_m), GQA, and with dQ splits.
    fixed(2, 300, 421, 4, 2, 64, bf16, causal=True, dropout_p=0.2)
    fixed(1, 200, 260, 2, 1, 64, fp16, dropout_p=0.1, deterministic=True)
    # d_v < d_qk: MHA (dV through shared memory), GQA (the kv heads' fp32 sums)
    # and GQA deterministic (the per-head shares' reduction), and dropout (SM80).
    fixed(1, 130, 200, 2, 2, 192, bf16, causal=True, head_dim_v=128)
    fixed(2, 70, 130, 4, 2, 128, fp16, head_dim_v=64)
    fixed(1, 65, 200, 4, 1, 256, bf16, causal=True, deterministic=True, head_dim_v=128)
    fixed(1, 33, 97, 2, 2, 96, fp16, dropout_p=0.1, head_dim_v=64)
    varlen([5, 0, 70], [9, 130, 1], 4, 2, 192, bf16, causal=True, head_dim_v=128)
    # Head dims 257-512: the SM80 kernel in two head-dim slabs; GQA (the kv
    # heads' sums by slab, deterministic: turns by key block and slab), the
    # score extras on a partial second slab with d_v below it, varlen with an
    # empty sequence, dropout after the CPU forward.
    fixed(1, 70, 65, 2, 2, 512, bf16, causal=True)
    fixed(1, 33, 97, 4, 2, 512, fp16)
    fixed(1, 33, 97, 4, 2, 512, bf16, causal=True, deterministic=True)
    fixed(2, 40, 77, 4, 1, 320, bf16, softcap=5.0, alibi=True, head_dim_v=128)
    varlen([5, 0, 70], [9, 40, 1], 4, 2, 512, bf16, causal=True)
    after_cpu_forward(1, 45, 70, 2, 1, 512, bf16, dropout_p=0.2)
    torch.cuda.synchronize()
    print(summary("sanitize_bwd"))


if __name__ == "__main__":
    main()
