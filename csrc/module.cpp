// The Python module flash_attn_cuda._C.
//
// The ops are not reached through this module: every translation unit registers
// its schemas or kernels with the torch dispatcher from static initializers,
// which run when Python loads the shared object. The module itself only says
// what the build contains, so that Python can tell a CPU-only build from one
// with CUDA kernels without calling an op.
#include <Python.h>

// Written by setup.py; absent when this file is compiled some other way.
#if __has_include("flash_attn_cuda_build_info.h")
#include "flash_attn_cuda_build_info.h"
#endif

#ifndef FLASH_ATTN_CUDA_BUILT
#define FLASH_ATTN_CUDA_BUILT 0
#endif
#ifndef FLASH_ATTN_BUILD_INFO
#define FLASH_ATTN_BUILD_INFO "unknown (not built by setup.py)"
#endif
#ifndef FLASH_ATTN_VERSION
#define FLASH_ATTN_VERSION "unknown"
#endif

namespace {

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Compiled part of flash_attn_cuda: registers the torch.ops.flash_attn.* kernels.\n\n"
    "cuda_built: whether the CUDA kernels were compiled in.\n"
    "build_info: CUDA version, archs, head dims and dtypes of this build (or why it is CPU-only).",
    -1,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) {
    return nullptr;
  }
  PyObject* cuda_built = FLASH_ATTN_CUDA_BUILT ? Py_True : Py_False;
  if (PyModule_AddObjectRef(module, "cuda_built", cuda_built) < 0 ||
      PyModule_AddStringConstant(module, "build_info", FLASH_ATTN_BUILD_INFO) < 0 ||
      PyModule_AddStringConstant(module, "__version__", FLASH_ATTN_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
