#!/usr/bin/env python3
"""Where a kernel's warps wait, from ncu's source page (``--page source --csv
--print-source sass``, as benchmarks/ncu_cell.sh writes it with NCU_SOURCE_KERNEL):

    python3 benchmarks/ncu_source_top.py source_sass.csv [--top 25]

Per kernel in the file: its warp stall samples summed by reason, by opcode, and the
instructions that hold the most samples with their leading reasons. A file too large
to copy off a GPU machine reduces to this on the machine.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import Counter


def kernel_tables(path: str):
    """(kernel name, rows) per table, one dict per SASS instruction. ncu writes a
    "Kernel Name" line before each kernel's table, then its header row ("Address",
    ...); it may write a kernel's table twice in a row, which is kept once."""
    tables, lines, title = [], [], None
    with open(path, newline="") as f:
        for line in f:
            if line.startswith('"Kernel Name"'):
                if lines:
                    tables.append((title, lines))
                lines = []
                title = next(csv.reader([line]))[1]
            elif line.startswith('"Address"'):
                if lines:
                    tables.append((title, lines))
                lines = [line]
            elif lines and line.startswith('"'):
                lines.append(line)
    if lines:
        tables.append((title, lines))
    previous = None
    for title, body in tables:
        if (title, body) == previous:
            continue
        previous = (title, body)
        yield title, list(csv.DictReader(io.StringIO("".join(body))))


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for n, (title, rows) in enumerate(kernel_tables(args.csv)):
        if not rows:
            continue
        cols = list(rows[0].keys())
        total_col = next((c for c in cols if "Sampling (All" in c), None)
        reason_cols = [c for c in cols if c.startswith("stall_") or "Stall Reason" in c]
        exec_col = next((c for c in cols if c.startswith("Instructions Executed")), None)
        print(f"== kernel table {n}: {title}")
        if total_col is None:
            print("   no stall sampling column; columns:", cols[:30])
            continue
        total = sum(number(r[total_col]) for r in rows)
        executed = sum(number(r.get(exec_col, "0")) for r in rows) if exec_col else 0
        print(f"   samples {total:.0f}, warp instructions executed {executed:.0f}")
        by_reason = Counter()
        for r in rows:
            for c in reason_cols:
                by_reason[c] += number(r[c])
        print(
            "   by reason:",
            ", ".join(f"{c} {v / total:.1%}" for c, v in by_reason.most_common(10) if v),
        )
        by_op = Counter()
        for r in rows:
            op = (r.get("Source") or "").split()
            op = [w for w in op if not w.startswith("@")]
            by_op[op[0].split(".")[0] if op else "?"] += number(r[total_col])
        print("   by opcode:", ", ".join(f"{k} {v / total:.1%}" for k, v in by_op.most_common(12)))
        top = sorted(rows, key=lambda r: -number(r[total_col]))[: args.top]
        for r in top:
            reasons = sorted(((number(r[c]), c) for c in reason_cols), reverse=True)[:3]
            print(
                f"   {r.get('Address', '?'):>8} {number(r[total_col]) / total:6.1%} "
                f"x{number(r.get(exec_col, '0')):>9.0f}  {(r.get('Source') or '')[:70]:70} "
                + ", ".join(f"{c} {v:.0f}" for v, c in reasons if v)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
