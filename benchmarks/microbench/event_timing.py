"""The timing of the microbenchmark scripts that compare two calls in one
process: the median of `calls` runs of fn timed with CUDA events, a buffer
written before each run so that no input is left in L2 by the one before."""

import argparse

import torch


def setup(doc, add_arguments=None):
    """The scripts' common start: --copy-gbs (the device copy bandwidth their
    shares count against) and what add_arguments(parser) adds, parsed with the
    first line of `doc` as description, the seed, and the 256 MB flush buffer.
    Returns (args, flush)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--copy-gbs", type=float, default=4221.0, help="device copy bandwidth")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    return args, torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def best_us(fn, flush, rounds=2):
    """The faster of `rounds` medians (median_us)."""
    return min(median_us(fn, flush) for _ in range(rounds))


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
