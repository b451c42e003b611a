"""FLASH_ATTN_TEST_GPUS: which GPU each pytest-xdist worker takes (tests/conftest.py)."""

import pytest

import conftest


@pytest.mark.parametrize(
    "worker, gpus, expected",
    [
        ("gw0", "0,1", "0"),
        ("gw5", "0,1", "1"),
        ("gw6", " 2, 3 ,", "2"),
        ("gw3", "7", "7"),
        (None, "0,1", None),  # not under xdist: one process, CUDA_VISIBLE_DEVICES as set
        ("gw1", None, None),
        ("gw1", "", None),
        ("master", "0,1", None),
    ],
)
def test_worker_gpu(worker, gpus, expected):
    assert conftest.worker_gpu(worker, gpus) == expected
