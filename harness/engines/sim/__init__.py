"""The simulated engine: sglang's real prefill and decode objects (pools, allocators, the prealloc queue, the
radix cache) driven in rank processes over Ray, with the KV transfer, the driver loop and the ledger.

Ranks: ``prefill_rank`` / ``decode_rank`` (the Ray payloads), ``payload``, ``ranks``, ``deploy`` (placing them).
sglang's objects in process: ``decode_side`` (:class:`DecodeSide`), ``decode_types``, ``prefill_side``,
``pd_decode_side``, ``pools``, ``snapshot``, ``requests``, ``rank_runtime``. The run: ``workload``, ``kvfill``,
``kv_transfer``, ``peer`` (rank-to-rank transport), ``driver``, ``sim_soak``. The names below load on first use,
after the target.
"""

from __future__ import annotations

import importlib
from typing import Any

from harness.targets.sglang import selection as _target

_LAZY = {
    "DecodeConfig": "decode_types",
    "DecodeSide": "decode_side",
    "PreallocResult": "decode_types",
    "PreallocFailed": "decode_types",
    "PoolSnapshot": "snapshot",
    "ReqState": "snapshot",
    "PoolSizes": "pools",
    "SWA_PAGE_SIZES": "pools",
    "HISPARSE_PAGE_SIZES": "pools",
    "make_req": "requests",
    "mark_finished": "requests",
    "publish": "rank_runtime",
    "RuntimeSettings": "rank_runtime",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _target.current()  # the target goes first on the import path, before the module below imports sglang
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
