#!/usr/bin/env python3
"""One line of numbers per kernel from ncu's details page (``--page details --csv``).

    python3 benchmarks/ncu_summary.py details.csv

The columns are those that PERF_LOG's issue-53 design table compares between our kernels
and FA4's: time, SM and memory throughput, issue activity, registers, shared memory,
occupancy, grid. A metric that the report lacks (another section set) prints as ``-``.
"""

from __future__ import annotations

import csv
import sys
from collections import OrderedDict

# (column, ncu's metric name on the details page)
COLUMNS = [
    ("us", "Duration"),
    ("sm%", "Compute (SM) Throughput"),
    ("mem%", "Memory Throughput"),
    ("dram%", "DRAM Throughput"),
    ("ipc", "Executed Ipc Active"),
    ("issue%", "Issue Slots Busy"),
    ("cyc/inst", "Warp Cycles Per Issued Instruction"),
    ("inst", "Executed Instructions"),
    ("regs", "Registers Per Thread"),
    ("smem", "Dynamic Shared Memory Per Block"),
    ("occ%", "Achieved Occupancy"),
    ("block", "Block Size"),
    ("grid", "Grid Size"),
]


def read_kernels(path: str) -> "OrderedDict[str, dict]":
    """Kernel launch id -> {"name": ..., metric name: (value, unit)}."""
    kernels: OrderedDict = OrderedDict()
    with open(path, newline="") as f:
        for row in csv.DictReader(line for line in f if not line.startswith("==")):
            kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
            kernel[row["Metric Name"]] = (row["Metric Value"], row.get("Metric Unit", ""))
    return kernels


def value(kernel: dict, metric: str) -> str:
    if metric not in kernel:
        return "-"
    raw, unit = kernel[metric]
    text = raw.replace(",", "")
    try:
        number = float(text)
    except ValueError:
        return raw
    if metric == "Duration":  # in the unit ncu chose; print microseconds
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
        number *= scale.get(unit, 1.0)
    if metric == "Dynamic Shared Memory Per Block" and unit in ("byte", "Kbyte"):
        number = number / 1024 if unit == "byte" else number
        return f"{number:.0f}K"
    if metric == "Executed Instructions":
        return f"{number / 1e6:.1f}M"
    return f"{number:.3g}" if number < 1000 else f"{number:.0f}"


def short_name(name: str, width: int = 60) -> str:
    """The kernel's name without its template arguments, cut to width."""
    base = name.split("<", 1)[0].split("(", 1)[0]
    return base if len(base) <= width else base[: width - 3] + "..."


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    kernels = read_kernels(argv[0])
    header = ["id", "kernel"] + [c for c, _ in COLUMNS]
    rows = [
        [launch, short_name(k["name"])] + [value(k, m) for _, m in COLUMNS]
        for launch, k in kernels.items()
    ]
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
