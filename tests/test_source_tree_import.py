"""A checkout without an in-place build, next to an installed package (`pip install .`).

Python started in the checkout finds its flash_attn_cuda/ before the installed one. The
import must then say why it fails and what to do, and pytest run from the checkout must
test the installed package. Each case copies the package's Python files (no extension)
into a temporary checkout and starts another Python there, with the package the tests
use (PACKAGE_PARENT) standing in for the installed one.
"""

import os
import shutil
import site
import subprocess
import sys

import pytest

from conftest import PACKAGE_PARENT, ROOT


@pytest.fixture
def checkout(tmp_path):
    """A checkout with setup.py and the package's Python sources, no built extension."""
    shutil.copytree(
        os.path.join(ROOT, "flash_attn_cuda"),
        tmp_path / "flash_attn_cuda",
        ignore=shutil.ignore_patterns("_C.*", "__pycache__"),
    )
    (tmp_path / "setup.py").write_text("")
    return tmp_path


# Where torch and pytest are. The child runs with -S (no site module, so no .pth file):
# an editable install's import hook, which a .pth installs, would serve flash_attn_cuda
# from its own checkout whatever sys.path holds, so a child with it could not show what a
# plain `pip install .` does. These folders come back as plain sys.path entries.
SITE_DIRS = [d for d in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(d)]
INSTALLED_IN_SITE = any(
    os.path.isfile(os.path.join(d, "flash_attn_cuda", "__init__.py")) for d in SITE_DIRS
)


def _run(args, cwd, package_dirs):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*package_dirs, *SITE_DIRS]))
    env.pop("PYTHONSAFEPATH", None)  # it would keep the checkout off sys.path
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_import_names_the_shadowed_install_and_the_fixes(checkout):
    proc = _run(["-c", "import flash_attn_cuda"], checkout, [PACKAGE_PARENT])
    assert proc.returncode != 0
    message = proc.stderr.strip().splitlines()[-1]
    assert "circular import" not in proc.stderr
    assert "has no built extension" in message
    assert os.path.join(PACKAGE_PARENT, "flash_attn_cuda") in message
    assert "Run Python from another directory" in message
    assert "pip install --no-build-isolation -e ." in message


def test_import_without_any_install_says_to_build(checkout, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _run(["-c", "import flash_attn_cuda"], checkout, [str(empty)])
    message = proc.stderr.strip().splitlines()[-1]
    # With the package in site-packages (a plain `pip install .`) the message is the
    # previous test's; either says what is missing and how to build.
    if not INSTALLED_IN_SITE:
        assert "has not been built" in message
    assert "has no built extension" in message
    assert "pip install --no-build-isolation -e ." in message


def _copy_conftest(tests_dir):
    """The checkout's conftest.py and the module it imports."""
    for name in ("conftest.py", "reduced_build.py"):
        shutil.copy(os.path.join(ROOT, "tests", name), tests_dir)


def test_pytest_in_the_checkout_tests_the_installed_package(checkout):
    (checkout / "tests").mkdir()
    _copy_conftest(checkout / "tests")
    (checkout / "tests" / "test_where.py").write_text(
        "import flash_attn_cuda\n\n\n"
        "def test_where():\n"
        "    print('IMPORTED FROM', flash_attn_cuda.__file__)\n"
        "    assert flash_attn_cuda.build_info\n"
    )
    args = ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests"]
    proc = _run(args, checkout, [PACKAGE_PARENT])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    installed = os.path.join(PACKAGE_PARENT, "flash_attn_cuda", "__init__.py")
    assert f"IMPORTED FROM {installed}" in log


@pytest.mark.skipif(INSTALLED_IN_SITE, reason="flash_attn_cuda is installed in site-packages")
def test_pytest_without_any_install_stops_with_the_message(checkout, tmp_path):
    (checkout / "tests").mkdir()
    _copy_conftest(checkout / "tests")
    (checkout / "tests" / "test_a.py").write_text("import flash_attn_cuda\n")
    (checkout / "tests" / "test_b.py").write_text("import flash_attn_cuda\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    proc = _run(args, checkout, [str(empty)])
    log = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, log
    assert "has not been built" in log
    # Once, before collection: not one ImportError per test file.
    assert "ERROR collecting" not in log and "test_a.py" not in log, log
