"""Same-run A/B of two builds of flash_attn_cuda on one GPU.

Each build is a source tree built in place (``python3 setup.py build_ext
--inplace``). The benchmark (benchmark_attention.py, our providers only: --providers) runs
under each build in turn, A B A B ..., in separate processes on the same
machine; every case's time is the median over its rounds, and the report gives
B / A per case (time ratio: above 1 means B is slower) and the geometric mean
per regime and mode. It also says, per case, whether the two builds' outputs (and
gradients) agree bit for bit (the benchmark's ``output_digest`` / ``grad_digest``):
``bits`` is "equal" or "differ", or "varies" where build A's own rounds already
disagree (a kernel whose summation order is not fixed, such as the default
backward's dQ), and the summary counts them, so that a change meant to leave the
results unchanged is checked by the same run that times it.

    python3 benchmarks/ab_builds.py --a /path/to/base --b /path/to/new \
        --rounds 3 --out ab.json -- --regimes train --dtypes bf16 --headdims 64,128

Arguments after ``--`` go to benchmark_attention.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
KEY_FIELDS = (
    "provider",
    "regime",
    "mode",
    "dtype",
    "headdim",
    "headdim_v",
    "causal",
    "seqlen_q",
    "seqlen_k",
    "batch",
    "nheads",
    "nheads_k",
    "note",
    # The decode and paged_prefill regimes time the same shape once per cache
    # layout (contiguous, paged1, paged16, ...).
    "kv_layout",
)


DIGEST_FIELDS = ("output_digest", "grad_digest")


def digest_of(row: dict) -> Optional[tuple]:
    values = tuple(row.get(f) for f in DIGEST_FIELDS)
    return values if any(v is not None for v in values) else None


def bits_verdict(a_digests: list, b_digests: list) -> Optional[str]:
    """equal / differ / varies (A's rounds disagree among themselves), or None
    when a side has no digest."""
    a = [d for d in a_digests if d is not None]
    b = [d for d in b_digests if d is not None]
    if not a or not b:
        return None
    if len(set(a)) > 1 or len(set(b)) > 1:
        return "varies"
    return "equal" if a[0] == b[0] else "differ"


def run_once(tree: Path, bench_args: list[str], out_dir: Path, providers: str) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        str(HERE / "benchmark_attention.py"),
        "--providers",
        providers,
        "--no-plots",
        "--out",
        str(out_dir),
        *bench_args,
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads((out_dir / "results.json").read_text())["rows"]
    ours = set(providers.split(","))
    return [r for r in rows if r.get("provider") in ours and r.get("ms")]


def key_of(row: dict) -> tuple:
    return tuple(row.get(f) for f in KEY_FIELDS)


def group_of(case: dict) -> tuple:
    """The summary's group: provider, regime (with its cache layout where the
    regime has several, e.g. decode[paged16]) and mode."""
    regime = case["regime"]
    if case.get("kv_layout") not in (None, "contiguous"):
        regime += f"[{case['kv_layout']}]"
    return (case["provider"], regime, case["mode"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="tree of build A (baseline)")
    parser.add_argument("--b", type=Path, required=True, help="tree of build B (candidate)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    parser.add_argument(
        "--providers",
        default="flash_attn_cuda",
        help="comma list of our providers to time (flash_attn_cuda, "
        "flash_attn_cuda_deterministic, flash_attn_cuda_dropout)",
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]

    times: dict[str, dict[tuple, list[float]]] = {"a": defaultdict(list), "b": defaultdict(list)}
    digests: dict[str, dict[tuple, list]] = {"a": defaultdict(list), "b": defaultdict(list)}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                out_dir = Path(scratch) / f"{side}{r}"
                for row in run_once(getattr(args, side), bench_args, out_dir, args.providers):
                    times[side][key_of(row)].append(row["ms"])
                    digests[side][key_of(row)].append(digest_of(row))

    cases = []
    groups: dict[tuple, list[float]] = defaultdict(list)
    for key in sorted(set(times["a"]) & set(times["b"]), key=str):
        a_ms = statistics.median(times["a"][key])
        b_ms = statistics.median(times["b"][key])
        case = dict(zip(KEY_FIELDS, key))
        case.update(
            a_ms=a_ms,
            b_ms=b_ms,
            b_over_a=b_ms / a_ms,
            a_rounds=times["a"][key],
            b_rounds=times["b"][key],
            bits=bits_verdict(digests["a"][key], digests["b"][key]),
        )
        cases.append(case)
        groups[group_of(case)].append(b_ms / a_ms)
    summary = {}
    for (provider, regime, mode), ratios in sorted(groups.items()):
        verdicts = [c["bits"] for c in cases if group_of(c) == (provider, regime, mode)]
        summary[f"{provider}/{regime}/{mode}"] = {
            "cases": len(ratios),
            "geomean_b_over_a": math.exp(sum(map(math.log, ratios)) / len(ratios)),
            "max_b_over_a": max(ratios),
            "min_b_over_a": min(ratios),
            "bits": {v: verdicts.count(v) for v in ("equal", "differ", "varies") if v in verdicts},
        }
    report = {
        "a": str(args.a),
        "b": str(args.b),
        "rounds": args.rounds,
        "bench_args": bench_args,
        "summary": summary,
        "cases": cases,
    }
    args.out.write_text(json.dumps(report, indent=1))
    for name, s in summary.items():
        bits = ", ".join(f"{n} {v}" for v, n in s["bits"].items()) or "no digests"
        print(
            f"{name}: {s['cases']} cases, B/A geomean {s['geomean_b_over_a']:.4f}, "
            f"range {s['min_b_over_a']:.4f}-{s['max_b_over_a']:.4f}; bits: {bits}"
        )


if __name__ == "__main__":
    main()
