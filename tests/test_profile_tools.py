"""benchmarks/profile_cell.py, benchmarks/ncu_summary.py and benchmarks/ncu_source_top.py
without a GPU: the cell's shape follows the training grid, bad arguments are refused, and
the ncu tools read a details page and a source page (small ones written here in ncu's CSV
layout)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_source_top  # noqa: E402
import ncu_summary  # noqa: E402
import profile_cell  # noqa: E402


def test_cell_shape_follows_the_training_grid():
    args = profile_cell.parse_args(["--headdim", "128", "--seqlen", "8192", "--gqa", "4"])
    shape = profile_cell.cell_shape(args)
    assert (shape.batch, shape.seqlen_q, shape.seqlen_k) == (2, 8192, 8192)
    assert (shape.nheads, shape.nheads_k, shape.headdim) == (16, 4, 128)
    assert not shape.causal


@pytest.mark.parametrize(
    "argv", [["--headdim", "96", "--hidden", "2048"], ["--seqlen", "3000"], ["--gqa", "3"]]
)
def test_cell_shape_refuses_what_does_not_divide(argv):
    with pytest.raises(SystemExit):
        profile_cell.cell_shape(profile_cell.parse_args(argv))


def test_provider_names():
    args = profile_cell.parse_args(["--providers", "ours,fa4", "--deterministic"])
    names = profile_cell.provider_names(args)
    assert names == {"ours": "flash_attn_cuda_deterministic", "fa4": "fa4_deterministic"}
    with pytest.raises(SystemExit, match="unknown"):
        profile_cell.provider_names(profile_cell.parse_args(["--providers", "ours,triton"]))


def test_ncu_summary_reads_a_details_page(tmp_path, capsys):
    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [
        ("0", "void flash::bwd_kernel<128>(Params)", "Duration", "msecond", "1.25"),
        ("0", "void flash::bwd_kernel<128>(Params)", "Registers Per Thread", "", "168"),
        ("0", "void flash::bwd_kernel<128>(Params)", "Executed Instructions", "", "4,720,000"),
        ("1", "kernel_cutlass_fa4_bwd", "Duration", "usecond", "980.5"),
    ]
    lines = [f'"{i}","{k}","S","{m}","{u}","{v}"\n' for i, k, m, u, v in rows]
    path = tmp_path / "details.csv"
    path.write_text("==PROF== a line ncu prints\n" + head + "".join(lines))
    assert ncu_summary.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["id", "kernel", "us"]
    ours = out[1].split()
    assert ours[:3] == ["0", "void", "flash::bwd_kernel"] and ours[3] == "1250"
    assert "4.7M" in ours and "168" in ours
    fa4 = out[2].split()
    assert fa4[:3] == ["1", "kernel_cutlass_fa4_bwd", "980"] and fa4[-1] == "-"


def test_paged_prefill_shape():
    args = profile_cell.parse_args(
        ["--paged-prefill", "4x512x4096", "--hidden", "4096", "--gqa", "4", "--page-sizes", "1,256"]
    )
    shape, sizes = profile_cell.paged_prefill_shape(args)
    assert (shape.batch, shape.seqlen_q, shape.seqlen_k) == (4, 512, 4096)
    assert (shape.nheads, shape.nheads_k, shape.headdim) == (32, 8, 128) and shape.causal
    assert sizes == [None, 1, 256]
    for bad in (["--paged-prefill", "4x512"], ["--paged-prefill", "1x1x1", "--page-sizes", "a"]):
        with pytest.raises(SystemExit):
            profile_cell.paged_prefill_shape(profile_cell.parse_args(bad))


def test_ncu_source_top_reads_a_source_page(tmp_path, capsys):
    """ncu's source page (--page source --csv --print-source sass): a "Kernel Name" line,
    the header, one row per instruction; a kernel's table may come twice in a row."""
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    cols += ["stall_barrier", "stall_long_sb", "stall_wait"]

    def table(kernel, rows):
        lines = [f'"Kernel Name","{kernel}",\n', ",".join(f'"{c}"' for c in cols) + "\n"]
        return "".join(lines + [",".join(f'"{v}"' for v in r) + "\n" for r in rows])

    rows = [
        (
            "0x10",
            "      HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ",
            "10",
            "1,000",
            "0",
            "0",
            "10",
        ),
        ("0x20", "@!P0  BRA 0x10", "30", "500", "0", "30", "0"),
        ("0x30", "      UMOV UR19, 0x40000040", "60", "1,000", "60", "0", "0"),
    ]
    other = [("0x10", "      EXIT", "5", "10", "0", "0", "5")]
    path = tmp_path / "source_sass.csv"
    path.write_text(table("k<0>", rows) + table("k<0>", rows) + table("k<1>", other))
    tables = list(ncu_source_top.kernel_tables(str(path)))
    assert [name for name, _ in tables] == ["k<0>", "k<1>"]
    assert ncu_source_top.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "samples 100, warp instructions executed 2500" in out
    assert "stall_barrier 60.0%" in out and "UMOV 60.0%" in out and "BRA 30.0%" in out
    first = out.splitlines()[4]
    assert "UMOV UR19" in first and "60.0%" in first and "stall_barrier 60" in first
