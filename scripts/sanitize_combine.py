"""A few small flash_attn_combine calls for compute-sanitizer (not a pytest module).

    compute-sanitizer --tool memcheck  python scripts/sanitize_combine.py
    compute-sanitizer --tool racecheck python scripts/sanitize_combine.py

Both kernel widths (4-element vectors, and single elements for head dims that
are not a multiple of 4 or views that are not aligned), every input and output
dtype, 1 to 256 splits, empty and NaN splits, a row count that leaves a block's
last warps without a row, strided inputs and outputs, and the varlen layout.
"""

import math

import torch
from sanitize_calls import skips_left_out, summary

from flash_attn_cuda import flash_attn_combine


@skips_left_out
def call(num_splits, lead, nheads, head_dim, dtype=torch.float32, out_dtype=None, view=False):
    dev = "cuda"
    if view:
        base = torch.randn(num_splits, *lead, nheads, head_dim + 1, device=dev).to(dtype)
        out_partial = base[..., 1:]
    else:
        out_partial = torch.randn(num_splits, *lead, nheads, head_dim, device=dev).to(dtype)
    lse_partial = torch.randn(num_splits, *lead, nheads, device=dev) * 4
    lse_partial[0, ..., ::2] = -math.inf
    lse_partial[-1, ..., 1::3] = math.inf
    out_partial[0, ..., ::2, :] = math.nan
    flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    out = torch.empty(*lead, nheads, head_dim + 2, device=dev)[..., 1:-1]
    flash_attn_combine(out_partial, lse_partial, out=out)


def main():
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    for dtype in dtypes:
        for out_dtype in dtypes:
            call(3, (2, 5), 3, 64, dtype, out_dtype)
            call(3, (2, 5), 3, 6, dtype, out_dtype)
    for num_splits in (1, 2, 31, 33, 255, 256):
        call(num_splits, (1, 7), 1, 128)
    call(5, (13,), 4, 40, torch.bfloat16)  # varlen layout
    call(4, (2, 3), 5, 128, torch.float16, view=True)
    call(7, (1, 3), 1, 512, torch.bfloat16)
    lse = torch.full((4, 2, 3), math.nan, device="cuda")
    flash_attn_combine(torch.randn(4, 2, 3, 16, device="cuda"), lse)
    torch.cuda.synchronize()
    print(summary("sanitize_combine"))


if __name__ == "__main__":
    main()
