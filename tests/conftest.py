"""Shared pytest setup.

* tests/ is put on sys.path so that test modules can `import reference`.
* Run from a checkout whose flash_attn_cuda/ has no built extension (after
  `pip install .`, not `-e .`), the tests use the installed package: the
  checkout's folder is taken off sys.path, where it would shadow the install.
  With no installed package either, the run stops with the package's message
  on how to build it. PACKAGE_PARENT is the folder the tests import
  flash_attn_cuda from, for the tests that start another Python.
* Every test starts from its own seed (derived from its node id), so a failure
  reproduces when the test is rerun alone; FLASH_ATTN_TEST_SEED shifts all
  seeds to draw different inputs.
* Tests marked `cuda` are skipped, with a reason, when no GPU is available.
* Under pytest-xdist each worker runs torch on its share of the CPU cores.
* FLASH_ATTN_TEST_GPUS=0,1 with pytest-xdist (`-n 8`) spreads the workers over those
  GPUs, worker i on GPU i mod their count: a machine of several GPUs runs the CUDA
  files in a fraction of the time (4 workers per GPU, as on one).
* On a build with a reduced kernel set (FLASH_ATTN_CUDA_HDIMS / _DTYPES), a
  CUDA test whose call the build refuses because it left that head dim or
  dtype out is reported as skipped, with the refusal as its reason. On a build
  of every kernel the same error stays a failure: nothing may be missing there.
"""

import importlib.machinery
import importlib.util
import os
import random
import sys
import zlib

import pytest
import torch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
ROOT = os.path.dirname(TESTS_DIR)

from reduced_build import left_out_reason  # noqa: E402


def worker_gpu(worker, gpus):
    """The GPU an xdist worker ("gw5") takes from a list ("0,1"); None: leave it be."""
    choices = [g.strip() for g in (gpus or "").split(",") if g.strip()]
    if not worker or not worker.startswith("gw") or not choices:
        return None
    return choices[int(worker[2:]) % len(choices)]


# Before anything initialises CUDA, which reads CUDA_VISIBLE_DEVICES once.
_gpu = worker_gpu(os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("FLASH_ATTN_TEST_GPUS"))
if _gpu is not None:
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpu

# xdist workers share the machine's cores. Left alone, each worker's torch starts a
# thread per core for its CPU work (the references' Philox masks, their float64
# attention), N workers N times too many threads; each takes its share instead.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def _built_in_place():
    package = os.path.join(ROOT, "flash_attn_cuda")
    return any(
        os.path.exists(os.path.join(package, "_C" + suffix))
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def _choose_package():
    """(folder holding the flash_attn_cuda to test, why the run cannot start or None).

    `python3 -m pytest` from the checkout puts the checkout first on sys.path. Without an
    in-place build its flash_attn_cuda/ cannot load, and would hide an installed copy.
    """
    if not _built_in_place():
        root = os.path.realpath(ROOT)
        unshadowed = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("flash_attn_cuda", unshadowed)
        if spec is not None and spec.origin:
            sys.path[:] = unshadowed
            return os.path.dirname(os.path.dirname(spec.origin)), None
    try:
        import flash_attn_cuda
    except ImportError as exc:
        return None, str(exc)
    return os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_cuda.__file__))), None


PACKAGE_PARENT, _PACKAGE_ERROR = _choose_package()

HAS_CUDA = torch.cuda.is_available()
CUDA_SKIP_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def _build_info():
    try:
        import flash_attn_cuda
    except ImportError:
        return None
    return flash_attn_cuda.build_info


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the test needs a CUDA GPU; skipped without one")


def pytest_sessionstart(session):
    # Once, instead of the same ImportError in every test file that imports the package.
    if _PACKAGE_ERROR is not None:
        pytest.exit(_PACKAGE_ERROR, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_report_header(config):
    if PACKAGE_PARENT is not None and os.path.realpath(PACKAGE_PARENT) != os.path.realpath(ROOT):
        return (
            f"flash_attn_cuda: the installed package in {PACKAGE_PARENT} (this checkout has "
            "no in-place build)"
        )
    return None


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_cuda = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call" or call.excinfo is None or "cuda" not in item.keywords:
        return
    reason = left_out_reason(call.excinfo.value, _build_info())
    if reason is None:
        return
    report = outcome.get_result()
    report.outcome = "skipped"
    report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {reason}")


@pytest.fixture(autouse=True)
def _seed_everything(request):
    base = int(os.environ.get("FLASH_ATTN_TEST_SEED", "0"))
    seed = (base + zlib.crc32(request.node.nodeid.encode())) % (2**31)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    yield
