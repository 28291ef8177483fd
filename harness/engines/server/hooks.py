"""Run a function on a module right after it is first imported (an import-time hook).

The compat patches and the accounting probe must change sglang's classes and functions *before*
any other sglang module does ``from x import f`` and keeps its own reference. In a server
process nothing of sglang is imported when ``sitecustomize`` runs, so they register a hook here and
it fires when the target module finishes executing. If the module is already imported the function
runs at once. Nothing here imports sglang.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable

_lock = threading.Lock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


class _RunAfterExec(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            funcs = _pending.pop(self._name, [])
        for fn in funcs:
            fn(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _pending:
            return None
        # Ask the rest of sys.meta_path for the real spec, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RunAfterExec(spec.loader, name)
                return spec
        return None


_finder = _Finder()


def after_import(module: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module_object)`` once ``module`` has been imported (now, if it already is).

    Args:
        module: dotted module name, e.g. ``sglang.srt.disaggregation.decode``.
        fn: called once with the executed module; its exceptions propagate to the importer, so a
            patch that no longer fits the engine fails the import loudly.
    """
    if module in sys.modules:
        fn(sys.modules[module])
        return
    with _lock:
        _pending.setdefault(module, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
