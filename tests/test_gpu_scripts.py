"""The shell scripts that drive a GPU machine (scripts/, benchmarks/): each parses, and
scripts/gpu_ab.sh refuses an argument it does not know before it copies or builds
anything. Their real runs need a GPU and a CUDA toolkit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("benchmarks/**/*.sh"), ROOT / ".ci/run"])

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _gpu_ab_refusal(tmp_path, *args):
    """gpu_ab.sh's stderr for arguments it must refuse before it copies or builds."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_ab.sh"), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "AB_DIR": str(tmp_path / "ab")},
    )
    assert result.returncode == 2
    assert not (tmp_path / "ab").exists(), "nothing is copied before the arguments are read"
    return result.stderr


def test_gpu_ab_refuses_an_unknown_argument(tmp_path):
    assert "unknown argument '--bogus'" in _gpu_ab_refusal(tmp_path, "--rounds", "2", "--bogus")


def test_gpu_ab_refuses_a_base_tree_that_is_no_source_tree(tmp_path):
    stderr = _gpu_ab_refusal(tmp_path, "--base-tree", str(tmp_path), "--", "x")
    assert "is not a source tree" in stderr
