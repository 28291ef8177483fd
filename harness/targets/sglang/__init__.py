"""The sglang adapter: the only package that imports sglang internals.

Importing it is cheap and changes nothing: the sglang under test (``TARGET``; ``--sglang`` / env
``HARNESS_SGLANG``: installed, a release, a source tree or a wheel, see
:mod:`~harness.targets.sglang.selection`) is resolved and put first on the import path on first use
of the API below, before any sglang import (entry points select it earlier; subprocesses inherit it
through ``PYTHONPATH``; a worker actor selects it through :func:`~harness.targets.sglang.selection.worker_spec`);
a target lacking the core the adapter drives raises :class:`~harness.targets.sglang.selection.TargetError`
(one line). Faults (``HARNESS_FAULTS``) are applied by the processes that run engine code, not by
this import: the pytest plugin, a PD rank's payload, a server's ``sitecustomize`` (:mod:`harness.faults`).

The public API is loaded lazily (sglang's import takes seconds), so ``import harness.targets.sglang``
stays cheap for code that only needs the target or a subpackage::

    DecodeConfig(hisparse=False, page_size=64, window=128, radix_cache=False, sizes=PoolSizes(),
                 device="cpu", num_reserved_decode_tokens=512, hisparse_top_k=64,
                 hisparse_device_buffer_size=128)                       # frozen, validated
    side = DecodeSide(config)          # .allocator .kv_pool .req_to_token_pool .tree_cache
                                       # .coordinator .queue .baseline (PoolSnapshot)
    side.prealloc(req) -> PreallocResult(rid, fill_len, swa_tail_len, uses_swa_tail, prefix_len,
                                         destination)   # raises PreallocFailed(rid, detail, held)
    side.release(req)                  # request_finished (hisparse) + release_kv_cache(checkpoint=True)
    side.snapshot(reqs=()) -> PoolSnapshot(full, swa, req_slots, hisparse_device, host,
                                           tree_full_evictable, tree_swa_evictable, requests)
        .free() -> {pool: free slots}   .taken_since(before) -> {pool: taken}   .request(rid) -> ReqState
    side.fill_len(req) / side.swa_tail_len(fill_len) / side.uses_swa_tail()   # sglang's own
    side.admission_budget() -> (full_budget, swa_budget | None)            # idle scheduler's budgets
    side.alloc_with_tail(req, swa_tail_len)   # real alloc_for_decode_prealloc*, caller's tail
    side.evict_cache() -> tokens evicted       # radix cache on
    make_req(rid, prompt_len, output_len=1, *, max_new_tokens=16) -> Req;  mark_finished(req)
    PoolSizes(full_tokens=12288, swa_tokens=6144, req_slots=8, max_context_len=8192)

Modules: ``selection`` (which sglang: resolve, activate, :func:`~harness.targets.sglang.selection.sglang_root`),
``version`` (a tree's version, read from its files), ``releases`` and ``compat`` (every per-release
difference: the static table, the capability probes and shims), ``runtime`` (published context,
process group, host-pool environment), ``pools`` (builders), ``requests``, ``snapshot``, ``decode``
(:class:`DecodeSide`), ``pd_decode`` and ``prefill`` (the PD ranks' sglang halves), ``preload``
(what the fork servers import ahead), ``server/`` (real sglang servers).
"""

from __future__ import annotations

import importlib
from typing import Any

from harness.targets.sglang import selection as _target
from harness.targets.sglang.selection import TargetError

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

__all__ = ["TARGET", "TargetError", *_LAZY]


def __getattr__(name: str) -> Any:
    # TARGET: the sglang under test, resolved from the environment and activated on first use (an
    # entry point has already selected it; a bare process gets $HARNESS_SGLANG or the installed one).
    if name == "TARGET":
        return _target.current()
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _target.current()  # before the module below imports sglang
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
