"""CPU smoke runs of the context-parallel scripts (issue #46), no GPU needed.

scripts/context_parallel_check.py and benchmarks/context_parallel_bench.py run
under torchrun with 2 gloo processes at toy sizes (--device cpu: our CPU kernels
behind aten::_scaled_dot_product_flash_attention, called on sequence-sharded
DTensors because SDPA's CPU kernel is not what context parallelism intercepts).
The real runs are on several GPUs: scripts/run_context_parallel.sh.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from script_module import load_script

from conftest import PACKAGE_PARENT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "scripts", "context_parallel_check.py")
BENCH = os.path.join(ROOT, "benchmarks", "context_parallel_bench.py")

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip(
        "torch.distributed with gloo is not available in this build", allow_module_level=True
    )
try:
    from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the torch build
    pytest.skip(f"context parallelism is missing in this torch ({exc})", allow_module_level=True)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    return env


def _run(args, timeout=120):
    proc = subprocess.run(
        args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    return proc, proc.stdout + proc.stderr


def _torchrun(nproc, script, *args):
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            script,
            *args,
        ]
    )


def test_check_two_gloo_ranks(tmp_path):
    out = tmp_path / "check.json"
    proc, log = _torchrun(
        2,
        CHECK,
        "--device",
        "cpu",
        "--seqlen",
        "64",
        "36",
        "--dim",
        "64",
        "--heads",
        "2",
        "--batch",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, log
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["provider"] == "ours" and record["passed"]
    for key in ("torch", "device", "commit", "command", "criterion"):
        assert record[key]
    assert [c["seqlen"] for c in record["cases"]] == [64, 36]
    for case in record["cases"]:
        assert case["passed"] and not case["failures"]
        assert {"out", "dx", "dqkv.weight", "dproj.weight"} <= set(case["errors"])
        assert case["overrides_run_rank0"]["_scaled_dot_product_flash_attention"] >= 1
        assert case["overrides_run_rank0"]["_scaled_dot_product_flash_attention_backward"] >= 1


def test_check_fails_on_a_wrong_kernel(tmp_path):
    # The check must see a wrong result: scale our forward's output by 1.01.
    out = tmp_path / "check.json"
    code = f"""
import runpy, sys
sys.path.insert(0, {PACKAGE_PARENT!r})
from flash_attn_cuda.integrations import sdpa
fwd = sdpa._OVERRIDES["_scaled_dot_product_flash_attention"]
def wrong(*args, **kwargs):
    result = list(fwd(*args, **kwargs))
    result[0] = result[0] * 1.01
    return tuple(result)
sdpa._OVERRIDES["_scaled_dot_product_flash_attention"] = wrong
sys.argv = [{CHECK!r}, "--device", "cpu", "--seqlen", "32", "--dim", "32", "--heads", "2",
            "--batch", "1", "--out", {str(out)!r}]
runpy.run_path({CHECK!r}, run_name="__main__")
"""
    proc, log = _run([sys.executable, "-c", code])
    assert proc.returncode == 1, log
    record = json.loads(out.read_text())
    assert record["world_size"] == 1 and not record["passed"]
    assert not record["cases"][0]["errors"]["out"]["ok"]


def test_bench_two_gloo_ranks(tmp_path):
    proc, log = _torchrun(
        2,
        BENCH,
        "--device",
        "cpu",
        "--seqlen",
        "128",
        "--layers",
        "1",
        "--hidden",
        "64",
        "--head-dim",
        "32",
        "--vocab",
        "64",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, log
    record = json.loads((tmp_path / "cp_bench_ours_ws2.json").read_text())
    assert record["world_size"] == 2 and record["context_parallel"] and record["load_balance"]
    assert record["command"].startswith("torchrun --nproc_per_node 2")
    result = record["result"]
    assert result["seqlen"] == 128 and len(result["step_s"]) == 2
    assert [r["local_tokens"] for r in result["per_rank"]] == [64, 64]
    assert result["tokens_per_s_per_gpu"] > 0 and torch.isfinite(torch.tensor(result["loss"]))


def _bench_module():
    return load_script(BENCH, "context_parallel_bench")


def test_comm_share_from_a_trace(tmp_path):
    # Kernels (us): compute 0-100 and 150-200; NCCL 80-160 (20 + 10 under compute)
    # and 300-310 (alone). Exposed: 100-150 and 300-310 = 60 us.
    events = [
        dict(ph="X", cat="kernel", name="sm90_xmma_gemm", ts=0, dur=100),
        dict(ph="X", cat="kernel", name="flash_fwd", ts=150, dur=50),
        dict(ph="X", cat="kernel", name="ncclDevKernel_AllGather_RING_LL", ts=80, dur=80),
        dict(ph="X", cat="kernel", name="ncclKernel_AllReduce_RING_LL_Sum_bf16", ts=300, dur=10),
        dict(ph="X", cat="cpu_op", name="nccl:all_gather", ts=0, dur=1000),  # not a kernel
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    comm = _bench_module().comm_from_trace(str(path), wall_us=400.0)
    assert comm["nccl_kernels"] == 2
    assert comm["comm_kernel_ms"] == pytest.approx(0.090)
    assert comm["comm_exposed_ms"] == pytest.approx(0.060)
    assert comm["compute_kernel_busy_ms"] == pytest.approx(0.150)
    assert comm["comm_kernel_share"] == pytest.approx(90 / 400)
    assert comm["comm_exposed_share"] == pytest.approx(60 / 400)


def test_driver_two_world_sizes_and_summary(tmp_path):
    """scripts/run_context_parallel.sh with NS="1 2" (DEVICE=cpu): every step's JSON, one summary."""
    env = _env()
    env.update(DEVICE="cpu", NS="1 2")
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "run_context_parallel.sh"), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == [
        "bench_ours_ws1.json",
        "bench_ours_ws2.json",
        "check_ours_ws1.json",
        "check_ours_ws2.json",
    ], names
    summary = (tmp_path / "summary.md").read_text()
    assert "check ours: world_size 2" in summary and "PASS" in summary and "FAIL" not in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ours |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"], rows
    assert rows[0].split("|")[7].strip() == "1.00"  # ws1 against itself
