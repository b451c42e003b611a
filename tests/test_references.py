"""Every file that the tree names exists.

- A repository path in any tracked text file (``csrc/...``, ``docs/...``,
  ``benchmarks/...``, ``tests/...``, ``scripts/...``, ``flash_attn_cuda/...``,
  ``third_party/...``, ``.ci/...``), and in csrc/ a path relative to csrc/ as its
  includes and comments write them (``cuda/core/params.h``, ``api/checks.h``), names
  a file or folder of the tree. Braces expand (``plan.{h,cpp}``); ``<...>`` and a
  one-choice brace (``hdim{D}``) stand for any name.
- A bare file name (``fwd_launch.h``) in a C++ comment, in Markdown, or a ``.md`` name
  in Python, is the name of some file of the tree.
- An ``#include "..."`` of benchmarks/microbench resolves (nothing compiles those
  files in the build; CI compiles them with benchmarks/microbench/compile_all.sh).
- Every ``results/...`` path of benchmarks/PERF_LOG.md exists under benchmarks/ or
  is followed by ``@ <commit>``, a commit that holds it (that part needs the git
  history and is skipped without it).

Paths of other projects (flash-attn's ``tests/test_flash_attn.py``) and sample
strings are listed in NOT_REFERENCES with the reason.
"""

import fnmatch
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

TEXT_SUFFIXES = {".md", ".py", ".h", ".cpp", ".cu", ".cuh", ".sh", ".toml", ".txt", ".yaml"}
CXX_SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}
# Records of past runs: they name what existed when they were written.
SKIPPED_FOLDERS = ("benchmarks/results/",)

# (file, the path or name as written): a string that looks like a reference to a
# file of this tree but is not one.
NOT_REFERENCES = {
    ("README.md", "tests/test_flash_attn.py"): "flash-attn's own test file",
    ("scripts/flash_attn_suite/README.md", "tests/test_flash_attn.py"): "flash-attn's test file",
    ("scripts/flash_attn_suite/run.sh", "tests/test_flash_attn.py"): "flash-attn's test file",
    (
        "tests/test_tooling_config.py",
        "benchmarks/results/NVIDIA_H100/results.json",
    ): "a sample path that the pre-commit hook's exclude pattern must match",
    ("scripts/run_context_parallel.sh", "flash_attn_cuda/_C.*"): "a glob of the built extension",
    ("tests/test_setup_build_plan.py", "csrc/x{i}.cpp"): "sample sources of a build plan",
    ("tests/test_setup_build_plan.py", "csrc/cuda/y{i}.cu"): "sample sources of a build plan",
    ("tests/test_setup_build_plan.py", "csrc/a.cpp"): "sample sources of a build plan",
    ("tests/test_setup_build_plan.py", "csrc/b.cpp"): "sample sources of a build plan",
}

# Known stale references in files that another change restructures; empty this
# once that change is merged. (file, name): why it is here.
KNOWN_STALE: dict = {}

ROOTED_PATH = re.compile(
    r"(?<![\w/.-])((?:csrc|docs|benchmarks|tests|scripts|flash_attn_cuda|third_party|\.ci)"
    r"/[\w./{},*<>-]*)"
)
CSRC_RELATIVE_PATH = re.compile(
    r"(?<![\w/.-])((?:cuda|api|common|cpu)/[\w./{},-]*\.(?:h|cpp|cu|cuh))"
)
BARE_NAME = re.compile(r"(?<![\w/.{}-])([A-Za-z_][\w-]*(?:\.[\w-]+)*\.(?:h|cpp|cu|cuh|py|sh|md))\b")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# Written by setup.py into build/generated/ at build time.
GENERATED_NAMES = {"flash_attn_cuda_build_info.h"}


@cache
def _git_files() -> list[str] | None:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [f for f in out.decode().split("\0") if f]


def _ignored(path: str) -> bool:
    """Whether .gitignore ignores a file of a tree without git (a copy on a test
    machine): a folder pattern anchored at the root (/benchmarks/out/), or an
    unanchored folder pattern (build/, *.egg-info/, .pytest_cache/) matching any
    folder of the path."""
    anchored, anywhere = [".git/"], ["build/", "__pycache__/"]
    gitignore = ROOT / ".gitignore"
    if gitignore.is_file():
        for line in gitignore.read_text().splitlines():
            line = line.strip()
            if line.endswith("/"):
                (anchored if line.startswith("/") else anywhere).append(line.lstrip("/"))
    folders = path.split("/")[:-1]
    return any(path.startswith(d) for d in anchored) or any(
        fnmatch.fnmatch(folder + "/", pattern) for folder in folders for pattern in anywhere
    )


@cache
def _tree_files() -> list[str]:
    files = _git_files()
    if files is None:
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()]
        files = [f for f in files if not _ignored(f)]
    return sorted(f for f in files if (ROOT / f).is_file())


@cache
def _tree_names() -> frozenset[str]:
    return frozenset(Path(f).name for f in _tree_files())


def _text_files() -> list[str]:
    return [
        f
        for f in _tree_files()
        if (Path(f).suffix in TEXT_SUFFIXES or f == ".ci/run")
        and f != THIS_FILE
        and not f.startswith(SKIPPED_FOLDERS)
    ]


def _expand(path: str) -> list[str]:
    """plan.{h,cpp} -> plan.h, plan.cpp; a one-choice brace is a placeholder."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    choices = match.group(1).split(",")
    if len(choices) == 1:
        choices = ["*"]
    return [
        expanded
        for choice in choices
        for expanded in _expand(path[: match.start()] + choice + path[match.end() :])
    ]


def _exists(path: str) -> bool:
    path = re.sub(r"<[^<>]*>", "*", path)
    if "<" in path:  # a placeholder with spaces (<GPU name>): check up to it
        path = path[: path.index("<")] + "*"
    path = path.rstrip("/") or "."
    if "*" in path:
        pattern = path
        return any(
            fnmatch.fnmatch(f, pattern) or fnmatch.fnmatch(f, pattern + "/*") for f in _tree_files()
        )
    return (ROOT / path).exists()


def _clean(path: str) -> str:
    return path.rstrip(".,:;)")


def _is_ignored(path: str) -> bool:
    """Whether a path named in the text is, or lies in, an ignored folder."""
    return _ignored(path) or _ignored(path.rstrip("/") + "/-")


def _cxx_comments(text: str) -> str:
    """The comments of a C++ file, one line each where they were (code blanked)."""
    lines = []
    in_block = False
    for line in text.splitlines():
        kept = ""
        rest = line
        while rest:
            if in_block:
                end = rest.find("*/")
                if end < 0:
                    kept += rest
                    rest = ""
                else:
                    kept += rest[:end]
                    rest = rest[end + 2 :]
                    in_block = False
            else:
                start_line = rest.find("//")
                start_block = rest.find("/*")
                if start_line < 0 and start_block < 0:
                    rest = ""
                elif start_block < 0 or 0 <= start_line < start_block:
                    kept += rest[start_line + 2 :]
                    rest = ""
                else:
                    rest = rest[start_block + 2 :]
                    in_block = True
        lines.append(kept)
    return "\n".join(lines)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _offset_of_line(text: str, line: int) -> int:
    pos = 0
    for _ in range(line - 1):
        pos = text.index("\n", pos) + 1
    return pos


def _problems_in(file: str) -> list[str]:
    text = (ROOT / file).read_text(errors="replace")
    problems = []

    def report(pos: int, name: str, what: str) -> None:
        # pos: in text, or in names_text, which keeps text's lines.
        if (file, name) in NOT_REFERENCES or (file, name) in KNOWN_STALE:
            return
        problems.append(f"{file}:{_line_of(text, pos)}: {what} {name!r}")

    for match in ROOTED_PATH.finditer(text):
        path = _clean(match.group(1))
        if "/" not in path.rstrip("/") or _is_ignored(path):
            continue
        if not all(_exists(p) for p in _expand(path)):
            report(match.start(1), path, "no such path")

    suffix = Path(file).suffix
    if file.startswith("csrc/"):
        for match in CSRC_RELATIVE_PATH.finditer(text):
            path = _clean(match.group(1))
            if not all(_exists("csrc/" + p) for p in _expand(path)):
                report(match.start(1), path, "no such path under csrc/")

    if suffix in CXX_SUFFIXES:
        # Blanking the code keeps every comment at its line.
        names_text = _cxx_comments(text)
        for match in INCLUDE.finditer(text):
            include = match.group(1)
            here = (ROOT / file).parent / include
            if not (here.exists() or (ROOT / "csrc" / include).exists()):
                if include not in GENERATED_NAMES:
                    report(match.start(1), include, "include of a missing header")
    elif file == "benchmarks/PERF_LOG.md":
        # A row describes the code at its commit, in that commit's file names.
        names_text = "\n".join("" if line.startswith("| ") else line for line in text.splitlines())
    elif suffix == ".md":
        names_text = text
    elif suffix == ".py":
        names_text = "\n".join(
            line if ".md" in line else "" for line in text.splitlines()
        )  # only Markdown names: Python files name the files they write
    else:
        names_text = ""
    for match in BARE_NAME.finditer(names_text):
        name = match.group(1)
        if suffix == ".py" and not name.endswith(".md"):
            continue
        if name not in _tree_names() and name not in GENERATED_NAMES:
            report(
                _offset_of_line(text, _line_of(names_text, match.start(1))), name, "no file named"
            )
    return problems


def test_named_paths_exist():
    assert _tree_files(), "found no files to check"
    problems = [p for f in _text_files() for p in _problems_in(f)]
    assert not problems, "references to files that do not exist:\n" + "\n".join(problems)


def test_allowlists_are_still_needed():
    """An entry of NOT_REFERENCES / KNOWN_STALE whose file no longer has its string goes."""
    stale = []
    for file, name in list(NOT_REFERENCES) + list(KNOWN_STALE):
        path = ROOT / file
        if not path.is_file() or name not in path.read_text(errors="replace"):
            stale.append(f"{file}: {name}")
    assert not stale, "allowlist entries to remove:\n" + "\n".join(stale)


def test_microbench_includes_resolve():
    files = sorted((ROOT / "benchmarks" / "microbench").glob("*.cu*"))
    assert files
    missing = []
    for path in files:
        for include in INCLUDE.findall(path.read_text()):
            if not ((path.parent / include).is_file() or (ROOT / "csrc" / include).is_file()):
                missing.append(f"{path.relative_to(ROOT)}: {include}")
    assert not missing, "includes that resolve to no file:\n" + "\n".join(missing)


# --- PERF_LOG ---------------------------------------------------------------

PERF_LOG = ROOT / "benchmarks" / "PERF_LOG.md"
RESULTS_PATH = re.compile(r"(?<![\w/.-])(results/[\w./{},-]*[\w}/])(?: @ ([0-9a-f]{7,40}))?")


def _perf_log_text() -> str:
    # The commented-out example row names placeholders.
    return re.sub(r"<!--.*?-->", "", PERF_LOG.read_text(), flags=re.DOTALL)


def _has_history() -> bool:
    try:
        shallow = subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return shallow == "false"


def _commit_holds(commit: str, path: str) -> bool:
    return (
        subprocess.run(
            ["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True
        ).returncode
        == 0
    )


def test_perf_log_results_cells_name_full_paths():
    """The Results column names each file by its whole results/ path, so that each can
    carry its commit: no bare names after a folder ("results/X/a.json, b.json")."""
    bare = []
    for number, line in enumerate(_perf_log_text().splitlines(), 1):
        if not line.startswith("| 20"):
            continue
        cell = line.split("|")[-2]
        without_paths = RESULTS_PATH.sub("", cell)
        for name in re.findall(r"[\w{},-]+\.(?:json|txt|md|png)\b", without_paths):
            if name != "results.json":  # "the committed results.json" in a note
                bare.append(f"PERF_LOG.md:{number}: {name}")
    assert not bare, "Results cells with a name that is not a whole path:\n" + "\n".join(bare)


def test_perf_log_results_are_in_the_tree_or_a_named_commit():
    text = _perf_log_text()
    unheld, without_commit = [], []
    for match in RESULTS_PATH.finditer(text):
        path, commit = match.group(1), match.group(2)
        line = _line_of(text, match.start())
        for expanded in _expand(path):
            in_tree = "benchmarks/" + expanded.rstrip("/")
            if (ROOT / in_tree).exists():
                continue
            if commit is None:
                without_commit.append(f"PERF_LOG.md:{line}: {expanded}")
            else:
                unheld.append((line, expanded, commit, in_tree))
    assert not without_commit, (
        "results paths that are not in the tree and name no commit (add ' @ <commit>', "
        "a commit that holds the file: git log --all --format=%h -- benchmarks/<path>):\n"
        + "\n".join(without_commit)
    )
    if not unheld:
        return
    if not _has_history():
        pytest.skip("no full git history: cannot check the commits PERF_LOG names")
    wrong = [
        f"PERF_LOG.md:{line}: {path} @ {commit}"
        for line, path, commit, in_tree in unheld
        if not _commit_holds(commit, in_tree)
    ]
    assert not wrong, "commits that do not hold the file named with them:\n" + "\n".join(wrong)
