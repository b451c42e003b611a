"""The tooling configuration: .pre-commit-config.yaml, .clang-format, pyproject's [tool.ruff],
and the lint step of .ci/run.

CPU only, no network, and none of the tools needs to be installed: the files are read as
text. PyYAML may be missing, so .pre-commit-config.yaml is read by a small line-based reader
of the YAML subset it uses; where PyYAML is installed, one test checks that the two agree.
"""

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRE_COMMIT = ROOT / ".pre-commit-config.yaml"
CLANG_FORMAT = ROOT / ".clang-format"
PYPROJECT = ROOT / "pyproject.toml"
CI_RUN = ROOT / ".ci" / "run"
RESULTS = ROOT / "benchmarks" / "results"
GENERATED = ROOT / "csrc" / "cuda" / "instantiations"
HOOK_KEYS = ("id", "args", "files", "exclude", "types", "types_or")


def _strip_comment(line):
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _scalar(text):
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return [_scalar(item) for item in text[1:-1].split(",") if item.strip()]
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _read_pre_commit_config():
    """[{"repo", "rev", "hooks": [{HOOK_KEYS...}]}], from `key: value` lines; a line of
    any other shape (say, a block list) fails here rather than being misread."""
    repos, hook = [], None
    for number, raw in enumerate(PRE_COMMIT.read_text().splitlines(), 1):
        line = _strip_comment(raw).rstrip()
        if not line.strip():
            continue
        match = re.fullmatch(r"(\s*)(- )?([\w-]+):\s*(.*)", line)
        assert match, f"{PRE_COMMIT.name}:{number}: the line reader cannot read {raw!r}"
        indent, dash, key, value = match.groups()
        if not indent and not dash:  # a top-level key
            hook = None
        elif dash and key == "repo":
            repos.append({"repo": _scalar(value), "hooks": []})
            hook = None
        elif key == "rev":
            repos[-1]["rev"] = _scalar(value)
        elif dash and key == "id":
            hook = {"id": _scalar(value)}
            repos[-1]["hooks"].append(hook)
        elif hook is not None and key in HOOK_KEYS:
            hook[key] = _scalar(value)
    return repos


def _hooks():
    """{hook id: (its repo entry, the hook)}."""
    repos = _read_pre_commit_config()
    return {hook["id"]: (repo, hook) for repo in repos for hook in repo["hooks"]}


def _ruff_settings():
    text = PYPROJECT.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: read the [tool.ruff] table by hand
        table = re.search(r"^\[tool\.ruff\]\n(.*?)^\[", text, re.S | re.M).group(1)
        pairs = re.findall(r"^([\w-]+)\s*=\s*(\S+)", table, re.M)
        return {key: int(v) if v.isdigit() else v.strip('"') for key, v in pairs}
    return tomllib.loads(text)["tool"]["ruff"]


def _column_limit():
    return int(re.search(r"^ColumnLimit:\s*(\d+)", CLANG_FORMAT.read_text(), re.M).group(1))


def test_line_reader_agrees_with_yaml():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; the line reader stands")
    data = yaml.safe_load(PRE_COMMIT.read_text())
    expected = [
        {
            "repo": repo["repo"],
            "rev": repo["rev"],
            "hooks": [{k: hook[k] for k in HOOK_KEYS if k in hook} for hook in repo["hooks"]],
        }
        for repo in data["repos"]
    ]
    assert _read_pre_commit_config() == expected


def test_every_hook_repository_is_pinned_to_a_release():
    repos = _read_pre_commit_config()
    assert repos, f"{PRE_COMMIT.name} lists no hook repositories"
    for repo in repos:
        rev = repo.get("rev", "")
        assert re.fullmatch(r"v?\d+(\.\d+)+", rev), f"{repo['repo']}: rev {rev!r} is no release tag"


def test_large_file_hook_lets_every_benchmark_result_in():
    repo, hook = _hooks()["check-added-large-files"]
    assert repo["repo"].endswith("/pre-commit-hooks")
    (limit,) = [int(a.split("=", 1)[1]) for a in hook.get("args", []) if a.startswith("--maxkb=")]
    # Results and plots belong under benchmarks/results/: the limit must not refuse them.
    sizes = {p: math.ceil(p.stat().st_size / 1024) for p in RESULTS.rglob("*") if p.is_file()}
    too_large = {str(p.relative_to(ROOT)): kb for p, kb in sizes.items() if kb > limit}
    assert not too_large, f"over the --maxkb={limit} of {PRE_COMMIT.name}: {too_large}"


def test_text_fixers_leave_recorded_results_alone():
    hooks = _hooks()
    for hook_id in ("trailing-whitespace", "end-of-file-fixer"):
        _, hook = hooks[hook_id]
        assert hook.get("types") == ["text"], hook_id
        assert re.search(hook["exclude"], "benchmarks/results/NVIDIA_H100/results.json"), hook_id


def test_ruff_hooks_check_and_format():
    hooks = _hooks()
    for hook_id in ("ruff-check", "ruff-format"):
        assert hook_id in hooks, f"{PRE_COMMIT.name} has no {hook_id} hook"
        assert hooks[hook_id][0]["repo"].endswith("/ruff-pre-commit")


def test_clang_format_hook_covers_csrc_but_not_generated_files():
    repo, hook = _hooks()["clang-format"]
    assert repo["repo"].endswith("/mirrors-clang-format")
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cpp", ".cu")]
    assert sources
    for path in sources:
        name = path.relative_to(ROOT).as_posix()
        covered = re.search(hook["files"], name) and not re.search(hook["exclude"], name)
        assert bool(covered) != (GENERATED in path.parents), name


def test_ruff_line_length_equals_clang_format_column_limit():
    ruff = _ruff_settings()
    assert ruff["line-length"] == _column_limit(), (
        "pyproject.toml [tool.ruff] line-length and .clang-format ColumnLimit are one policy: "
        "change both together"
    )


def test_ruff_target_is_the_oldest_supported_python():
    requires = re.search(r'^requires-python\s*=\s*">=\s*3\.(\d+)"', PYPROJECT.read_text(), re.M)
    assert _ruff_settings()["target-version"] == f"py3{requires.group(1)}"


def _ci_variable(name):
    match = re.search(rf'^{name}="([^"]*)"$', CI_RUN.read_text(), re.M)
    assert match, f'{CI_RUN.relative_to(ROOT)} sets no {name}="..." line'
    return match.group(1)


@pytest.mark.parametrize(
    "variable, hook_id, package",
    [
        ("RUFF_VERSION", "ruff-check", "ruff"),
        ("CLANG_FORMAT_VERSION", "clang-format", "clang-format"),
    ],
)
def test_ci_lints_with_the_versions_the_hooks_pin(variable, hook_id, package):
    # One formatter version for CI and pre-commit: two versions can format one line two
    # ways, and then CI and the hook would each reject the other's output.
    version = _ci_variable(variable)
    repo, _ = _hooks()[hook_id]
    assert repo["rev"].removeprefix("v") == version, (
        f".ci/run {variable}={version}, {PRE_COMMIT.name} {repo['repo']} rev {repo['rev']}"
    )
    assert f'"{package}==${{{variable}}}"' in CI_RUN.read_text(), (
        f".ci/run does not install {package}==${{{variable}}}"
    )


def test_ci_lint_step_runs_before_the_build_and_skips_generated_files():
    text = CI_RUN.read_text()
    commands = [
        "ruff check",
        "ruff format --check",
        "--dry-run --Werror",
        "pip install --quiet --disable-pip-version-check --no-build-isolation -e .",
    ]
    positions = [text.find(command) for command in commands]
    assert -1 not in positions, dict(zip(commands, positions))
    assert positions == sorted(positions), "the lint commands must run before the build"
    assert "-path csrc/cuda/instantiations -prune" in text
