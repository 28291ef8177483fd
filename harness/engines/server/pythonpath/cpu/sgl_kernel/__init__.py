"""Import-only stand-in for ``sgl_kernel`` on CPU machines (no CPU build of sgl_kernel exists).

sglang imports ``sgl_kernel`` at module level even on its CPU path, which never calls it. Every name here
is a :class:`MissingKernel` that raises when called, so a CPU run that reaches a real kernel fails loudly. On
``PYTHONPATH`` on CPU topologies only. Detail: docs/modules.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+harness.cpu.shim"
HARNESS_SHIM = True


class MissingKernel:
    """A kernel that does not exist on CPU: attribute access chains, calling raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "MissingKernel":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingKernel(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self._name} was called, but sgl_kernel is the harness's import-only CPU shim; "
            "this code path needs the real sgl_kernel (a GPU build)"
        )

    def __repr__(self) -> str:
        return f"<MissingKernel {self._name}>"


def _module_getattr(modname: str):
    def __getattr__(attr: str) -> MissingKernel:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingKernel(f"{modname}.{attr}")

    return __getattr__


class _ShimSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``sgl_kernel.<sub>`` importable as another shim module."""

    def find_spec(self, name, path, target=None):
        if not name.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__getattr__ = _module_getattr(module.__name__)


__getattr__ = _module_getattr(__name__)
sys.meta_path.append(_ShimSubmodules())
