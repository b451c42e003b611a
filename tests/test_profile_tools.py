"""benchmarks/profile_cell.py and benchmarks/ncu_summary.py without a GPU: the cell's
shape follows the training grid, bad arguments are refused, and the ncu summary reads
a details page (a small one written here in ncu's CSV layout)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

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
