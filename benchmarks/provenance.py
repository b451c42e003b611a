"""Which commit a result was measured on, for the JSON the benchmarks write."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """FLASH_ATTN_CUDA_COMMIT or GIT_COMMIT when set (a copy of the tree without
    .git names its commit so), else git's HEAD, "-dirty" when tracked files
    differ from it; "unknown" without either."""
    for name in ("FLASH_ATTN_CUDA_COMMIT", "GIT_COMMIT"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
