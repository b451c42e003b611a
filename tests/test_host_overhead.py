"""benchmarks/host_overhead.py on the CPU: every entry point runs, the op counts come
back, and --stub-ops leaves the flash_attn ops as they were."""

import json
from pathlib import Path

import torch
from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent


def load_host_overhead():
    return load_script(ROOT / "benchmarks" / "host_overhead.py", "host_overhead_under_test")


def rows_of(tmp_path, *args):
    script = load_host_overhead()
    threads = torch.get_num_threads()
    try:
        assert (
            script.main(
                ["--device", "cpu", "--calls", "3", "--rounds", "1", "--out", str(tmp_path), *args]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)  # the script runs the CPU path on one thread
    return {
        r["entry"]: r for r in json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    }


def test_every_entry_point_runs_on_cpu(tmp_path):
    rows = rows_of(tmp_path)
    for entry in (
        "kvcache_op",
        "with_kvcache",
        "with_kvcache_paged",
        "func",
        "varlen_func",
        "transformers",
        "sdpa_provider",
        "sdpa_torch",
    ):
        assert rows[entry]["us_per_call"] > 0, entry
    assert "skipped" in rows["kvcache_graph"]


def test_profile_counts_ops(tmp_path):
    # The profiler's start-up costs seconds: one run, two entries.
    rows = rows_of(tmp_path, "--profile", "--entries", "with_kvcache,sdpa_provider")
    for row in rows.values():
        assert row["profile"]["aten_ops"] >= 1
    # A call on the CPU path reads no device value back: no sync ops.
    assert rows["with_kvcache"]["profile"]["syncs"] == 0


def test_stub_ops_are_restored(tmp_path):
    before = torch.ops.flash_attn.fwd_kvcache
    rows = rows_of(tmp_path, "--stub-ops", "--entries", "with_kvcache,func")
    assert torch.ops.flash_attn.fwd_kvcache is before
    assert set(rows) == {"with_kvcache", "func"}
