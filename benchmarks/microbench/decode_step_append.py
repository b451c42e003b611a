"""What the append and the rotary embedding add to a decode step: one
flash_attn_with_kvcache call with attention alone, with one new token
appended (k, v), and with the new token appended and q / k rotated
(non-interleaved rotary over the whole head dim).

Seqlen_q 1, GQA 32:8, head dim 128, bf16, contiguous cache, cache_seqlens a
per-batch tensor one short of the cache so that the appended token fits.
Times are medians of triton's do_bench (L2 flushed before each call) in
microseconds, and of a CUDA graph replay of one call (--graphs), which leaves
the host's launch costs out.

    python benchmarks/microbench/decode_step_append.py [--cells 1x4096,64x4096] [--rounds 3] [--graphs]
"""

import argparse

import torch
from triton.testing import do_bench

import flash_attn_cuda

HEADS, HEADS_K, HEAD_DIM = 32, 8, 128
DEFAULT_CELLS = "1x4096,1x32768,8x4096,8x16384,16x4096,16x32768,64x4096"


def median_us(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_median_us(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay)


def step_calls(batch, seqlen_k):
    """The three calls of one cell, on one set of tensors."""
    dtype, dev = torch.bfloat16, "cuda"
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k_cache = torch.randn(batch, seqlen_k, HEADS_K, HEAD_DIM, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, 1, HEADS_K, HEAD_DIM, device=dev, dtype=dtype)
    v_new = torch.randn_like(k_new)
    cache_seqlens = torch.full((batch,), seqlen_k - 1, dtype=torch.int32, device=dev)
    angle = torch.rand(seqlen_k, HEAD_DIM // 2, device=dev) * 6.283
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    attend = flash_attn_cuda.flash_attn_with_kvcache
    return {
        "attention": lambda: attend(q, k_cache, v_cache, cache_seqlens=cache_seqlens),
        "+append": lambda: attend(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cache_seqlens
        ),
        "+append+rotary": lambda: attend(
            q,
            k_cache,
            v_cache,
            k=k_new,
            v=v_new,
            rotary_cos=cos,
            rotary_sin=sin,
            rotary_interleaved=False,
            cache_seqlens=cache_seqlens,
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="batch x seqlen_k, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--graphs", action="store_true", help="also time CUDA graph replays")
    args = parser.parse_args()
    cells = [tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for round_index in range(args.rounds):
        for batch, seqlen_k in cells:
            calls = step_calls(batch, seqlen_k)
            entries = []
            for name, fn in calls.items():
                entry = f"{name} {median_us(fn):7.1f}"
                if args.graphs:
                    entry += f" (graph {graph_median_us(fn):7.1f})"
                entries.append(entry)
            print(
                f"round {round_index + 1}  b{batch:<3d} x {seqlen_k:6d}: " + " | ".join(entries),
                flush=True,
            )
            del calls
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
