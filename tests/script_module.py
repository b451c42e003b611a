"""A script of the repository (setup.py, a benchmark, a code generator) loaded as a
module, so that a test can call its functions without running it as a script."""

import importlib.util
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
