#!/usr/bin/env python3
"""Draw the benchmark plots from a results.json written by benchmark_attention.py.

    python3 benchmarks/plot_results.py benchmarks/results/<gpu>/current/results.json [--out DIR]

Writes PNGs next to the JSON (or into --out):
  headline.png                           bf16 (or the first dtype), head dim 128 (or nearest):
                                         fwd and fwd_bwd, non-causal and causal
  train_d<D>[_gqa<G>]_<mode>_<causal|noncausal>.png   TFLOP/s against seqlen, one subplot
                                         per dtype (_gqa4: nheads / nheads_k = 4)
  decode_sq<N>.png                       microseconds and GB/s against seqlen_k, per batch
  memory.png                             peak memory of fwd+bwd against seqlen
"""

from __future__ import annotations

import argparse
import json
import os
import sys

OURS = "flash_attn_cuda"
OURS_DETERMINISTIC = "flash_attn_cuda_deterministic"
OURS_DROPOUT = "flash_attn_cuda_dropout"
PROVIDER_ORDER = [
    OURS,
    OURS_DETERMINISTIC,
    OURS_DROPOUT,
    "fa4",
    "fa4_deterministic",
    "sdpa_flash",
    "sdpa_cudnn",
    "sdpa_efficient",
    "sdpa_math",
    "flex",
    "sdpa_cpu",
]
PROVIDER_STYLE = {
    OURS: dict(color="tab:red", marker="o", linewidth=2.4),
    OURS_DETERMINISTIC: dict(color="tab:red", marker="o", markerfacecolor="none", linestyle="--"),
    OURS_DROPOUT: dict(color="tab:red", marker="o", markerfacecolor="none", linestyle=":"),
    "fa4": dict(color="black", marker="P"),
    "fa4_deterministic": dict(color="black", marker="P", markerfacecolor="none", linestyle="--"),
    "sdpa_flash": dict(color="tab:blue", marker="s"),
    "sdpa_cudnn": dict(color="tab:green", marker="^"),
    "sdpa_efficient": dict(color="tab:purple", marker="v"),
    "sdpa_math": dict(color="tab:gray", marker="x"),
    "flex": dict(color="tab:orange", marker="D"),
    "sdpa_cpu": dict(color="tab:blue", marker="s"),
}


def load(path: str):
    """(meta, rows); accepts the {"meta", "rows"} object or a bare list of rows."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return {}, data
    return data.get("meta", {}), data.get("rows", [])


def _label(row: dict) -> str:
    if row.get("page_size"):
        return f"{row['provider']}[paged{row['page_size']}]"
    return row["provider"]


def _style(label: str) -> dict:
    base = label.split("[")[0]
    style = dict(PROVIDER_STYLE.get(base, {}))
    if "[paged" in label:
        style["linestyle"] = "--" if label.endswith("16]") else ":"
    return style


def _order(labels) -> list:
    def key(label):
        base = label.split("[")[0]
        return (PROVIDER_ORDER.index(base) if base in PROVIDER_ORDER else 99, label)

    return sorted(labels, key=key)


def _group(row: dict) -> int:
    """nheads / nheads_k: 1 for MHA, 4 for GQA 4:1."""
    nheads, nheads_k = row.get("nheads"), row.get("nheads_k")
    return nheads // nheads_k if nheads and nheads_k else 1


def _ok(row: dict) -> bool:
    return not row.get("error") and row.get("ms") is not None


def _device_title(meta: dict) -> str:
    if meta.get("device") == "cpu":
        return f"CPU ({meta.get('cpu') or 'unknown'}), torch {meta.get('torch')} - CPU numbers"
    return f"{meta.get('gpu')}, torch {meta.get('torch')}, CUDA {meta.get('cuda')}"


def _throughput(meta: dict):
    """(row -> value, axis label): GFLOP/s on a CPU, TFLOP/s on a GPU."""
    if meta.get("device") == "cpu":
        return (lambda r: r["tflops"] * 1e3), "GFLOP/s"
    return (lambda r: r["tflops"]), "TFLOP/s"


def _plot_train_axis(ax, rows, value, ylabel, title):
    by_provider = {}
    for r in rows:
        if _ok(r) and r.get("tflops") is not None:
            by_provider.setdefault(r["provider"], []).append((r["seqlen_q"], value(r)))
    for provider in _order(by_provider):
        points = sorted(by_provider[provider])
        ax.plot([p[0] for p in points], [p[1] for p in points], label=provider, **_style(provider))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("seqlen")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if by_provider:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no successful runs", ha="center", va="center", transform=ax.transAxes)


def plot_train(plt, meta, rows, out_dir) -> list:
    train = [r for r in rows if r.get("regime", "train") == "train"]
    value, ylabel = _throughput(meta)
    dtypes = sorted({r["dtype"] for r in train})
    paths = []
    # A head-dim pair (d_qk, d_v) gets plots of its own; headdim_v 0: v as wide as q.
    keys = sorted(
        {(r["headdim"], r.get("headdim_v") or 0, _group(r), r["mode"], r["causal"]) for r in train}
    )
    for headdim, headdim_v, group, mode, causal in keys:
        heads = f"{headdim}/{headdim_v}" if headdim_v else f"{headdim}"
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            subset = [
                r
                for r in train
                if r["headdim"] == headdim
                and (r.get("headdim_v") or 0) == headdim_v
                and _group(r) == group
                and r["mode"] == mode
                and r["causal"] == causal
                and r["dtype"] == dtype
            ]
            sample = subset[0] if subset else {}
            _plot_train_axis(
                ax,
                subset,
                value,
                ylabel,
                f"{dtype}, headdim {heads}, {'causal' if causal else 'non-causal'}, {mode}\n"
                f"batch*seqlen={_tokens(sample)}, nheads={sample.get('nheads')}"
                + (f", nheads_k={sample.get('nheads_k')}" if group != 1 else ""),
            )
        fig.suptitle(_device_title(meta), fontsize=10)
        fig.tight_layout()
        path = os.path.join(
            out_dir,
            f"train_d{headdim}{f'v{headdim_v}' if headdim_v else ''}"
            f"{f'_gqa{group}' if group != 1 else ''}_{mode}_"
            f"{'causal' if causal else 'noncausal'}.png",
        )
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _tokens(row: dict):
    if not row:
        return None
    return row["batch"] * row["seqlen_q"]


def plot_headline(plt, meta, rows, out_dir) -> list:
    # MHA only: a GQA cell of the same seqlen would be a second point on each line;
    # so would a head-dim pair's.
    train = [
        r
        for r in rows
        if r.get("regime", "train") == "train" and _group(r) == 1 and r.get("headdim_v") is None
    ]
    if not train:
        return []
    value, ylabel = _throughput(meta)
    dtypes = {r["dtype"] for r in train}
    dtype = "bf16" if "bf16" in dtypes else sorted(dtypes)[0]
    headdims = sorted({r["headdim"] for r in train if r["dtype"] == dtype})
    headdim = min(headdims, key=lambda d: abs(d - 128))
    modes = [m for m in ("fwd", "fwd_bwd") if any(r["mode"] == m for r in train)] or sorted(
        {r["mode"] for r in train}
    )
    causals = sorted({r["causal"] for r in train})
    fig, axes = plt.subplots(
        len(modes), len(causals), figsize=(6 * len(causals), 4.2 * len(modes)), squeeze=False
    )
    for i, mode in enumerate(modes):
        for j, causal in enumerate(causals):
            subset = [
                r
                for r in train
                if r["dtype"] == dtype
                and r["headdim"] == headdim
                and r["mode"] == mode
                and r["causal"] == causal
            ]
            _plot_train_axis(
                axes[i][j],
                subset,
                value,
                ylabel,
                f"{'forward + backward' if mode == 'fwd_bwd' else mode}, "
                f"{'causal' if causal else 'non-causal'}, headdim {headdim}, {dtype}",
            )
    fig.suptitle(f"Attention throughput: {_device_title(meta)}", fontsize=11)
    fig.tight_layout()
    path = os.path.join(out_dir, "headline.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plot_decode(plt, meta, rows, out_dir) -> list:
    decode = [r for r in rows if r.get("regime") == "decode"]
    paths = []
    copy_gbps = meta.get("copy_gbps")
    for sq in sorted({r["seqlen_q"] for r in decode}):
        subset = [r for r in decode if r["seqlen_q"] == sq]
        batches = sorted({r["batch"] for r in subset})
        fig, axes = plt.subplots(2, len(batches), figsize=(4.5 * len(batches), 8), squeeze=False)
        for j, batch in enumerate(batches):
            by_label = {}
            for r in subset:
                if r["batch"] == batch and _ok(r):
                    by_label.setdefault(_label(r), []).append(r)
            for label in _order(by_label):
                points = sorted(by_label[label], key=lambda r: r["seqlen_k"])
                xs = [r["seqlen_k"] for r in points]
                axes[0][j].plot(xs, [r["ms"] * 1e3 for r in points], label=label, **_style(label))
                axes[1][j].plot(xs, [r["gbps"] for r in points], label=label, **_style(label))
            if copy_gbps:
                axes[1][j].axhline(
                    copy_gbps,
                    color="black",
                    linestyle="--",
                    linewidth=1,
                    label="device copy (read+write)",
                )
            for ax, ylabel in ((axes[0][j], "microseconds"), (axes[1][j], "GB/s of K/V read")):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("seqlen_k")
                ax.set_ylabel(ylabel)
                ax.grid(True, alpha=0.3)
            axes[0][j].set_yscale("log")
            axes[0][j].set_title(f"batch {batch}", fontsize=10)
            if by_label:
                axes[1][j].legend(fontsize=7)
        sample = subset[0]
        fig.suptitle(
            f"Decode, seqlen_q={sq}, heads {sample['nheads']}:{sample['nheads_k']}, "
            f"headdim {sample['headdim']}, {sample['dtype']}: {_device_title(meta)}",
            fontsize=10,
        )
        fig.tight_layout()
        path = os.path.join(out_dir, f"decode_sq{sq}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_memory(plt, meta, rows, out_dir) -> list:
    memory = [r for r in rows if r.get("regime") == "memory"]
    by_provider = {}
    for r in memory:
        if _ok(r) and r.get("peak_mem_bytes") is not None:
            by_provider.setdefault(r["provider"], []).append(
                (r["seqlen_q"], r["peak_mem_bytes"] / 2**20)
            )
    if not by_provider:
        return []
    fig, ax = plt.subplots(figsize=(7, 5))
    for provider in _order(by_provider):
        points = sorted(by_provider[provider])
        ax.plot([p[0] for p in points], [p[1] for p in points], label=provider, **_style(provider))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("seqlen")
    ax.set_ylabel("peak MiB beyond inputs (fwd + bwd)")
    sample = memory[0]
    ax.set_title(
        f"Memory of forward + backward: batch {sample['batch']}, {sample['nheads']} heads, "
        f"headdim {sample['headdim']}, {sample['dtype']}\n"
        "slope 1 = linear in seqlen, slope 2 = quadratic",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.suptitle(_device_title(meta), fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "memory.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def make_plots(meta: dict, rows: list, out_dir: str) -> list:
    """Write every plot the rows allow; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    paths += plot_headline(plt, meta, rows, out_dir)
    paths += plot_train(plt, meta, rows, out_dir)
    paths += plot_decode(plt, meta, rows, out_dir)
    paths += plot_memory(plt, meta, rows, out_dir)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results.json written by benchmark_attention.py")
    parser.add_argument(
        "--out", default=None, help="folder for the PNGs (default: the JSON's folder)"
    )
    args = parser.parse_args(argv)
    meta, rows = load(args.results)
    out_dir = args.out or os.path.dirname(os.path.abspath(args.results))
    for path in make_plots(meta, rows, out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
