"""The timing of the microbenchmark scripts that compare two calls in one
process: the median of `calls` runs of fn timed with CUDA events, a buffer
written before each run so that no input is left in L2 by the one before."""

import torch


def median_us(fn, flush, calls=50):
    """Median microseconds of fn over `calls` runs after 5 warm-up runs;
    `flush` is a CUDA tensor (e.g. 256 MB) zeroed before each run."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]
