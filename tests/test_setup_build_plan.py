"""setup.py's choices before it compiles: archs, CUTLASS, the announced build plan.

CPU only: setup.py is loaded as a module (it builds only when run as a script) and torch's
view of the GPUs is replaced by a stand-in.
"""

import re
import types
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent
NVCC_13 = {f"sm_{a}" for a in (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)}


@pytest.fixture
def setup_py(monkeypatch):
    module = load_script(ROOT / "setup.py", "flash_attn_cuda_setup_plan")
    for name in ("FLASH_ATTN_CUDA_ARCHS", "FLASH_ATTN_SKIP_CUDA_BUILD", "MAX_JOBS", "CUTLASS_DIR"):
        monkeypatch.delenv(name, raising=False)
    return module


@pytest.mark.parametrize(
    "capability, arch",
    [
        ((8, 0), "80"),
        ((8, 6), "80"),
        ((8, 9), "80"),
        ((9, 0), "90a"),
        ((10, 0), "100"),
        ((12, 0), "120"),
        ((7, 5), None),
    ],
)
def test_arch_for_each_gpu(setup_py, capability, arch):
    assert setup_py._arch_for_capability(*capability, NVCC_13) == arch


def test_a_gpu_newer_than_nvcc_stops_the_build(setup_py):
    # PTX of an older arch would run there without the waits the sm90+ launches rely on.
    with pytest.raises(SystemExit, match=r"sm_120, which this nvcc cannot compile for"):
        setup_py._arch_for_capability(12, 0, {"sm_80", "sm_90"})


def _fake_torch(*gpus):
    cuda = types.SimpleNamespace(
        is_available=lambda: bool(gpus),
        device_count=lambda: len(gpus),
        get_device_name=lambda i: gpus[i][0],
        get_device_capability=lambda i: gpus[i][1],
    )
    return types.SimpleNamespace(cuda=cuda)


def test_visible_gpus_give_one_arch_each(setup_py):
    torch = _fake_torch(("A10", (8, 6)), ("H100", (9, 0)), ("A100", (8, 0)))
    assert setup_py._visible_gpu_archs(torch, NVCC_13) == [
        ("80", "A10 (sm_86)"),
        ("90a", "H100 (sm_90)"),
    ]
    assert setup_py._visible_gpu_archs(_fake_torch(), NVCC_13) == []


def test_cpu_only_build_needs_no_cutlass(setup_py, monkeypatch):
    # CI builds with FLASH_ATTN_FORCE_CUDA_BUILD=1 in its environment; without nvcc that
    # flag turns the CPU-only fallback below into an error.
    monkeypatch.delenv("FLASH_ATTN_FORCE_CUDA_BUILD", raising=False)
    monkeypatch.setenv("FLASH_ATTN_SKIP_CUDA_BUILD", "1")
    monkeypatch.setattr(setup_py, "_find_cutlass", lambda: pytest.fail("looked for CUTLASS"))
    config = setup_py._configure()
    assert config["cuda_home"] is None and config["cutlass_include"] is None
    monkeypatch.delenv("FLASH_ATTN_SKIP_CUDA_BUILD")
    monkeypatch.setattr(setup_py, "_find_cuda_home", lambda version: (None, "no nvcc found"))
    assert setup_py._configure()["cutlass_include"] is None


def _config(setup_py, archs, hdims=None, dtypes=None):
    return {
        "archs": archs,
        "archs_source": "the default: no GPU visible to build for",
        "hdims": hdims or list(setup_py.ALL_HDIMS),
        "dtypes": dtypes or list(setup_py.ALL_DTYPES),
    }


def _sources(setup_py, hdims, dtypes):
    return (
        [f"csrc/x{i}.cpp" for i in range(19)]
        + [f"csrc/cuda/y{i}.cu" for i in range(4)]
        + [
            f"csrc/cuda/instantiations/{kernel}_hdim{d}_{dtype}.cu"
            for kernel in ("flash_fwd", "flash_bwd", "flash_fwd_splitkv")
            for d in hdims
            for dtype in dtypes
            # Above 256: the split-KV kernel, and at 512 the SM80 kernels.
            if d <= 256 or kernel == "flash_fwd_splitkv" or d == 512
        ]
    )


def _minutes(plan):
    return int(re.search(r"expect about (\d+) min", plan).group(1))


def test_plan_names_what_it_builds_and_about_how_long(setup_py, monkeypatch):
    monkeypatch.setattr(setup_py.os, "cpu_count", lambda: 2)
    config = _config(setup_py, ["80", "90a"])
    plan = setup_py._build_plan(
        config, _sources(setup_py, setup_py.ALL_HDIMS, ("fp16", "bf16")), True
    )
    assert "56 kernel files (archs sm_80,sm_90a" in plan
    assert "head dims 32,64,96,128,160,192,224,256,512,576; dtypes fp16,bf16" in plan
    assert "FLASH_ATTN_CUDA_ARCHS=90a" in plan  # how to build less
    # The README's measured times: a full 80;90a build takes 45-60 min on 2 cores, the CI's
    # 90a / 4 head dims / bf16 build about 630 s there, a full sm_90a one about 4 min on 16.
    assert 35 <= _minutes(plan) <= 65
    ci = _config(setup_py, ["90a"], [64, 96, 128, 256], ["bf16"])
    assert (
        8
        <= _minutes(
            setup_py._build_plan(ci, _sources(setup_py, [64, 96, 128, 256], ["bf16"]), True)
        )
        <= 13
    )
    monkeypatch.setattr(setup_py.os, "cpu_count", lambda: 16)
    full = _sources(setup_py, setup_py.ALL_HDIMS, ("fp16", "bf16"))
    assert 3 <= _minutes(setup_py._build_plan(_config(setup_py, ["90a"]), full, True)) <= 5


def test_plan_of_a_cpu_only_build(setup_py):
    plan = setup_py._build_plan(_config(setup_py, ["80"]), ["csrc/a.cpp", "csrc/b.cpp"], False)
    assert "2 C++ files (CPU-only)" in plan and "kernel files" not in plan


@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
def test_pair_kernels_are_built_with_their_d_qk(setup_py, kernel):
    """A specialised (d_qk, d_v) pair's file (flash_{fwd,bwd}_hdim192_dv128_*.cu)
    is selected by its d_qk and dtype, as that head dim's own files are."""
    pair = f"csrc/cuda/instantiations/flash_{kernel}_hdim192_dv128_bf16.cu"
    assert (ROOT / pair).exists()
    assert setup_py._instantiation_selected(pair, [192], ["bf16"])
    assert setup_py._instantiation_selected(pair, [128, 192], ["fp16", "bf16"])
    assert not setup_py._instantiation_selected(pair, [128], ["bf16"])
    assert not setup_py._instantiation_selected(pair, [192], ["fp16"])


def test_fp8_selects_the_e4m3_cache_kernels_of_the_q_dtypes(setup_py, monkeypatch):
    """FLASH_ATTN_CUDA_DTYPES' fp8 builds fwd_kvcache's kernels over an e4m3
    cache for the q dtypes beside it (the default has all three); fp8 alone
    names no q dtype and fails with the reason."""
    fp8kv = "csrc/cuda/instantiations/flash_fwd_splitkv_fp8kv_hdim128_bf16.cu"
    assert setup_py._instantiation_selected(fp8kv, [128], ["bf16", "fp8"])
    assert not setup_py._instantiation_selected(fp8kv, [128], ["bf16"])
    assert not setup_py._instantiation_selected(fp8kv, [128], ["fp16", "fp8"])
    assert not setup_py._instantiation_selected(fp8kv, [64], ["bf16", "fp8"])
    plain = "csrc/cuda/instantiations/flash_fwd_splitkv_hdim128_bf16.cu"
    assert setup_py._instantiation_selected(plain, [128], ["bf16", "fp8"])
    assert "fp8" in setup_py.ALL_DTYPES
    monkeypatch.setenv("FLASH_ATTN_CUDA_DTYPES", "bf16,fp8")
    assert setup_py._parse_dtypes() == ["bf16", "fp8"]
    monkeypatch.setenv("FLASH_ATTN_CUDA_DTYPES", "fp8")
    with pytest.raises(SystemExit, match="give fp16 or bf16 beside it"):
        setup_py._parse_dtypes()


def _fake_compiler(path, answer):
    """A compiler that answers `-print-file-name=libstdc++.so` with `answer`."""
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def compilers(tmp_path, monkeypatch, setup_py):
    """A default `c++` on PATH that finds only the static runtime, and a system pair that
    finds the shared one; CXX and CC unset."""
    if not setup_py.sys.platform.startswith("linux"):
        pytest.skip("the C++ runtime check runs on Linux only")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_compiler(bin_dir / "c++", "libstdc++.so")
    good = _fake_compiler(tmp_path / "g++", "/usr/lib/libstdc++.so")
    good_cc = _fake_compiler(tmp_path / "gcc", "/usr/lib/libstdc++.so")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    for name in ("CXX", "CC"):
        # Set, then unset: monkeypatch then restores the variable the function sets.
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setattr(setup_py, "SHARED_RUNTIME_COMPILERS", ((good, good_cc),))
    return good, good_cc


def test_static_runtime_compiler_is_replaced_when_unset(setup_py, compilers, capsys):
    setup_py._use_shared_cxx_runtime()
    assert (setup_py.os.environ["CXX"], setup_py.os.environ["CC"]) == compilers
    assert "finds no shared libstdc++; building with CXX=" in capsys.readouterr().err


def test_static_runtime_compiler_named_by_the_user_is_kept_with_a_warning(
    setup_py, compilers, monkeypatch, capsys
):
    monkeypatch.setenv("CXX", "c++")
    setup_py._use_shared_cxx_runtime()
    assert setup_py.os.environ["CXX"] == "c++" and "CC" not in setup_py.os.environ
    assert "WARNING" in capsys.readouterr().err


def test_static_runtime_without_an_alternative_warns(setup_py, compilers, monkeypatch, capsys):
    monkeypatch.setattr(setup_py, "SHARED_RUNTIME_COMPILERS", (("/nonexistent/g++", "/x/gcc"),))
    setup_py._use_shared_cxx_runtime()
    assert "CXX" not in setup_py.os.environ
    assert "WARNING" in capsys.readouterr().err


def test_shared_runtime_compiler_is_left_alone(setup_py, compilers, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path / "shared-c++", "/usr/lib/libstdc++.so"))
    setup_py._use_shared_cxx_runtime()
    assert "CC" not in setup_py.os.environ
    assert capsys.readouterr().err == ""
