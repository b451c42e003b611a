"""Host cost per attention call in a decode loop, through each front end.

Per step, 4 layers each append one key to a growing (batch, heads, seqlen,
head_dim) cache with torch.cat, as transformers' DynamicCache does, and call
attention with one query row: SDPA on torch's built-in FLASH kernels, SDPA
with the FLASH_ATTN_CUDA provider active, and flash_attn_func on the BSHD
views. Then the same with a cache that does not grow. Wall time per step
after warm-up: at this size the calls are bound by the host.

    python3 benchmarks/microbench/decode_call_host_cost.py
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_cuda
import flash_attn_cuda.integrations.sdpa  # noqa: F401  (registers the provider)

DEVICE, DTYPE = "cuda", torch.bfloat16
BATCH, HEADS, HEAD_DIM, PROMPT, LAYERS, STEPS = 8, 16, 128, 512, 4, 128


def us_per_step(call, grow, steps=STEPS):
    def cache():
        return [
            torch.randn(BATCH, HEADS, PROMPT, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            for _ in range(LAYERS)
        ]

    keys, values = cache(), cache()
    q = torch.randn(BATCH, 1, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE).transpose(1, 2)
    new = torch.randn(BATCH, HEADS, 1, HEAD_DIM, device=DEVICE, dtype=DTYPE)

    def step():
        for layer in range(LAYERS):
            if grow:
                keys[layer] = torch.cat([keys[layer], new], dim=2)
                values[layer] = torch.cat([values[layer], new], dim=2)
            call(q, keys[layer], values[layer])

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def fa_func(q, k, v):
    return flash_attn_cuda.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def main():
    results = {}
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for grow in (True, False):
            results[("builtin", grow)] = us_per_step(sdpa, grow)
            torch.nn.attention.activate_flash_attention_impl("FLASH_ATTN_CUDA")
            results[("provider", grow)] = us_per_step(sdpa, grow)
            torch.nn.attention.restore_flash_attention_impl()
            results[("flash_attn_func", grow)] = us_per_step(fa_func, grow)
    for (name, grow), us in results.items():
        print(f"{name:16s} grow={grow}: {us:8.1f} us/step ({us / LAYERS:6.1f} us/call)")


if __name__ == "__main__":
    main()
