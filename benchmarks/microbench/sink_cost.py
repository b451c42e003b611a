"""What an attention sink costs, and the dropout cliff on sm90.

The same call with and without learnable_sink, timed with CUDA events in
interleaved rounds in one process (median of 5 rounds): forward, forward +
backward with the sink requiring grad (sink_grad and the backward's D), and a
decode step (num_splits 1 and the heuristic's). Then, for the dropout work on
the Hopper kernels, the same training call with dropout 0.1 against none:
dropout's forward runs the Hopper kernel (issue 57 step 1), its backward the
SM80-design kernel.

    python3 benchmarks/microbench/sink_cost.py
"""

import statistics

import torch

from flash_attn_cuda import flash_attn_func, flash_attn_with_kvcache

DEVICE, DTYPE = "cuda", torch.bfloat16
HEADS, HEAD_DIM = 16, 128


def event_ms(fn, iters=20):
    for _ in range(3):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def interleaved(fn_a, fn_b, rounds, iters=20):
    a, b = [], []
    for _ in range(rounds):
        a.append(event_ms(fn_a, iters))
        b.append(event_ms(fn_b, iters))
    return statistics.median(a), statistics.median(b)


def training_inputs(seqlen):
    batch = max(1, 16384 // seqlen)
    shape = (batch, seqlen, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=DEVICE, dtype=DTYPE)


def sink_training():
    for seqlen, causal in ((1024, False), (1024, True), (4096, False), (4096, True), (8192, False)):
        q, k, v, dout = training_inputs(seqlen)
        sink = torch.randn(HEADS, device=DEVICE, dtype=torch.float32, requires_grad=True)

        def fwd(s):
            with torch.no_grad():
                flash_attn_func(q, k, v, causal=causal, learnable_sink=s)

        def fwd_bwd(s):
            flash_attn_func(q, k, v, causal=causal, learnable_sink=s).backward(dout)

        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            plain, with_sink = interleaved(lambda: fn(None), lambda: fn(sink), rounds=5)
            print(
                f"d{HEAD_DIM} s{seqlen} causal={causal} {name:8s} no sink {plain:7.3f} ms  "
                f"sink {with_sink:7.3f} ms  ratio {with_sink / plain:.3f}",
                flush=True,
            )


def sink_decode():
    for batch, seqlen_k in ((4, 8192), (16, 4096)):
        q = torch.randn(batch, 1, 32, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        k_cache = torch.randn(batch, seqlen_k, 8, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        v_cache = torch.randn_like(k_cache)
        lens = torch.full((batch,), seqlen_k, device=DEVICE, dtype=torch.int32)
        sink = torch.randn(32, device=DEVICE, dtype=torch.float32)
        for num_splits in (1, 0):

            def step(s, n=num_splits):
                flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=lens, num_splits=n, learnable_sink=s
                )

            plain, with_sink = interleaved(lambda: step(None), lambda: step(sink), 5, iters=50)
            print(
                f"decode b{batch} sk{seqlen_k} num_splits={num_splits}: no sink "
                f"{plain * 1e3:7.1f} us  sink {with_sink * 1e3:7.1f} us  "
                f"ratio {with_sink / plain:.3f}",
                flush=True,
            )


def dropout_cliff():
    for seqlen, causal in ((1024, False), (4096, False), (4096, True)):
        q, k, v, dout = training_inputs(seqlen)

        def fwd(p):
            with torch.no_grad():
                flash_attn_func(q, k, v, dropout_p=p, causal=causal)

        def fwd_bwd(p):
            flash_attn_func(q, k, v, dropout_p=p, causal=causal).backward(dout)

        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            plain, dropped = interleaved(lambda: fn(0.0), lambda: fn(0.1), rounds=3)
            print(
                f"dropout d{HEAD_DIM} s{seqlen} causal={causal} {name:8s} p=0 {plain:7.3f} ms"
                f"  p=0.1 {dropped:7.3f} ms  ratio {dropped / plain:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    sink_training()
    sink_decode()
    dropout_cliff()
