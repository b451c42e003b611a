"""Inputs shared by the CUDA kernel tests (test_cuda_fwd.py, test_cuda_bwd.py)."""

import torch

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [32, 40, 64, 72, 96, 128, 160, 192, 224, 256]


def poison_allocator(nbytes=1 << 28):
    """Fill soon-to-be-reused cached memory with NaN, so an output element a
    kernel forgets to write shows up as NaN instead of a stale plausible value."""
    blob = torch.full((nbytes // 4,), float("nan"), device=DEVICE)
    del blob


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype):
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    return q, k, v


def random_cu_seqlens(batch, max_len, allow_empty=True):
    low = 0 if allow_empty else 1
    lengths = torch.randint(low, max_len + 1, (batch,))
    lengths[0] = max_len
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu, int(lengths.max())


def many_short_sequences(batch, nheads, nheads_k, head_dim, dtype, max_len=8):
    """Packed varlen inputs of `batch` sequences, sequence b of (b mod max_len)
    + 1 query rows and as many keys: with batch past 65535, more sequences than
    CUDA's grid y or z holds. Returns cu_seqlens (on the CPU), q, k, v."""
    lengths = torch.arange(batch) % max_len + 1
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    q = torch.randn(total, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    return cu, q, k, v


def rows_of_sequences_of_length(cu, length, max_len=8):
    """The packed rows (n, length) of the sequences of many_short_sequences
    that have `length` rows, for a batched reference over all of them."""
    starts = cu[length - 1 : -1 : max_len].long()
    return (starts[:, None] + torch.arange(length)).to(DEVICE)


def launched_kernels(fn):
    """The names of the CUDA kernels fn launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
