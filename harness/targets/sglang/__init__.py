"""The sglang adapter: the only package that imports sglang internals.

Importing it

1. checks the installed sglang (from package metadata, before any sglang import) is the supported
   version, else raises :class:`SglangVersionError` naming both versions;
2. applies the faults named in env ``HARNESS_FAULTS`` (``harness.faults``), so in-process tests,
   Ray workers and server subprocesses all run the same deliberately broken code when asked.

The public API is loaded lazily (sglang's import takes seconds), so ``import harness.targets.sglang``
stays cheap for code that only needs the version check or a subpackage:

* :class:`DecodeConfig`, :class:`DecodeSide`, :class:`PreallocResult`, :class:`PreallocFailed`
  (``decode.py``): the decode-side object graph and its prealloc / release / snapshot operations;
* :class:`PoolSnapshot`, :class:`ReqState` (``snapshot.py``);
* :class:`PoolSizes` and the builders (``pools.py``); :func:`make_req`, :func:`mark_finished`
  (``requests.py``); :func:`publish`, :class:`RuntimeSettings` (``runtime.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

from harness import faults as _faults
from harness.targets.sglang.version import SUPPORTED_VERSION, SglangVersionError, check_version

INSTALLED_VERSION = check_version()
ACTIVE_FAULTS = _faults.activate_from_env()

_LAZY = {
    "DecodeConfig": "decode",
    "DecodeSide": "decode",
    "PreallocResult": "decode",
    "PreallocFailed": "decode",
    "PoolSnapshot": "snapshot",
    "ReqState": "snapshot",
    "PoolSizes": "pools",
    "SWA_PAGE_SIZES": "pools",
    "HISPARSE_PAGE_SIZES": "pools",
    "make_req": "requests",
    "mark_finished": "requests",
    "publish": "runtime",
    "RuntimeSettings": "runtime",
}

__all__ = ["SUPPORTED_VERSION", "INSTALLED_VERSION", "ACTIVE_FAULTS", "SglangVersionError", "check_version",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
