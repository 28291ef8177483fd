"""Where to look when a rule breaks: the sglang functions that decide each ledger rule and each of the
PD engine's own checks, named in the file of the *target under test*.

:data:`SUSPECTS` maps a rule or evidence class to those functions; :func:`suspects` resolves them in a
target's tree by reading source (nothing imports sglang). Detail: docs/modules.md.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

_DECODE = "srt/disaggregation/decode.py"
_BATCH = "srt/managers/schedule_batch.py"
_SWA = "srt/mem_cache/allocator/swa.py"
_COMMON = "srt/mem_cache/common.py"

_TAIL = (f"{_DECODE}:DecodePreallocQueue._swa_tail_len", f"{_DECODE}:alloc_for_decode_prealloc")
_CHARGE = (f"{_DECODE}:DecodePreallocQueue._pre_alloc", f"{_SWA}:SWATokenToKVPoolAllocator.alloc_extend_swa_tail")
_EVICT = (
    f"{_BATCH}:ScheduleBatch.maybe_evict_swa",
    f"{_BATCH}:ScheduleBatch._evict_swa",
    f"{_COMMON}:free_swa_out_of_window_slots",
)
_FREE = (
    f"{_COMMON}:release_kv_cache",
    f"{_SWA}:SWATokenToKVPoolAllocator.free",
    f"{_SWA}:SWATokenToKVPoolAllocator.free_swa",
    f"{_SWA}:SWATokenToKVPoolAllocator._free_swa_pages",
)

#: Rule or evidence class -> the sglang functions that decide it, most likely first.
SUSPECTS: dict[str, tuple[str, ...]] = {
    "swa-tail-short": _TAIL,
    "swa-tail-long": _TAIL,
    "evicted-unaligned": _TAIL,
    "evicted-negative": _TAIL,
    "evicted-mismatch": (f"{_DECODE}:alloc_for_decode_prealloc", f"{_DECODE}:DecodePreallocQueue._swa_tail_len"),
    "swa-charge": _CHARGE,
    "full-charge": _CHARGE,
    "host-charge": (f"{_DECODE}:alloc_for_decode_prealloc_hisparse",),
    "reserve-short": (f"{_DECODE}:DecodePreallocQueue._prealloc_required_tokens",),
    "admission-short": (
        f"{_DECODE}:DecodePreallocQueue._allocatable_token_budgets",
        f"{_DECODE}:DecodePreallocQueue._swa_aware_allocatable_token_budgets",
    ),
    "alloc-after-admit": (
        f"{_DECODE}:DecodePreallocQueue._pre_alloc",
        f"{_DECODE}:DecodePreallocQueue._prealloc_required_tokens",
    ),
    # the floor and the range an eviction frees are both decided there; the pages it hands to the
    # free list, in the allocator (the probe reads both)
    "swa-window-lost": (
        f"{_COMMON}:free_swa_out_of_window_slots",
        f"{_SWA}:SWATokenToKVPoolAllocator._free_swa_pages",
        f"{_BATCH}:ScheduleBatch.maybe_evict_swa",
    ),
    "swa-evict-late": _EVICT,
    "swa-over-window": _EVICT,
    "page-leak": _FREE,
    "page-double-free": _FREE,
    "page-double-alloc": (
        f"{_SWA}:SWATokenToKVPoolAllocator.alloc_extend_swa_tail",
        f"{_SWA}:SWATokenToKVPoolAllocator.free",
    ),
    "not-baseline": _FREE,
    "free-mismatch": _FREE,
    "reset-leak": ("srt/managers/scheduler.py:Scheduler.flush_cache", f"{_COMMON}:release_kv_cache"),
    # a request that never finished: decode waits on its transfer, prefill on its bootstrap
    "in-flight-at-end": (
        f"{_DECODE}:DecodeTransferQueue.pop_transferred",
        "srt/disaggregation/prefill.py:PrefillBootstrapQueue.pop_bootstrapped",
        "srt/disaggregation/common/conn.py:CommonKVManager.update_status",
    ),
    # the KV digests: what decode committed against what prefill sent, which page each write landed in,
    # and a write that landed after decode let its pages go
    "kv-content": (
        "srt/disaggregation/prefill.py:SchedulerDisaggregationPrefillMixin.send_kv_chunk",
        "srt/disaggregation/mooncake/conn.py:MooncakeKVManager.send_kvcache",
        f"{_DECODE}:DecodeTransferQueue._commit_transfer_to_req",
    ),
    "kv-write-once": (
        f"{_DECODE}:DecodePreallocQueue._send_kv_metadata",
        "srt/disaggregation/mooncake/conn.py:MooncakeKVManager.send_kvcache",
    ),
    "write-after-free": (
        f"{_DECODE}:DecodeTransferQueue.resolve_deferred_releases",
        "srt/disaggregation/common/conn.py:CommonKVManager._maybe_ack_drained_abort",
    ),
    # the PD engine's own checks of every byte and window position it keeps
    "WindowLost": (*_EVICT, *_TAIL),
    "KVCorruption": (f"{_DECODE}:alloc_for_decode_prealloc", f"{_SWA}:SWATokenToKVPoolAllocator.alloc_extend_swa_tail"),
    # the tail it was asked to allocate is _swa_tail_len's (a negative one is refused)
    "PreallocError": (
        f"{_DECODE}:DecodePreallocQueue._pre_alloc",
        f"{_DECODE}:alloc_for_decode_prealloc",
        f"{_DECODE}:DecodePreallocQueue._swa_tail_len",
    ),
}

NOT_IN_RELEASE = "not in this release"


@dataclass(frozen=True)
class Suspect:
    """One function to look at: ``sglang/<path>`` and its qualified name, and whether the tree has it."""

    path: str
    qualname: str
    present: bool

    def __str__(self) -> str:
        where = f"sglang/{self.path} {self.qualname}"
        return where if self.present else f"{where} ({NOT_IN_RELEASE})"


def defines(source: str, qualname: str) -> bool:
    r"""Whether ``source`` (one module's text) defines ``qualname`` (``func`` or ``Class.method``), read
    with :mod:`ast` (nothing is imported or run).

    >>> code = "class Q(\n    object,\n):\n    def _swa_tail_len(self, n):\n        return n\n"
    >>> code += "\ndef free(x):\n    pass\n"
    >>> defines(code, "Q._swa_tail_len"), defines(code, "free"), defines(code, "Q.free")
    (True, True, False)
    """
    try:
        scope: list[ast.stmt] = ast.parse(source).body
    except SyntaxError:
        return False
    *owners, name = qualname.split(".")
    for owner in owners:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return False
        scope = cls.body
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in scope)


def suspects(key: str, root: Path | None) -> list[Suspect]:
    """The functions to look at for rule or evidence class ``key`` in the tree at ``root``.

    Args:
        key: a ledger rule or an evidence class (a key of :data:`SUSPECTS`).
        root: the directory holding the target's ``sglang/`` (None: not known; every function counts
            as present).

    Returns:
        The suspects, most likely first (empty for a key nothing maps).
    """
    out = []
    texts: dict[str, str | None] = {}
    for entry in SUSPECTS.get(key, ()):
        path, _, qualname = entry.partition(":")
        if root is not None and path not in texts:
            file = Path(root) / "sglang" / path
            texts[path] = file.read_text(encoding="utf-8", errors="replace") if file.is_file() else None
        if root is None:
            out.append(Suspect(path, qualname, True))
            continue
        text = texts[path]
        out.append(Suspect(path, qualname, text is not None and defines(text, qualname)))
    return out
