#!/usr/bin/env python3
"""summary.md of a context-parallel results folder: every check_*.json and bench_*.json in it.

    python3 scripts/context_parallel_summary.py benchmarks/results/<gpu>/context_parallel

scripts/run_context_parallel.sh writes the folder and calls this; runs made in
several calls into one folder share one summary. Printed to stdout.
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _load(folder: str, pattern: str) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, pattern)))]


def _pct(v):
    return "n/a" if v is None else f"{100 * v:.1f}%"


def summary(folder: str) -> str:
    lines = ["# Context parallelism", ""]
    for d in sorted(_load(folder, "check_*.json"), key=lambda d: (d["world_size"], d["provider"])):
        lines.append(
            f"- check {d['provider']}: world_size {d['world_size']}, {d['device']}, torch "
            f"{d['torch']}, commit {d['commit']}: {'PASS' if d['passed'] else 'FAIL'}"
        )
        for case in d["cases"]:
            worst = max(case["errors"].values(), key=lambda r: r["cp"] / r["limit"], default=None)
            ratio = f"{worst['cp'] / worst['limit']:.2f}" if worst else "n/a"
            lines.append(
                f"  - seqlen {case['seqlen']}: {'pass' if case['passed'] else 'FAIL'} "
                f"(largest error / limit {ratio})"
            )
    benches = sorted(_load(folder, "bench_*.json"), key=lambda d: (d["world_size"], d["provider"]))
    ok = {(d["provider"], d["world_size"]): d["result"] for d in benches if d.get("result")}
    lines += [
        "",
        "Per GPU: tokens/s against the same provider on one GPU (x ws1), and against "
        "torch's built-in FLASH kernels at the same world size (x builtin).",
        "",
        "| provider | world size | device | seqlen | step ms | tokens/s per GPU | x ws1 "
        "| x builtin | peak GiB per GPU | NCCL kernel share | exposed comm share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in benches:
        r = d.get("result")
        if not r:
            lines.append(
                f"| {d['provider']} | {d['world_size']} | {d['device']} | "
                f"{d['config']['seqlens_tried']} | failed: {d.get('error')} | | | | | | |"
            )
            continue
        base = ok.get((d["provider"], 1))
        builtin = ok.get(("builtin", d["world_size"]))
        tps = r["tokens_per_s_per_gpu"]
        vs_ws1 = f"{tps / base['tokens_per_s_per_gpu']:.2f}" if base else "n/a"
        vs_builtin = f"{tps / builtin['tokens_per_s_per_gpu']:.2f}" if builtin else "n/a"
        gib = r.get("peak_mem_gib_max")
        lines.append(
            f"| {d['provider']} | {d['world_size']} | {d['device']} | {r['seqlen']} | "
            f"{1e3 * r['step_s_median']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {vs_ws1} | "
            f"{vs_builtin} | {'n/a' if gib is None else f'{gib:.1f}'} | "
            f"{_pct(r.get('comm_kernel_share_mean'))} | {_pct(r.get('comm_exposed_share_mean'))} |"
        )
    runs = benches + _load(folder, "check_*.json")
    commands = sorted({d["command"] for d in runs if d.get("command")})
    if commands:
        lines += ["", "Commands:", ""] + [f"    {c}" for c in commands]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(summary(sys.argv[1] if len(sys.argv) > 1 else "."))
