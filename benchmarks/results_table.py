"""Markdown tables of flash_attn_cuda against the SDPA backends from a results.json.

    python benchmarks/results_table.py benchmarks/results/NVIDIA_H200/results.json

One row per (mode, head dim, causal, dtype, seqlen): our TFLOP/s and the ratio
of each anchor's time to ours (>1: flash_attn_cuda is faster), all from the
same run.
"""

import argparse
import json
import math
from collections import defaultdict

ANCHORS = ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--min-seqlen", type=int, default=0)
    args = parser.parse_args()
    data = json.load(open(args.results))
    meta = data["meta"]
    cells = defaultdict(dict)
    for row in data["rows"]:
        if row.get("regime", "train") != "train" or row.get("tflops") is None:
            continue
        if row["seqlen_q"] < args.min_seqlen:
            continue
        key = (row["mode"], row["headdim"], row["causal"], row["dtype"], row["seqlen_q"])
        cells[key][row["provider"]] = row["tflops"]
    anchors = [a for a in ANCHORS if any(a in c for c in cells.values())]
    print(f"{meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}; ratio = anchor time / "
          f"flash_attn_cuda time (>1: flash_attn_cuda faster)\n")
    print("| mode | d | causal | dtype | seqlen | flash_attn_cuda TFLOP/s | "
          + " | ".join(f"x{a}" for a in anchors) + " |")
    print("|" + "---|" * (6 + len(anchors)))
    geo = defaultdict(list)
    for key in sorted(cells, key=lambda k: (["fwd", "bwd", "fwd_bwd"].index(k[0]), *k[1:])):
        ours = cells[key].get("flash_attn_cuda")
        if ours is None:
            continue
        ratios = []
        for anchor in anchors:
            theirs = cells[key].get(anchor)
            if theirs is None:
                ratios.append("-")
            else:
                ratios.append(f"{ours / theirs:.2f}")
                geo[(key[0], anchor)].append(ours / theirs)
        mode, d, causal, dtype, seqlen = key
        print(f"| {mode} | {d} | {causal} | {dtype} | {seqlen} | {ours:.1f} | " + " | ".join(ratios) + " |")
    print("\nGeometric mean of the ratio per mode:\n")
    print("| mode | " + " | ".join(anchors) + " |")
    print("|" + "---|" * (1 + len(anchors)))
    for mode in ["fwd", "bwd", "fwd_bwd"]:
        vals = []
        for anchor in anchors:
            xs = geo.get((mode, anchor))
            vals.append(f"{math.exp(sum(map(math.log, xs)) / len(xs)):.2f} (min {min(xs):.2f})" if xs else "-")
        if any(v != "-" for v in vals):
            print(f"| {mode} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main()
