"""Builds flash_attn_cuda: one extension module, flash_attn_cuda._C.

The C++ API layer and the CPU kernels are always built. The CUDA kernels are
built too when a CUDA toolkit is found (and FLASH_ATTN_SKIP_CUDA_BUILD is not
"1"); otherwise every CUDA op is registered as a stub that raises a clear error.

Environment switches (see README.md and MAX_JOBS.md):
  FLASH_ATTN_SKIP_CUDA_BUILD=1     CPU-only build, even if nvcc is present.
  FLASH_ATTN_FORCE_CUDA_BUILD=1    fail instead of falling back to CPU-only.
  FLASH_ATTN_CUDA_ARCHS="80;90a"   one -gencode per entry ("90a" is sm_90a, which
                                   the Hopper kernels need). Default: the archs of
                                   the GPUs torch sees, else 80;90a.
  FLASH_ATTN_CUDA_HDIMS=64,128     head dims to instantiate (default: all).
  FLASH_ATTN_CUDA_DTYPES=bf16      dtypes to instantiate (default: fp16,bf16,fp8;
                                   fp8: the KV-cache kernel over an e4m3 cache,
                                   for each q dtype selected beside it).
  FLASH_ATTN_PTXAS_VERBOSE=1       print registers / spills per kernel.
  FLASH_ATTN_NVCC_THREADS=N        nvcc --threads (archs of one file in parallel).
  FLASH_ATTN_CXX_STD=c++17         C++ standard of the files with torch headers
                                   (default: the one torch's headers demand).
  MAX_JOBS=N                       parallel compile jobs (default: what RAM allows).
  CUDA_HOME                        where the CUDA toolkit lives.
  CUTLASS_DIR                      a CUTLASS checkout to build against instead of
                                   third_party/cutlass or the pinned nvidia-cutlass
                                   wheel (third_party/README.md).
"""

import glob
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# The one pin of the CUTLASS version, and where a CUTLASS checkout may be placed (third_party/README.md).
CUTLASS_REQUIREMENT_FILE = ROOT / "third_party" / "cutlass_requirement.txt"
CUTLASS_CHECKOUT = ROOT / "third_party" / "cutlass"
PACKAGE = "flash_attn_cuda"
# The CUDA op entry points of a build without CUDA: a stub that raises.
CUDA_STUB_SOURCE = "csrc/cuda/ops/flash_api_nocuda.cpp"
# Plain C++ under csrc/cuda/ that a build without CUDA compiles too: the kernel
# plans and the debug ops that describe them (tests/test_plan.py).
CPU_BUILD_PLAN_SOURCES = ["csrc/cuda/launch/plan.cpp", "csrc/cuda/ops/plan_debug_ops.cpp"]


def _package_version() -> str:
    """The version, from its one definition: __version__ in the package's __init__.py."""
    text = (ROOT / PACKAGE / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f'{PACKAGE}/__init__.py defines no __version__ = "..." line')
    return match.group(1)


VERSION = _package_version()

# 512 and 576: the split-KV (fwd_kvcache) kernel only (csrc/cuda/generate_instantiations.py).
ALL_HDIMS = (32, 64, 96, 128, 160, 192, 224, 256, 512, 576)
# fp8: fwd_kvcache's split-KV kernel over a float8_e4m3fn cache (docs/fp8.md),
# built for the q dtypes selected beside it.
ALL_DTYPES = ("fp16", "bf16", "fp8")
# sm_90a (not sm_90): the Hopper forward kernel uses wgmma, which only the
# arch-specific target has; sm_90a machine code runs on every sm90 GPU. The default when
# FLASH_ATTN_CUDA_ARCHS is unset and torch sees no GPU to build for.
DEFAULT_ARCHS = "80;90a"

# CPU seconds of one compile job for one arch, from the per-file measurements in
# MAX_JOBS.md (2-core machine): the instantiation files by kernel, the other .cu files,
# a C++ file with the torch (and CUDA) headers, and one of a CPU-only build (13 files in
# 85 s on 2 cores). Each further arch adds a share of a file's time (device code only:
# the host pass and the preprocessing run once).
JOB_CPU_SECONDS = {
    "flash_bwd": 80,
    "flash_fwd_splitkv": 45,
    "flash_fwd": 50,
    "cu": 30,
    "cpp": 23,
    "cpu_only_cpp": 13,
}
EXTRA_ARCH_SHARE = 0.6
# Ends build_info when FLASH_ATTN_CUDA_HDIMS / _DTYPES left kernels out.
REDUCED_KERNEL_SET_MARK = "reduced kernel set"

# Memory to budget per parallel compile job when picking a default MAX_JOBS: the
# largest peak measured (MAX_JOBS.md: a backward instantiation file, 4.5 GiB; a C++
# file with the torch headers, 1.0 GiB) plus headroom.
GIB_PER_CUDA_JOB = 5.5
GIB_PER_CXX_JOB = 1.5


def _fail(message: str) -> NoReturn:
    sys.exit(f"error: {message}")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _split_list(value: str) -> list[str]:
    return [item.strip() for item in re.split(r"[;,\s]+", value) if item.strip()]


# ---------------------------------------------------------------------------
# Build selection from the environment
# ---------------------------------------------------------------------------


def _parse_archs(default: str = DEFAULT_ARCHS) -> list[str]:
    """FLASH_ATTN_CUDA_ARCHS (else `default`) -> list like ["80", "90a"]."""
    archs = []
    for item in _split_list(os.environ.get("FLASH_ATTN_CUDA_ARCHS", default)):
        arch = item.lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            _fail(
                f"FLASH_ATTN_CUDA_ARCHS: '{item}' is not a CUDA arch; expected e.g. '80;90' or '90a'"
            )
        if arch not in archs:
            archs.append(arch)
    if not archs:
        _fail("FLASH_ATTN_CUDA_ARCHS is empty; expected e.g. '80;90'")
    return archs


def _parse_hdims() -> list[int]:
    value = os.environ.get("FLASH_ATTN_CUDA_HDIMS", "all").strip()
    if value.lower() in ("", "all"):
        return list(ALL_HDIMS)
    hdims = []
    for item in _split_list(value):
        if not item.isdigit() or int(item) not in ALL_HDIMS:
            _fail(f"FLASH_ATTN_CUDA_HDIMS: '{item}' is not one of {','.join(map(str, ALL_HDIMS))}")
        if int(item) not in hdims:
            hdims.append(int(item))
    return sorted(hdims)


def _parse_dtypes() -> list[str]:
    value = os.environ.get("FLASH_ATTN_CUDA_DTYPES", "all").strip().lower()
    if value in ("", "all"):
        return list(ALL_DTYPES)
    aliases = {
        "fp16": "fp16",
        "float16": "fp16",
        "half": "fp16",
        "bf16": "bf16",
        "bfloat16": "bf16",
        "fp8": "fp8",
        "float8_e4m3fn": "fp8",
    }
    dtypes = []
    for item in _split_list(value):
        if item not in aliases:
            _fail(f"FLASH_ATTN_CUDA_DTYPES: '{item}' is not one of fp16,bf16,fp8")
        if aliases[item] not in dtypes:
            dtypes.append(aliases[item])
    if dtypes == ["fp8"]:
        _fail(
            "FLASH_ATTN_CUDA_DTYPES: fp8 (the KV-cache kernel over an e4m3 cache) is built "
            "for q's dtype: give fp16 or bf16 beside it, e.g. bf16,fp8"
        )
    return [d for d in ALL_DTYPES if d in dtypes]


# ---------------------------------------------------------------------------
# Toolchain discovery
# ---------------------------------------------------------------------------


def _is_toolkit(path: str | Path | None) -> bool:
    """A CUDA toolkit root: bin/nvcc, the runtime headers and the runtime library."""
    if not path:
        return False
    root = Path(path)
    has_lib = any((root / lib).is_dir() for lib in ("lib64", "lib", "targets"))
    return (
        (root / "bin" / "nvcc").is_file()
        and (root / "include" / "cuda_runtime.h").is_file()
        and has_lib
    )


def _toolkit_reported_by(nvcc: str) -> str | None:
    """Ask nvcc where it lives: a dry run prints the directory of the real binary.

    This sees through wrapper scripts and symlinks placed outside the toolkit
    (from which torch would guess a CUDA_HOME that has no lib64).
    """
    try:
        dry_run = subprocess.run(
            [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (dry_run.stdout + dry_run.stderr).splitlines():
        match = re.match(r"#\$ (?:_HERE_|TOP)=(.+)", line.strip())
        if match:
            bin_dir = Path(match.group(1).strip())
            root = (bin_dir.parent if bin_dir.name == "bin" else bin_dir).resolve()
            if _is_toolkit(root):
                return str(root)
    return None


def _nvcc_version(cuda_home: str) -> str | None:
    try:
        text = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", text)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _nvcc_gpu_codes(cuda_home: str) -> set[str] | None:
    """The machine-code targets this nvcc can compile for ({"sm_80", "sm_90", ...}), or
    None when it does not say (an nvcc older than --list-gpu-code)."""
    try:
        text = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-code"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    codes = set(re.findall(r"\bsm_\d+[af]?\b", text))
    return codes or None


def _arch_for_capability(major: int, minor: int, nvcc_codes: set[str] | None) -> str | None:
    """The arch to compile for a GPU of compute capability major.minor; None below sm80.

    sm_80 machine code runs on every 8.x GPU (A10, RTX 30xx / 40xx, L4, L40), so one arch
    serves them all. sm90 gets sm_90a, for the Hopper kernels. A newer GPU runs the sm80
    kernel design, but sm_80 machine code does not run across a major version, and PTX
    for an older arch would be wrong there (the plan launches the split-KV combine as a
    programmatic dependent from sm90 on, which PTX for sm80 does not wait for). So it gets
    machine code for its own arch, which this nvcc must be able to produce.
    """
    if major < 8:
        return None
    if major == 8:
        return "80"
    if (major, minor) == (9, 0):
        return "90a"
    native = f"{major}{minor}"
    if nvcc_codes is not None and f"sm_{native}" not in nvcc_codes:
        _fail(
            f"a visible GPU is sm_{native}, which this nvcc cannot compile for (it knows "
            f"{', '.join(sorted(nvcc_codes))}); use a newer CUDA toolkit, or set "
            "FLASH_ATTN_CUDA_ARCHS to the archs to build"
        )
    return native


def _visible_gpu_archs(torch: ModuleType, nvcc_codes: set[str] | None) -> list[tuple[str, str]]:
    """[(arch, "GPU name (sm_XY)")] for each GPU torch sees, one entry per arch."""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = [
            (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(count)
        ]
    except Exception as exc:  # a driver problem: build as if no GPU were there
        print(f"flash_attn_cuda: cannot query the GPUs ({exc})", file=sys.stderr)
        return []
    found: dict[str, str] = {}
    for name, (major, minor) in gpus:
        arch = _arch_for_capability(major, minor, nvcc_codes)
        if arch is None:
            print(
                f"flash_attn_cuda: {name} (sm_{major}{minor}) is older than sm80: "
                "no kernels for it",
                file=sys.stderr,
            )
        elif arch not in found:
            found[arch] = f"{name} (sm_{major}{minor})"
    return sorted(found.items(), key=lambda item: int(item[0].rstrip("af")))


def _find_cuda_home(torch_cuda_version: str | None) -> tuple[str | None, str | None]:
    """Returns (cuda_home or None, reason when None)."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        configured = os.environ.get(variable)
        if configured:
            if _is_toolkit(configured):
                return str(Path(configured).resolve()), None
            _fail(
                f"{variable}={configured} is not a CUDA toolkit (no bin/nvcc, include/cuda_runtime.h "
                f"or lib64 there); point it at the toolkit root, unset it, or set "
                f"FLASH_ATTN_SKIP_CUDA_BUILD=1 for a CPU-only build"
            )

    nvcc_on_path = shutil.which("nvcc")
    if nvcc_on_path:
        resolved_root = Path(nvcc_on_path).resolve().parent.parent
        if _is_toolkit(resolved_root):
            return str(resolved_root), None
        reported_root = _toolkit_reported_by(nvcc_on_path)
        if reported_root:
            return reported_root, None

    # No usable nvcc on PATH: look at the usual install locations, preferring
    # the toolkit whose major version matches the one torch was built with.
    candidates = [Path("/usr/local/cuda"), Path("/opt/cuda")]
    candidates += sorted((Path(p) for p in glob.glob("/usr/local/cuda-*")), reverse=True)
    toolkits = [str(p.resolve()) for p in candidates if _is_toolkit(p)]
    if torch_cuda_version:
        torch_major = torch_cuda_version.split(".")[0]
        matching = [t for t in toolkits if (_nvcc_version(t) or "").split(".")[0] == torch_major]
        toolkits = matching + [t for t in toolkits if t not in matching]
    if toolkits:
        return toolkits[0], None
    return None, "no nvcc found (put it on PATH or set CUDA_HOME)"


def _torch_bundled_cuda_includes(cuda_home: str, torch_cuda_version: str | None) -> list[str]:
    """Headers of the CUDA math libraries (cusparse.h, cublas_v2.h, ...) when the toolkit lacks them.

    ATen/cuda/CUDAContext.h includes them. A minimal toolkit (nvcc and the runtime only)
    does not ship them, but the CUDA build of torch depends on wheels under site-packages/nvidia/
    that do. They go last on the include path, so that the toolkit's own headers win.
    """
    if (Path(cuda_home) / "include" / "cusparse.h").is_file():
        return []
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    major = (torch_cuda_version or "").split(".")[0]
    found = []
    for location in spec.submodule_search_locations:
        headers = sorted(Path(location).glob("*/include/cusparse.h"))
        # Prefer the folder for torch's CUDA major version (nvidia/cu13/include).
        headers.sort(key=lambda h: h.parent.parent.name != f"cu{major}")
        found += [str(h.parent) for h in headers[:1]]
    return found[:1]


def _cutlass_requirement() -> str | None:
    """The pinned nvidia-cutlass requirement ("nvidia-cutlass==X"), from the one file that pins it."""
    try:
        lines = CUTLASS_REQUIREMENT_FILE.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            return line
    return None


def _pinned_cutlass_version() -> str | None:
    """The CUTLASS release of the pinned wheel: "4.2.0" for nvidia-cutlass==4.2.0.0."""
    match = re.fullmatch(
        r"nvidia-cutlass\s*==\s*(\d+)\.(\d+)\.(\d+)(?:\.\d+)*", _cutlass_requirement() or ""
    )
    return ".".join(match.groups()) if match else None


def _is_cutlass_include(include: Path) -> bool:
    """A CUTLASS include tree: the CuTe and CUTLASS headers the kernels include, and the version header."""
    return all(
        (include / header).is_file()
        for header in ("cute/tensor.hpp", "cutlass/cutlass.h", "cutlass/version.h")
    )


def _cutlass_version(include: Path) -> str | None:
    """CUTLASS_MAJOR.MINOR.PATCH from the tree's cutlass/version.h."""
    try:
        text = (include / "cutlass" / "version.h").read_text()
    except OSError:
        return None
    parts = [
        re.search(rf"#define\s+CUTLASS_{name}\s+(\d+)", text)
        for name in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(part.group(1) for part in parts) if all(parts) else None


def _find_cutlass() -> tuple[str, str] | None:
    """(include directory, where it came from) of the CUTLASS headers, or None when there are none.

    In order: CUTLASS_DIR, a checkout in third_party/cutlass, the pinned
    nvidia-cutlass wheel (third_party/README.md). A CUTLASS_DIR or a non-empty
    third_party/cutlass that is not a CUTLASS tree stops the build: it was put
    there to be used, so falling back silently would build against other headers.
    """
    configured = os.environ.get("CUTLASS_DIR")
    if configured:
        for candidate in (Path(configured) / "include", Path(configured)):
            if _is_cutlass_include(candidate):
                return str(candidate.resolve()), "CUTLASS_DIR"
        _fail(
            f"CUTLASS_DIR={configured} is not a CUTLASS checkout: it has no include/cute/tensor.hpp, "
            "include/cutlass/cutlass.h and include/cutlass/version.h; point it at the root of one"
        )
    if CUTLASS_CHECKOUT.is_dir() and any(CUTLASS_CHECKOUT.iterdir()):
        include = CUTLASS_CHECKOUT / "include"
        if _is_cutlass_include(include):
            return str(include), "third_party/cutlass"
        _fail(
            f"{CUTLASS_CHECKOUT} is not a CUTLASS checkout: it has no include/cute/tensor.hpp, "
            "include/cutlass/cutlass.h and include/cutlass/version.h. Put a CUTLASS checkout "
            "there (third_party/README.md says which tag), or remove the folder to build with "
            "the pinned nvidia-cutlass wheel"
        )
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            include = Path(location) / "source" / "include"
            if _is_cutlass_include(include):
                try:
                    source = f"nvidia-cutlass {importlib.metadata.version('nvidia-cutlass')} wheel"
                except importlib.metadata.PackageNotFoundError:
                    source = "nvidia-cutlass wheel"
                return str(include), source
    return None


def _nvcc_threads() -> int:
    value = os.environ.get("FLASH_ATTN_NVCC_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 1 else 1


def _default_max_jobs(building_cuda: bool) -> int | None:
    """Parallel compile jobs that fit in the available memory (MAX_JOBS overrides)."""
    # nvcc --threads N runs N device compilers of one file at once.
    gib_per_job = GIB_PER_CUDA_JOB * _nvcc_threads() if building_cuda else GIB_PER_CXX_JOB
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available_gib = int(fields["MemAvailable"].split()[0]) / (1024 * 1024)
    except (OSError, KeyError, ValueError):
        return None
    return max(1, min(os.cpu_count() or 1, int(available_gib / gib_per_job)))


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


def _sources(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern, root_dir=ROOT, recursive=True))


def _instantiation_selected(path: str, hdims: Sequence[int], dtypes: Sequence[str]) -> bool:
    name = Path(path).stem
    hdim = re.search(r"hdim(\d+)", name)
    if hdim and int(hdim.group(1)) not in hdims:
        return False
    dtype = re.search(r"(?:^|_)(fp16|bf16)(?:_|$)", name)
    if dtype and dtype.group(1) not in dtypes:
        return False
    # The e4m3-cache kernels: their q dtype and fp8 both selected.
    if "_fp8kv_" in name and "fp8" not in dtypes:
        return False
    return True


def _write_if_changed(path: Path, text: str) -> None:
    # Rewriting an unchanged header would make ninja rebuild module.cpp every time.
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def _configure() -> dict[str, Any]:
    import torch

    hdims, dtypes = _parse_hdims(), _parse_dtypes()

    cuda_home, cpu_only_reason = None, None
    if _env_flag("FLASH_ATTN_SKIP_CUDA_BUILD"):
        cpu_only_reason = "FLASH_ATTN_SKIP_CUDA_BUILD=1"
    elif torch.version.cuda is None:
        cpu_only_reason = f"the installed torch {torch.__version__} is built without CUDA"
    else:
        cuda_home, cpu_only_reason = _find_cuda_home(torch.version.cuda)

    # Only a CUDA build reads the archs: a CPU-only one needs neither a GPU nor nvcc.
    archs, archs_source = _parse_archs(), "FLASH_ATTN_CUDA_ARCHS"
    if cuda_home and "FLASH_ATTN_CUDA_ARCHS" not in os.environ:
        visible = _visible_gpu_archs(torch, _nvcc_gpu_codes(cuda_home))
        if visible:
            archs = [arch for arch, _ in visible]
            archs_source = "the visible GPUs: " + ", ".join(gpu for _, gpu in visible)
        else:
            archs_source = "the default: no GPU visible to build for"

    cutlass_include, cutlass_source, cutlass_version = None, None, None
    if cuda_home:
        found = _find_cutlass()
        if found is None:
            requirement = _cutlass_requirement() or "nvidia-cutlass"
            _fail(
                f"CUTLASS headers not found: run `pip install -r third_party/cutlass_requirement.txt` "
                f"(it pins {requirement}), or place a CUTLASS checkout in third_party/cutlass or set "
                f"CUTLASS_DIR to one (third_party/README.md), or set FLASH_ATTN_SKIP_CUDA_BUILD=1 for "
                f"a CPU-only build."
            )
        cutlass_include, cutlass_source = found
        cutlass_version = _cutlass_version(Path(cutlass_include))
        pinned = _pinned_cutlass_version()
        if pinned and cutlass_version != pinned:
            print(
                f"flash_attn_cuda: WARNING: building against CUTLASS {cutlass_version or '(unknown version)'} "
                f"from {cutlass_source} ({cutlass_include}), but third_party/cutlass_requirement.txt pins "
                f"CUTLASS {pinned}, the version this project is tested with.",
                file=sys.stderr,
            )
    elif _env_flag("FLASH_ATTN_FORCE_CUDA_BUILD") and not _env_flag("FLASH_ATTN_SKIP_CUDA_BUILD"):
        _fail(
            f"FLASH_ATTN_FORCE_CUDA_BUILD=1 but the CUDA kernels cannot be built: {cpu_only_reason}"
        )

    if cuda_home:
        # torch.utils.cpp_extension reads CUDA_HOME once, at import; both must name the real toolkit.
        os.environ["CUDA_HOME"] = cuda_home
        # Our own -gencode flags already contain "arch", which makes torch add none of its own;
        # the matching list keeps any other torch code path consistent with them.
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
            f"{a[:-1]}.{a[-1]}" if a[-1].isdigit() else f"{a[:-2]}.{a[-2:]}" for a in archs
        )
    import torch.utils.cpp_extension as cpp_extension

    if cuda_home:
        cpp_extension.CUDA_HOME = cuda_home

    return {
        "torch": torch,
        "cpp_extension": cpp_extension,
        "cuda_home": cuda_home,
        "cuda_version": _nvcc_version(cuda_home) if cuda_home else None,
        "cpu_only_reason": cpu_only_reason,
        "cutlass_include": cutlass_include,
        "cutlass_source": cutlass_source,
        "cutlass_version": cutlass_version,
        "extra_cuda_includes": _torch_bundled_cuda_includes(cuda_home, torch.version.cuda)
        if cuda_home
        else [],
        "archs": archs,
        "archs_source": archs_source,
        "hdims": hdims,
        "dtypes": dtypes,
    }


def _host_cxx_standard() -> str:
    """The C++ standard of the translation units that include torch headers.

    It must be the one torch itself was built with: inline torch classes can
    differ between standards, and an extension built with another one can
    crash when an exception crosses into libtorch (seen with torch 2.11 built
    as C++17 and this extension as C++20: every TORCH_CHECK raised on CUDA
    killed the process). torch 2.14's headers demand C++20; older releases
    are C++17. FLASH_ATTN_CXX_STD overrides.
    """
    override = os.environ.get("FLASH_ATTN_CXX_STD", "").strip()
    if override:
        return override
    import torch

    # torch's own headers say which standard they demand (ATen.h: "#error C++20 or later
    # compatible compiler is required"); the release number is the fallback.
    aten_header = Path(torch.__file__).parent / "include" / "ATen" / "ATen.h"
    try:
        demanded = re.search(r"C\+\+(\d+) or later compatible compiler", aten_header.read_text())
    except OSError:
        demanded = None
    if demanded:
        return f"c++{demanded.group(1)}"
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


# Compilers (C++, C) tried in turn when the default one would link a static C++ runtime
# and neither CXX nor CC is set: the system's, whose runtime is the shared one.
SHARED_RUNTIME_COMPILERS = (("/usr/bin/g++", "/usr/bin/gcc"),)


def _links_shared_cxx_runtime(cxx: str) -> bool | None:
    """Whether `cxx` finds a shared libstdc++ (`-print-file-name=libstdc++.so` answers a
    path, not the bare name); None when it cannot be asked."""
    try:
        found = subprocess.run(
            [cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(found) and os.path.isabs(found)


def _use_shared_cxx_runtime() -> None:
    """Keeps the extension on the shared C++ runtime.

    A compiler that finds no shared libstdc++ links its static archive into _C.so. The
    process then holds two C++ runtimes, torch's shared one and the extension's copy, and
    formatting a number into a stream inside the extension crashes: an argument check that
    should raise (TORCH_CHECK with a number in its message) kills the process instead.
    Seen with a g++ whose installation ships only libstdc++.a (the default compiler of a
    GPU machine here). When neither CXX nor CC is set, the build then takes the first of
    SHARED_RUNTIME_COMPILERS that links the shared runtime, for both the host code and
    nvcc's host compiler, and says so; otherwise it warns.
    """
    if not sys.platform.startswith("linux"):
        return
    cxx = os.environ.get("CXX", "c++")
    if _links_shared_cxx_runtime(cxx) is not False:
        return
    if "CXX" not in os.environ and "CC" not in os.environ:
        for alt_cxx, alt_cc in SHARED_RUNTIME_COMPILERS:
            if os.access(alt_cc, os.X_OK) and _links_shared_cxx_runtime(alt_cxx):
                os.environ["CXX"], os.environ["CC"] = alt_cxx, alt_cc
                print(
                    f"flash_attn_cuda: the default C++ compiler {cxx!r} finds no shared "
                    f"libstdc++; building with CXX={alt_cxx} and CC={alt_cc}, which do, so "
                    "that argument errors raise instead of crashing (set CXX to choose).",
                    file=sys.stderr,
                )
                return
    print(
        f"flash_attn_cuda: WARNING: the C++ compiler {cxx!r} finds no shared libstdc++ "
        "(-print-file-name=libstdc++.so gives no path), so the extension would carry a "
        "static copy of the C++ runtime beside torch's, and its argument errors can crash "
        "the process instead of raising. Set CXX (and CC) to a compiler that links the "
        "shared libstdc++, for example CXX=/usr/bin/g++.",
        file=sys.stderr,
    )


def _extension(config: dict[str, Any]) -> tuple[Any, str, bool]:
    cpp_extension = config["cpp_extension"]
    building_cuda = config["cuda_home"] is not None

    sources = _sources("csrc/*.cpp") + _sources("csrc/api/*.cpp") + _sources("csrc/cpu/*.cpp")
    sources += _sources("csrc/ops/*.cpp")  # ops of every device and build
    generated_dir = ROOT / "build" / "generated"
    include_dirs = [str(ROOT / "csrc"), str(generated_dir)]
    cxx_flags = ["-O3", f"-std={_host_cxx_standard()}"]
    link_flags = []
    if config["torch"].backends.openmp.is_available() and sys.platform.startswith("linux"):
        # With torch's OpenMP backend, at::parallel_for is an inline template that only
        # runs in parallel in translation units compiled with OpenMP. The extension then
        # needs libgomp.so.1, which resolves to the copy torch has already loaded.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")

    if building_cuda:
        # Every .cpp / .cu under csrc/cuda/ except the CPU-only stub; the
        # instantiations only for the selected head dims and dtypes.
        stub = CUDA_STUB_SOURCE
        sources += [s for s in _sources("csrc/cuda/**/*.cpp") if s != stub]
        sources += [
            s
            for s in _sources("csrc/cuda/**/*.cu")
            if not s.startswith("csrc/cuda/instantiations/")
        ]
        instantiations = _sources("csrc/cuda/instantiations/*.cu")
        sources += [
            s
            for s in instantiations
            if _instantiation_selected(s, config["hdims"], config["dtypes"])
        ]
        include_dirs.append(config["cutlass_include"])

        nvcc_flags = [
            "-O3",
            "-std=c++20",
            "-DNDEBUG",
            "--use_fast_math",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
            # torch defines these to keep its own headers off the CUDA half operators;
            # the kernels here need the operators and conversions.
            "-U__CUDA_NO_HALF_OPERATORS__",
            "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__",
            "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "-lineinfo",
            # TMA descriptors encoded through a driver entry point looked up once
            # (csrc/cuda/launch/tma_encode.cu), not once per descriptor.
            "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL",
            "-DcuTensorMapEncodeTiled=flash_attn_cuTensorMapEncodeTiled",
        ]
        # Machine code only, no PTX: a GPU whose arch was not built gets a clear
        # "no kernel image" error instead of a JIT build of older-arch PTX. That
        # also keeps an sm90 device from running sm80 code (compiled without
        # griddepcontrol.wait) as the programmatically launched split-KV combine.
        for arch in config["archs"]:
            nvcc_flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        if "90a" in config["archs"]:
            # The host side may launch the wgmma kernels: they have machine code.
            nvcc_flags += ["-DFLASH_ATTN_HAS_SM90A"]
        if _env_flag("FLASH_ATTN_PTXAS_VERBOSE"):
            nvcc_flags += ["-Xptxas", "-v"]
        if _nvcc_threads() > 1:
            nvcc_flags += ["--threads", str(_nvcc_threads())]

        build_info = (
            f"cuda {config['cuda_version'] or 'unknown'}; "
            f"archs {','.join('sm_' + a for a in config['archs'])}; "
            f"hdims {','.join(map(str, config['hdims']))}; "
            f"dtypes {','.join(config['dtypes'])}; "
            f"torch {config['torch'].__version__}; "
            f"cutlass {config['cutlass_version'] or 'unknown'} ({config['cutlass_source']})"
        )
        # The test suite reads this mark: on such a build, a call that needs a
        # left-out head dim or dtype is refused by design, and its test is skipped.
        if set(config["hdims"]) != set(ALL_HDIMS) or set(config["dtypes"]) != set(ALL_DTYPES):
            build_info += f"; {REDUCED_KERNEL_SET_MARK}"
    else:
        sources.append(CUDA_STUB_SOURCE)
        sources += CPU_BUILD_PLAN_SOURCES
        build_info = f"cpu-only ({config['cpu_only_reason']}); torch {config['torch'].__version__}"

    # The build description reaches module.cpp alone through a generated header: a -D
    # flag would go to every translation unit, and changing it would rebuild them all.
    _write_if_changed(
        generated_dir / "flash_attn_cuda_build_info.h",
        "// Generated by setup.py; describes what this build of flash_attn_cuda._C contains.\n"
        "#pragma once\n"
        f"#define FLASH_ATTN_CUDA_BUILT {1 if building_cuda else 0}\n"
        f"#define FLASH_ATTN_BUILD_INFO {_c_string(build_info)}\n"
        f"#define FLASH_ATTN_VERSION {_c_string(VERSION)}\n",
    )

    if building_cuda:
        summary = (
            f"flash_attn_cuda: building CPU + CUDA kernels with {config['cuda_home']} "
            f"({build_info}); CUTLASS from {config['cutlass_include']}"
        )
        extension = cpp_extension.CUDAExtension(
            name=f"{PACKAGE}._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
        )
        extension.include_dirs += config["extra_cuda_includes"]
    else:
        summary = f"flash_attn_cuda: building CPU-only, because {config['cpu_only_reason']}"
        extension = cpp_extension.CppExtension(
            name=f"{PACKAGE}._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return extension, summary, building_cuda


def _job_cpu_seconds(source: str, n_archs: int) -> float:
    if not source.endswith(".cu"):
        return JOB_CPU_SECONDS["cpp"]
    name = Path(source).name
    kind = next(
        (k for k in ("flash_bwd", "flash_fwd_splitkv", "flash_fwd") if name.startswith(k + "_")),
        "cu",
    )
    return JOB_CPU_SECONDS[kind] * (1 + EXTRA_ARCH_SHARE * (n_archs - 1))


def _about(seconds: float) -> str:
    if seconds < 90:
        return f"{max(10, round(seconds, -1)):.0f} s"
    return f"{round(seconds / 60)} min"


def _build_plan(config: dict[str, Any], sources: Sequence[str], building_cuda: bool) -> str:
    """What the build compiles, and about how long it takes at MAX_JOBS jobs."""
    n_archs = len(config["archs"]) if building_cuda else 1
    if building_cuda:
        job_seconds = [_job_cpu_seconds(s, n_archs) for s in sources]
    else:
        job_seconds = [JOB_CPU_SECONDS["cpu_only_cpp"]] * len(sources)
    cores = os.cpu_count() or 1
    max_jobs = os.environ.get("MAX_JOBS", "")
    parallel = max(1, min(int(max_jobs) if max_jobs.isdigit() else cores, cores))
    wall = max(sum(job_seconds) / parallel, max(job_seconds, default=0))
    if building_cuda:
        kernels = sum(s.startswith("csrc/cuda/instantiations/") for s in sources)
        what = (
            f"{kernels} kernel files (archs {','.join('sm_' + a for a in config['archs'])}, from "
            f"{config['archs_source']}; head dims {','.join(map(str, config['hdims']))}; "
            f"dtypes {','.join(config['dtypes'])}) and {len(sources) - kernels} other files"
        )
    else:
        what = f"{len(sources)} C++ files (CPU-only)"
    plan = (
        f"flash_attn_cuda: compiling {what}, {parallel} at a time: expect about {_about(wall)} "
        f"({_about(sum(job_seconds))} of CPU time; MAX_JOBS.md has measured builds)."
    )
    if building_cuda and "FLASH_ATTN_CUDA_ARCHS" not in os.environ and n_archs > 1:
        plan += (
            " A shorter build: FLASH_ATTN_CUDA_ARCHS=90a for H100/H200 only, or 80 for "
            "A100 and the other sm8x GPUs (README.md, 'Install')."
        )
    return plan


def _announce(message: str) -> None:
    """Prints to stderr and, where pip hides that, to the terminal.

    pip shows a build's output only with -v or after a failure; a build that runs for
    minutes should say so before it starts, so the plan also goes to the controlling
    terminal, when there is one and stderr is not it.
    """
    print(message, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write("\n" + message + "\n")
    except OSError:
        pass


def _build_ext_class(cpp_extension: ModuleType) -> type:
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExtension(base):
        def finalize_options(self) -> None:
            super().finalize_options()
            # One stable object directory for regular and editable installs, so that
            # ninja rebuilds only what changed (editable builds otherwise use a fresh
            # temporary directory and recompile everything).
            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = str(ROOT / "build" / f"temp.{tag}")

    return BuildExtension


def main() -> None:
    _use_shared_cxx_runtime()
    config = _configure()
    extension, summary, building_cuda = _extension(config)
    if "MAX_JOBS" not in os.environ:
        max_jobs = _default_max_jobs(building_cuda)
        if max_jobs is not None:
            os.environ["MAX_JOBS"] = str(max_jobs)
    print(f"{summary}; MAX_JOBS={os.environ.get('MAX_JOBS', 'ninja default')}", file=sys.stderr)
    # Once per pip call: pip runs setup.py again to read the metadata, before the build.
    if any(
        command.startswith(("build", "bdist", "editable", "install", "develop"))
        for command in sys.argv
    ):
        _announce(_build_plan(config, extension.sources, building_cuda))

    packages = [PACKAGE] + sorted(
        str(Path(init).parent).replace(os.sep, ".")
        for init in glob.glob(f"{PACKAGE}/*/**/__init__.py", root_dir=ROOT, recursive=True)
    )
    setup(
        packages=packages,
        ext_modules=[extension],
        cmdclass={"build_ext": _build_ext_class(config["cpp_extension"])},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
