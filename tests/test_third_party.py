"""The CUTLASS pin (third_party/cutlass_requirement.txt) and how setup.py finds the headers.

CPU only: nothing here builds or imports flash_attn_cuda. pyproject.toml
cannot read the pin file, so these tests keep its copy of the requirement,
and every other mention of a pinned nvidia-cutlass in the repository, in step.
"""

import importlib.util
import os
import re
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "third_party" / "cutlass_requirement.txt"
PIN_PATTERN = re.compile(r"nvidia-cutlass\s*==\s*([0-9][0-9.]*[0-9])")


def _pin_lines():
    lines = [line.split("#", 1)[0].strip() for line in PIN_FILE.read_text().splitlines()]
    return [line for line in lines if line]


def _pinned_version():
    (line,) = _pin_lines()
    return PIN_PATTERN.fullmatch(line).group(1)


def _build_requires():
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: read the list by hand
        block = re.search(r"\[build-system\].*?requires\s*=\s*\[(.*?)\]", text, re.S).group(1)
        return re.findall(r'"([^"]+)"', block)
    return tomllib.loads(text)["build-system"]["requires"]


def _load_setup():
    # setup.py only builds when run as a script
    return load_script(ROOT / "setup.py", "flash_attn_cuda_setup_under_test")


def test_pin_file_holds_one_exact_requirement():
    lines = _pin_lines()
    assert len(lines) == 1, f"{PIN_FILE.name} must hold one requirement line, has {lines}"
    assert PIN_PATTERN.fullmatch(lines[0]), f"not an exact nvidia-cutlass pin: {lines[0]!r}"


def test_pyproject_build_requirement_matches_the_pin():
    cutlass = [r for r in _build_requires() if r.replace(" ", "").startswith("nvidia-cutlass")]
    assert cutlass == [f"nvidia-cutlass=={_pinned_version()}"], (
        f"pyproject.toml [build-system] requires {cutlass}, but {PIN_FILE.relative_to(ROOT)} "
        f"pins nvidia-cutlass=={_pinned_version()}: change both together"
    )


def test_every_mention_of_a_pinned_cutlass_names_the_pin():
    pinned = _pinned_version()
    skip_dirs = {".git", "build", "dist", "results", "__pycache__", "cutlass", ".site", ".whl"}
    stale = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix not in (".md", ".py", ".toml", ".txt", ".sh", ".cfg") and name != "run":
                continue
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError):
                continue
            for match in PIN_PATTERN.finditer(text):
                if match.group(1) != pinned:
                    stale.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not stale, f"these name another CUTLASS pin than nvidia-cutlass=={pinned}: {stale}"


def test_ci_installs_cutlass_from_the_pin_file():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-r third_party/cutlass_requirement.txt" in ci


def test_third_party_readme_names_the_matching_cutlass_release():
    readme = (ROOT / "third_party" / "README.md").read_text()
    release = ".".join(_pinned_version().split(".")[:3])
    assert f"nvidia-cutlass=={_pinned_version()}" in readme
    assert f"v{release}" in readme, (
        f"third_party/README.md does not name the CUTLASS tag v{release}"
    )


def test_setup_reads_the_pin():
    setup = _load_setup()
    assert setup._cutlass_requirement() == f"nvidia-cutlass=={_pinned_version()}"
    assert setup._pinned_cutlass_version() == ".".join(_pinned_version().split(".")[:3])


def _fake_cutlass_checkout(root, version=(4, 2, 0)):
    include = root / "include"
    (include / "cute").mkdir(parents=True)
    (include / "cutlass").mkdir()
    (include / "cute" / "tensor.hpp").write_text("#pragma once\n")
    (include / "cutlass" / "cutlass.h").write_text("#pragma once\n")
    (include / "cutlass" / "version.h").write_text(
        "#pragma once\n"
        f"#define CUTLASS_MAJOR {version[0]}\n#define CUTLASS_MINOR {version[1]}\n"
        f"#define CUTLASS_PATCH {version[2]}\n"
    )
    return include


@pytest.fixture
def setup_py(monkeypatch, tmp_path):
    setup = _load_setup()
    monkeypatch.delenv("CUTLASS_DIR", raising=False)
    monkeypatch.setattr(setup, "CUTLASS_CHECKOUT", tmp_path / "third_party" / "cutlass")
    return setup


def test_setup_uses_a_cutlass_checkout_in_third_party(setup_py, tmp_path):
    include = _fake_cutlass_checkout(setup_py.CUTLASS_CHECKOUT, version=(4, 2, 1))
    assert setup_py._find_cutlass() == (str(include), "third_party/cutlass")
    assert setup_py._cutlass_version(include) == "4.2.1"


def test_setup_refuses_a_third_party_cutlass_that_is_not_cutlass(setup_py):
    checkout = setup_py.CUTLASS_CHECKOUT
    (checkout / "include" / "cute").mkdir(parents=True)  # no headers in it
    with pytest.raises(SystemExit, match="is not a CUTLASS checkout"):
        setup_py._find_cutlass()


def test_setup_ignores_an_empty_third_party_cutlass(setup_py, monkeypatch):
    setup_py.CUTLASS_CHECKOUT.mkdir(parents=True)  # e.g. a submodule not checked out
    monkeypatch.setattr(setup_py.importlib.util, "find_spec", lambda name: None)
    assert setup_py._find_cutlass() is None


def test_cutlass_dir_overrides_the_checkout(setup_py, monkeypatch, tmp_path):
    _fake_cutlass_checkout(setup_py.CUTLASS_CHECKOUT)
    elsewhere = _fake_cutlass_checkout(tmp_path / "elsewhere")
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path / "elsewhere"))
    assert setup_py._find_cutlass() == (str(elsewhere.resolve()), "CUTLASS_DIR")
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path / "nothing-here"))
    with pytest.raises(SystemExit, match="CUTLASS_DIR=.* is not a CUTLASS checkout"):
        setup_py._find_cutlass()


@pytest.mark.skipif(
    importlib.util.find_spec("cutlass_library") is None,
    reason="the nvidia-cutlass wheel is not installed",
)
def test_setup_finds_the_installed_wheel(setup_py):
    include, source = setup_py._find_cutlass()
    assert source.startswith("nvidia-cutlass") and source.endswith("wheel")
    assert setup_py._cutlass_version(Path(include)) is not None
