"""torch.compile(fullgraph=True) through the public API.

fullgraph=True turns any graph break into an error, so a passing test means the
autograd.Functions, the ops and their fake kernels trace into one graph. Most
tests use the aot_eager backend (AOTAutograd traces forward and backward with
the fake kernels, then runs the real ops), which checks the same tracing at a
fraction of inductor's compile time; one test goes through inductor.
"""

import pytest
import torch
import torch.nn as nn

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TwoPathAttention(nn.Module):
    """Self-attention computed twice: once batched, once as varlen sequences."""

    def __init__(self, nheads, head_dim, lengths, dropout_p=0.0, project=True):
        super().__init__()
        self.nheads, self.head_dim, self.dropout_p = nheads, head_dim, dropout_p
        width = nheads * head_dim
        # Without projections (inputs are then already 3 * width wide) the graph
        # holds little besides the attention ops, which keeps inductor's compile
        # time (C++ codegen on CPU) short.
        self.qkv = nn.Linear(width, 3 * width) if project else nn.Identity()
        self.out = nn.Linear(width, width) if project else nn.Identity()
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        self.register_buffer("cu_seqlens", cu, persistent=False)
        self.max_seqlen = max(lengths)  # a Python int, as callers pass it

    def forward(self, x, tokens):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seqlen, 3, self.nheads, self.head_dim).unbind(2)
        dense = flash_attn_func(q, k, v, dropout_p=self.dropout_p, causal=True)
        tq, tk, tv = self.qkv(tokens).view(-1, 3, self.nheads, self.head_dim).unbind(1)
        varlen = flash_attn_varlen_func(
            tq,
            tk,
            tv,
            self.cu_seqlens,
            self.cu_seqlens,
            self.max_seqlen,
            self.max_seqlen,
            dropout_p=self.dropout_p,
            window_size=(5, 5),
        )
        return self.out(dense.flatten(2)), self.out(varlen.flatten(1))


def make_model_and_inputs(device, dropout_p=0.0, project=True):
    lengths = [7, 1, 12]
    model = TwoPathAttention(2, 32, lengths, dropout_p, project)
    model = model.to(device=device, dtype=torch.bfloat16)
    width = 64 if project else 3 * 64
    x = torch.randn(2, 16, width, dtype=torch.bfloat16, device=device, requires_grad=True)
    tokens = torch.randn(
        sum(lengths), width, dtype=torch.bfloat16, device=device, requires_grad=True
    )
    return model, x, tokens


def forward_backward(fn, model, x, tokens):
    model.zero_grad(set_to_none=True)
    x.grad = tokens.grad = None
    dense, varlen = fn(x, tokens)
    (dense.float().square().mean() + varlen.float().square().mean()).backward()
    grads = [x.grad, tokens.grad] + [p.grad for p in model.parameters()]
    return [dense.detach(), varlen.detach()], [g.clone() for g in grads]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_module_compiles_and_matches_eager(device, backend):
    model, x, tokens = make_model_and_inputs(device, project=backend != "inductor")
    eager_outs, eager_grads = forward_backward(model, model, x, tokens)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    outs, grads = forward_backward(compiled, model, x, tokens)
    for ours, ref in zip(outs + grads, eager_outs + eager_grads):
        # The projections may fuse or reorder differently under inductor; the
        # attention ops run the same kernels either way.
        torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_shapes(device):
    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True, dynamic=True)
    for seqlen_q, seqlen_k in [(9, 13), (21, 5)]:
        q = torch.randn(2, seqlen_q, 4, 32, dtype=torch.float16, device=device, requires_grad=True)
        k = torch.randn(2, seqlen_k, 2, 32, dtype=torch.float16, device=device, requires_grad=True)
        v = torch.randn(2, seqlen_k, 2, 32, dtype=torch.float16, device=device, requires_grad=True)
        out = compiled(q, k, v)
        torch.testing.assert_close(out, attention(q, k, v), atol=0, rtol=0)
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("device", DEVICES)
def test_one_tensor_in_several_slots(device):
    # flash_attn_func(x, x, x): dynamo cannot trace an autograd.Function that
    # receives one tensor twice, so the API hands it distinct views.
    def self_attention(x):
        return flash_attn_func(x, x, x, causal=True)

    x = torch.randn(2, 11, 2, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    compiled = torch.compile(self_attention, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (eager_grad,) = torch.autograd.grad(self_attention(x).sum(), x)
    torch.testing.assert_close(out, self_attention(x), atol=0, rtol=0)
    torch.testing.assert_close(grad, eager_grad, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_compiles(device):
    # Dropout draws its seed with torch.randint inside the traced function; the
    # compiled graph must not break on it and must draw a fresh mask per call.
    model, x, tokens = make_model_and_inputs(device, dropout_p=0.3)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    (first, _), grads = forward_backward(compiled, model, x, tokens)
    (second, _), _ = forward_backward(compiled, model, x, tokens)
    assert all(torch.isfinite(g).all() for g in grads)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_compiles(device):
    def decode_step(q, k_cache, v_cache, k, v, cache_seqlens):
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            causal=True,
            return_softmax_lse=True,
        )

    def inputs():
        gen = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

        return (
            rand(2, 1, 4, 32),
            rand(2, 16, 2, 32),
            rand(2, 16, 2, 32),
            rand(2, 1, 2, 32),
            rand(2, 1, 2, 32),
            torch.tensor([3, 8], dtype=torch.int32, device=device),
        )

    eager_args, compiled_args = inputs(), inputs()
    eager_out, eager_lse = decode_step(*eager_args)
    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    out, lse = compiled(*compiled_args)
    torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
    # The in-place append to the caches survives functionalization.
    torch.testing.assert_close(compiled_args[1], eager_args[1], atol=0, rtol=0)
    torch.testing.assert_close(compiled_args[2], eager_args[2], atol=0, rtol=0)
    assert torch.equal(compiled_args[1][0, 3], compiled_args[3][0, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_fa3_shapes_compile(device):
    """Paged cache with cache_leftpad and cache_batch_idx, and rotary_seqlens."""

    def decode_step(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, table, rot):
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=seqlens,
            cache_batch_idx=batch_idx,
            cache_leftpad=leftpad,
            block_table=table,
            causal=True,
            return_softmax_lse=True,
            rotary_seqlens=rot,
        )

    def inputs():
        gen = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

        def ints(*values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        angles = torch.rand(32, 8, generator=gen)
        return (
            rand(2, 1, 4, 32),
            rand(9, 4, 2, 32),  # 9 pages of 4 rows
            rand(9, 4, 2, 32),
            rand(2, 1, 2, 32),
            rand(2, 1, 2, 32),
            angles.cos().to(device=device, dtype=torch.bfloat16),
            angles.sin().to(device=device, dtype=torch.bfloat16),
            ints(3, 6),  # cache_seqlens: room for the new row in 2 pages of 4
            ints(2, 0),
            ints(1, 4),
            torch.randperm(9, generator=gen)[:6].view(3, 2).to(device=device, dtype=torch.int32),
            ints(6, 2),
        )

    eager_args, compiled_args = inputs(), inputs()
    eager_out, eager_lse = decode_step(*eager_args)
    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    out, lse = compiled(*compiled_args)
    torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
    torch.testing.assert_close(compiled_args[1], eager_args[1], atol=0, rtol=0)
    torch.testing.assert_close(compiled_args[2], eager_args[2], atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_varlen_compile(device):
    """FA3's varlen form: chunked prefill / speculative decoding over a paged
    cache, with an empty sequence and varlen new keys."""

    def step(q, k_cache, v_cache, k, v, cos, sin, seqlens, table, cu_q, cu_new):
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=seqlens,
            block_table=table,
            causal=True,
            return_softmax_lse=True,
            cu_seqlens_q=cu_q,
            cu_seqlens_k_new=cu_new,
            max_seqlen_q=4,
        )

    def inputs():
        gen = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

        def ints(*values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        angles = torch.rand(32, 8, generator=gen)
        return (
            rand(5, 4, 32),  # query rows 4, 0, 1
            rand(9, 4, 2, 32),  # 9 pages of 4 rows
            rand(9, 4, 2, 32),
            rand(4, 2, 32),  # new keys 3, 0, 1
            rand(4, 2, 32),
            angles.cos().to(device=device, dtype=torch.bfloat16),
            angles.sin().to(device=device, dtype=torch.bfloat16),
            ints(2, 5, 0),
            torch.randperm(9, generator=gen)[:6].view(3, 2).to(device=device, dtype=torch.int32),
            ints(0, 4, 4, 5),
            ints(0, 3, 3, 4),
        )

    eager_args, compiled_args = inputs(), inputs()
    eager_out, eager_lse = step(*eager_args)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out, lse = compiled(*compiled_args)
    assert out.shape == (5, 4, 32) and lse.shape == (4, 5)
    torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)
    torch.testing.assert_close(compiled_args[1], eager_args[1], atol=0, rtol=0)
    torch.testing.assert_close(compiled_args[2], eager_args[2], atol=0, rtol=0)


def _varlen_seqused_inputs(device, requires_grad):
    lengths_q, lengths_k, used = [7, 1, 12], [9, 4, 12], [5, 0, 12]

    def cu(lengths):
        return torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(
            0, dtype=torch.int32
        )

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)

    return (
        rand(sum(lengths_q), 4, 32),
        rand(sum(lengths_k), 2, 32),
        rand(sum(lengths_k), 2, 32),
        cu(lengths_q),
        cu(lengths_k),
        torch.tensor(used, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_seqused_k_compiles(device):
    def attention(q, k, v, cu_q, cu_k, used):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True, seqused_k=used)

    inputs = _varlen_seqused_inputs(device, requires_grad=True)
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    out = compiled(*inputs)
    grads = torch.autograd.grad(out.float().square().sum(), inputs[:3])
    eager = attention(*inputs)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), inputs[:3])
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for ours, ref in zip(grads, eager_grads):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert (grads[1][5:9] == 0).all()  # sequence 0's keys past seqused_k[0]


@pytest.mark.parametrize("device", DEVICES)
def test_seqused_q_compiles(device):
    def attention(q, k, v, cu_q, cu_k, used_k, used_q):
        return flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 12, 12, causal=True, seqused_k=used_k, seqused_q=used_q
        )

    inputs = _varlen_seqused_inputs(device, requires_grad=True)
    used_q = torch.tensor([4, 1, 0], dtype=torch.int32, device=device)
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    out = compiled(*inputs, used_q)
    grads = torch.autograd.grad(out.float().square().sum(), inputs[:3])
    eager = attention(*inputs, used_q)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), inputs[:3])
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for ours, ref in zip(grads, eager_grads):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    # Query rows past seqused_q: out 0 and no gradient (sequence 0's rows 4..6,
    # all of sequence 2's).
    rows = [4, 5, 6] + list(range(8, 20))
    assert (out[rows] == 0).all() and (grads[0][rows] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_out_compiles(device, backend):
    """out= in the three functions that take it: written in place under
    functionalization, and the returned tensor is the caller's."""

    def step(q, k, v, cu_q, cu_k, used, dq, k_cache, v_cache, seqlens, out_a, out_b, out_c):
        a = flash_attn_func(
            q.unflatten(0, (1, -1)),
            k.unflatten(0, (1, -1)),
            v.unflatten(0, (1, -1)),
            causal=True,
            out=out_a,
        )
        b = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 12, 12, causal=True, seqused_k=used, out=out_b
        )
        c = flash_attn_with_kvcache(
            dq, k_cache, v_cache, cache_seqlens=seqlens, num_splits=1, out=out_c
        )
        return a, b, c

    def inputs():
        gen = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

        q, k, v, cu_q, cu_k, used = _varlen_seqused_inputs(device, requires_grad=False)
        q, k, v = rand(*q.shape), rand(*k.shape), rand(*v.shape)
        cache = (
            rand(2, 1, 4, 32),
            rand(2, 16, 2, 32),
            rand(2, 16, 2, 32),
            torch.tensor([3, 16], dtype=torch.int32, device=device),
        )
        outs = (
            torch.empty(1, q.shape[0], 4, 32, dtype=torch.bfloat16, device=device),
            torch.empty_like(q),
            torch.empty(2, 1, 4, 32, dtype=torch.bfloat16, device=device),
        )
        return (q, k, v, cu_q, cu_k, used) + cache + outs

    eager_args, compiled_args = inputs(), inputs()
    with torch.no_grad():
        eager = step(*eager_args)
        results = torch.compile(step, backend=backend, fullgraph=True)(*compiled_args)
    for result, out, expected in zip(results, compiled_args[-3:], eager):
        assert result.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
